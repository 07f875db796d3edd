"""LoRA on routed experts, both backends: trained on one process and on two ranks (megatron
dp2·ep2 and pp2, transformers fsdp2), exported as a peft adapter that ``PeftModel.from_pretrained``
loads onto the HF model with the trainer's log-probs.

Qwen2-MoE covers every part at once: attention, the shared expert (ordinary linears), the fused
routed experts (``target_parameters``, peft's ``ParamWrapper``) and the gates left frozen. One
spawn per mesh computes every run (`_runs`); the tests compare them.

Tolerances (float32): log-probs of the same adapter through the trainer and through peft 1e-5
(the same matmuls, summed in another order; observed <= 5e-7). Two ranks against one process:
losses and grad norms to a relative 1e-5, adapters after `STEPS` AdamW steps at lr 1e-2 to
2e-4 absolute, as in `backends/megatron/lora_test.py` (an element whose gradient is almost zero
moves by up to lr on the sign of float32 rounding noise). Merged export against peft's
``merge_and_unload`` of the saved adapter 1e-6 (float32 ``W + s * B @ A``, summed in another
order).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

import twinkle_fn as tf
from twinkle_fn.data import pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.export_test import hf_logps
from twinkle_fn.lora import PEFT_PREFIX
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

FAMILY = "qwen2_moe"
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}
STEPS, LR = 2, 1e-2
LOGPS_ATOL, LOSS_RTOL, PARAM_ATOL, MERGED_ATOL = 1e-5, 1e-5, 2e-4, 1e-6
MESHES = {"megatron": {"dp": 2, "ep": 2}, "transformers": {"fsdp": 2}}


def _batch(seed: int, part: slice = slice(None)):
    return pad_collate(random_features(8, seed=seed)[part], pad_token_id=0)


def _optimizer(backend: str):
    return tf.optim.megatron_optimizer(LR) if backend == "megatron" else tf.optim.adamw(LR)


def _run(backend: str, sizes: dict, adapter_dir: str, options: dict | None = None) -> dict:
    """`STEPS` steps of the all-linear adapter on this rank's slice of each batch; the adapter
    (peft keys) at init and after, the losses and norms, the log-probs after; saved."""
    mesh = tf.Mesh(**sizes)
    torch.manual_seed(1)  # the transformers backend's adapter init draws from it
    model = tf.models.from_hf_config(tiny_config(FAMILY), seed=0, backend=backend, options=options)
    state = tf.init(tf.lora.add_lora(model, LORA), _optimizer(backend), mesh)
    # cloned: on one process the transformers backend's tensors are the live parameters
    at_init = {k: t.clone() for k, t in tf.lora.adapter_state_dict(state).items()}
    infos = []
    for i in range(STEPS):
        grads, _ = tf.fwd_bwd(state, _batch(100 + i, mesh.get_slice(8, rank())))
        state, info = tf.step(state, grads)
        infos.append((float(info["loss"]), float(info["grad_norm"])))
    tf.lora.save_adapter(state, adapter_dir)
    exported = {
        mode: dict(
            pair for b in tf.export_weights(state, dtype=torch.float32, lora=mode) for pair in b
        )
        for mode in ("separate", "merged")
    }
    out = dict(
        exported=exported,
        at_init=at_init,
        adapter=tf.lora.adapter_state_dict(state),
        infos=infos,
        logps=tf.token_logps(state, _batch(7))["logps"],
    )
    if backend == "megatron":
        from twinkle_fn.backends.megatron import parallel

        parallel.destroy()
    return out


def _megatron_refusal(sizes: dict, options: dict) -> str:
    """The megatron backend's error for expert LoRA it cannot build, raised at ``tf.init``."""
    from twinkle_fn.backends.megatron import parallel

    model = tf.models.from_hf_config(
        tiny_config(FAMILY), seed=0, backend="megatron", options=options
    )
    try:
        tf.init(tf.lora.add_lora(model, LORA), _optimizer("megatron"), tf.Mesh(**sizes))
    except ValueError as e:
        return str(e)
    finally:
        parallel.destroy()
    return "accepted"


def _runs(root: str, two: bool) -> dict:
    out = {
        backend: _run(backend, MESHES[backend] if two else {}, f"{root}/{backend}-{int(two)}")
        for backend in MESHES
    }
    if two:
        pp2 = _run("megatron", {"pp": 2}, f"{root}/megatron-pp2", {"num_micro_batches": 2})
        out["megatron-pp2"] = pp2
        etp = {"tp": 2, "etp": 2, "sequence_parallel": True}
        out["refused"] = _megatron_refusal(etp, {})
    else:
        out["refused"] = _megatron_refusal({}, {"grouped_experts": False})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_lora")
    one = spawn(_runs, 1, str(root), False, timeout_s=300)[0]
    two = spawn(_runs, 2, str(root), True, timeout_s=300)
    return root, {False: one, True: two[0]}, two


@pytest.mark.parametrize("two", [False, True], ids=["one-process", "two-ranks"])
@pytest.mark.parametrize("backend", list(MESHES))
def test_the_saved_adapter_loads_in_peft_with_the_trainers_logps(runs, backend, two):
    root, by_mesh, _ = runs
    torch.manual_seed(0)  # the base weights of from_hf_config(..., seed=0)
    hf = AutoModelForCausalLM.from_config(tiny_config(FAMILY), dtype=torch.float32).eval()
    path = root / f"{backend}-{int(two)}"
    config = LoraConfig.from_pretrained(path)
    assert sorted(config.target_parameters) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert "shared_expert_gate" not in config.target_modules
    peft_model = PeftModel.from_pretrained(hf, path).eval()
    got = hf_logps(peft_model, _batch(7))
    torch.testing.assert_close(got, by_mesh[two][backend]["logps"], rtol=0, atol=LOGPS_ATOL)
    with peft_model.disable_adapter():
        assert (hf_logps(peft_model, _batch(7)) - got).abs().max() > 1e-3


@pytest.mark.parametrize("two", [False, True], ids=["one-process", "two-ranks"])
@pytest.mark.parametrize("backend", list(MESHES))
def test_weight_export_merges_the_experts_as_peft_does(runs, backend, two):
    root, by_mesh, _ = runs
    run = by_mesh[two][backend]
    separate = run["exported"]["separate"]
    assert separate.keys() == run["adapter"].keys()
    assert all(torch.equal(t, run["adapter"][k]) for k, t in separate.items())
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config(FAMILY), dtype=torch.float32)
    base = revert_weight_conversion(hf, {k: t.clone() for k, t in hf.state_dict().items()})
    merged = PeftModel.from_pretrained(hf, root / f"{backend}-{int(two)}").merge_and_unload()
    want = revert_weight_conversion(merged, dict(merged.state_dict()))
    got = run["exported"]["merged"]
    assert got.keys() == want.keys()
    for k, t in want.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=MERGED_ATOL, msg=k)
    expert = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert (got[expert] - base[expert]).abs().max() > 1e-3  # the expert update is merged


@pytest.mark.parametrize("backend", list(MESHES))
def test_the_experts_shared_expert_and_attention_train_and_the_gates_do_not(runs, backend):
    run = runs[1][False][backend]
    layer = PEFT_PREFIX + "model.layers.0."
    want = {
        f"{layer}{m}.{f}.weight"
        for m in (
            "self_attn.q_proj",
            "self_attn.o_proj",
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.down_proj",
            "mlp.experts",  # down_proj: the outer ParamWrapper
            "mlp.experts.base_layer",  # gate_up_proj: the inner one
        )
        for f in ("lora_A", "lora_B")
    }
    assert want <= run["adapter"].keys()
    assert not [k for k in run["adapter"] if ".gate." in k or "shared_expert_gate" in k]
    experts, r = tiny_config(FAMILY).num_experts, LORA["r"]
    assert run["adapter"][f"{layer}mlp.experts.base_layer.lora_A.weight"].shape[0] == r * experts
    moved = [k for k, t in run["adapter"].items() if not torch.equal(t, run["at_init"][k])]
    assert sorted(moved) == sorted(run["adapter"])


@pytest.mark.parametrize("backend", list(MESHES))
def test_two_ranks_train_the_adapter_like_one_process(runs, backend):
    _, by_mesh, two = runs
    ref = by_mesh[False][backend]
    for per_rank in two:
        run = per_rank[backend]
        for (loss, norm), (ref_loss, ref_norm) in zip(run["infos"], ref["infos"], strict=True):
            assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
            assert norm == pytest.approx(ref_norm, rel=LOSS_RTOL)
        assert run["at_init"].keys() == ref["at_init"].keys()
        assert all(torch.equal(t, ref["at_init"][k]) for k, t in run["at_init"].items())
        for k, t in run["adapter"].items():
            torch.testing.assert_close(t, ref["adapter"][k], rtol=0, atol=PARAM_ATOL, msg=k)


def test_megatron_refuses_expert_lora_it_cannot_build_with_the_fix(runs):
    _, by_mesh, two = runs
    assert "needs twinkle's grouped experts" in by_mesh[False]["refused"]
    assert "target_parameters=[]" in by_mesh[False]["refused"]
    for per_rank in two:
        assert "expert tensor parallelism (etp > 1) is not supported" in per_rank["refused"]


def test_megatron_pp2_trains_exports_and_merges_the_experts_like_one_process(runs):
    """Each pipeline stage holds one layer's experts: the adapter file, the streamed adapter and
    the merged weights come out of both stages."""
    root, by_mesh, two = runs
    ref = by_mesh[False]["megatron"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config(FAMILY), dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, root / "megatron-pp2").eval()
    for per_rank in two:
        run = per_rank["megatron-pp2"]
        torch.testing.assert_close(
            hf_logps(peft_model, _batch(7)), run["logps"], rtol=0, atol=LOGPS_ATOL
        )
        assert run["adapter"].keys() == ref["adapter"].keys()
        assert run["exported"]["separate"].keys() == ref["adapter"].keys()
        assert run["exported"]["merged"].keys() == ref["exported"]["merged"].keys()
        for (loss, norm), (ref_loss, ref_norm) in zip(run["infos"], ref["infos"], strict=True):
            assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
            assert norm == pytest.approx(ref_norm, rel=LOSS_RTOL)
        for k, t in run["adapter"].items():
            torch.testing.assert_close(t, ref["adapter"][k], rtol=0, atol=PARAM_ATOL, msg=k)
