"""The conformance suite of the family table: every row of `twinkle_fn.models.families`, through
its tiny config (`twinkle_fn.testing.tiny_config`), passes every check below; adding a row runs
them (``pytest tests/test_family_conformance.py -k <family>``).

- the HF <-> megatron-core bridge round trip is bit-exact on every tp / pp / ep in {1, 2} (one
  process, every rank's tensors built in turn) and through real ranks: two spawned gloo ranks
  load each family's weights onto tp2, pp2 (and ep2 for MoE) and `tf.export_weights` gives
  them back bit for bit;
- the megatron model's per-token log-probabilities equal the HF model's (float32, 1e-5
  absolute: the same sums in another order; observed <= 1e-6);
- one training step (AdamW, lr 1e-2) is the same on both backends: loss and grad norm to a
  relative 1e-5, parameters to 2e-4 absolute (Adam moves an element with an almost-zero
  gradient by up to lr on the sign of float32 noise; see `backends/megatron/backend_test.py`),
  and the same on the two-rank meshes as on one process (same tolerances);
- the transformers backend's tp plan names every linear of a decoder layer that can be split;
- a LoRA adapter saved by the megatron backend loads in peft with the megatron model's
  log-probabilities (1e-5);
- `tf.export_weights` of the transformers backend loads into a fresh HF model bit for bit, and
  its per-token log-probabilities equal the HF model's (1e-5).

A row whose `Family.megatron` gives a reason (megatron-core cannot express the family) runs the
transformers checks; the megatron backend must refuse it at ``tf.init`` with that reason.

Spawns: one process (megatron-core takes seconds to import) and one world of two ranks, each
module-scoped and covering every family in turn.
"""

import itertools
import tempfile

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

import twinkle_fn as tf
from twinkle_fn.backends.buckets import persistent_buffers
from twinkle_fn.backends.megatron.bridge import hf_to_mcore, mcore_to_hf
from twinkle_fn.data import pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.export_test import consume, hf_logps
from twinkle_fn.models.families import FAMILIES, family
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

LOGPS_ATOL, LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5, 2e-4
LR = 1e-2
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
# The rows megatron-core builds, and those only the transformers backend trains.
MEGATRON = tuple(name for name in FAMILIES if family(name).megatron is None)
TRANSFORMERS_ONLY = tuple(name for name in FAMILIES if family(name).megatron is not None)
# Rows the transformers backend splits over tp (`Family.tensor_parallel`: None).
TRANSFORMERS_TP = tuple(name for name in FAMILIES if family(name).tensor_parallel is None)
# Rows whose router has an expert bias: a checkpoint buffer, zero in a fresh model.
EXPERT_BIAS = tuple(
    name for name in MEGATRON if family(name).moe and family(name).moe.expert_bias is not None
)


def _meshes(name: str) -> list[dict]:
    """The two-rank meshes of a family: tp2 and pp2, and ep2 when it has experts (megatron-core
    trains MoE layers under tp only with sequence parallelism)."""
    if family(name).moe is None:
        return [{"tp": 2}, {"pp": 2}]
    return [{"tp": 2, "sequence_parallel": True}, {"pp": 2}, {"dp": 2, "ep": 2}]


def _hf(name: str) -> torch.nn.Module:
    """The HF model both backends start from (``from_hf_config(..., seed=0)``)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()


def _on_disk(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s tensors under their checkpoint names (experts one tensor each)."""
    return revert_weight_conversion(module, dict(module.state_dict()))


def _batch():
    return pad_collate(random_features(4, seed=99), pad_token_id=0)


def _step(name: str, backend: str, sizes: dict[str, int] | None = None) -> dict:
    """One AdamW step of the seed-0 model on the mesh of `sizes` (each rank its slice of the
    batch): the float32 export of the initial weights, loss, grad norm, the weights after the
    step (HF names)."""
    mesh = tf.Mesh(**(sizes or {}))
    model = tf.models.from_hf_config(tiny_config(name), seed=0, backend=backend)
    if backend == "megatron":
        tx = tf.optim.megatron_optimizer(LR, clip_grad=0.0, weight_decay=0.0)
    else:
        tx = tf.optim.adamw(LR, weight_decay=0.0)
    state = tf.init(model, tx, mesh)
    exported = {n: t.clone() for b in tf.export_weights(state, dtype=torch.float32) for n, t in b}
    feats = random_features(4, seed=99)
    mine = pad_collate(feats[mesh.get_slice(len(feats), rank())], pad_token_id=0)
    state, info = tf.step(state, tf.fwd_bwd(state, mine)[0])
    params = revert_weight_conversion(_hf(name), tf.unshard(state))
    return dict(
        exported=exported, loss=float(info["loss"]), norm=float(info["grad_norm"]), params=params
    )


def _assert_same_step(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL)
    assert got["norm"] == pytest.approx(want["norm"], rel=LOSS_RTOL)
    assert got["params"].keys() == want["params"].keys()
    for n, p in got["params"].items():
        torch.testing.assert_close(p, want["params"][n], rtol=0, atol=PARAM_ATOL, msg=n)


def _megatron_checks(name: str, adapter_dir: str) -> dict:
    """On the megatron backend: the initial weights' log-probs, one step, and a LoRA adapter
    (random B) saved to `adapter_dir` with the log-probs it gives."""
    from twinkle_fn.backends.megatron import parallel

    model = tf.models.from_hf_config(tiny_config(name), seed=0, backend="megatron")
    state = tf.init(model, tf.optim.megatron_optimizer(LR))
    out = {"logps": tf.token_logps(state, _batch())["logps"]}
    parallel.destroy()
    out["step"] = _step(name, "megatron")
    parallel.destroy()
    model = tf.models.from_hf_config(tiny_config(name), seed=0, backend="megatron")
    state = tf.init(tf.lora.add_lora(model, LORA), tf.optim.megatron_optimizer(LR))
    out["lora_logps"] = tf.token_logps(state, _batch())["logps"]
    tf.lora.save_adapter(state, adapter_dir)
    parallel.destroy()
    return out


def _biased_hf(name: str, root: str) -> str:
    """The seed-0 HF model with a random router expert bias (large enough to change which
    experts tokens choose), saved under `root`; its directory."""
    hf = _hf(name)
    bias = family(name).moe.expert_bias
    gen = torch.Generator().manual_seed(1)
    for module in hf.modules():
        if hasattr(module, bias):
            getattr(module, bias).copy_(torch.randn(getattr(module, bias).shape, generator=gen))
    path = f"{root}/{name}_biased"
    hf.save_pretrained(path)
    return path


def _megatron_biased_logps(name: str, root: str) -> torch.Tensor:
    """The megatron backend's log-probs of `_biased_hf`, loaded from its files."""
    from twinkle_fn.backends.megatron import parallel

    model = tf.models.from_pretrained(_biased_hf(name, root), backend="megatron")
    logps = tf.token_logps(tf.init(model, tf.optim.megatron_optimizer(LR)), _batch())["logps"]
    parallel.destroy()
    return logps


def _refusal(name: str) -> str:
    """The megatron backend's error for a family megatron-core cannot express."""
    model = tf.models.from_hf_config(tiny_config(name), seed=0, backend="megatron")
    try:
        tf.init(model, tf.optim.megatron_optimizer(LR))
    except ValueError as e:
        return str(e)
    return "accepted"


def _one_process(root: str) -> dict:
    out = {name: _megatron_checks(name, f"{root}/{name}") for name in MEGATRON}
    for name in EXPERT_BIAS:
        out[name]["biased_logps"] = _megatron_biased_logps(name, root)
    return out | {name: _refusal(name) for name in TRANSFORMERS_ONLY}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return root, spawn(_one_process, 1, str(root), timeout_s=600)[0]


def _two_ranks() -> dict:
    """Per family and mesh: `_step` on the mesh (its export: the seed-0 weights loaded there)."""
    from twinkle_fn.backends.megatron import parallel

    out = {}
    for name in MEGATRON:
        for sizes in _meshes(name):
            out[name, str(sizes)] = _step(name, "megatron", sizes)
            parallel.destroy()
    for name in TRANSFORMERS_TP:
        out[name, "transformers-tp2"] = _step(name, "transformers", {"tp": 2})
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_two_ranks, 2, timeout_s=600)


def test_every_row_has_a_tiny_config():
    for name in FAMILIES:
        assert tiny_config(name).model_type == name


@pytest.mark.parametrize("name", TRANSFORMERS_ONLY)
def test_megatron_refuses_a_family_it_cannot_express_with_the_reason(one_process, name):
    message = one_process[1][name]
    assert f"model family {name!r} is supported by the transformers backend but not" in message
    assert family(name).megatron in message and "backend='transformers'" in message


@pytest.mark.parametrize("name", MEGATRON)
def test_bridge_round_trip_is_bit_exact_on_every_layout(name):
    config, state = tiny_config(name), _on_disk(_hf(name))
    ep_sizes = (1, 2) if family(name).moe else (1,)
    for tp, pp, ep in itertools.product((1, 2), (1, 2), ep_sizes):
        local = {
            (t, p, e): hf_to_mcore(
                state, config, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep
            )
            for t, p, e in itertools.product(range(tp), range(pp), range(ep))
        }
        back = dict(mcore_to_hf(local, config, tp_size=tp, pp_size=pp, ep_size=ep))
        assert back.keys() == state.keys(), (tp, pp, ep)
        assert all(torch.equal(back[n], t) for n, t in state.items()), (tp, pp, ep)


@pytest.mark.parametrize("name", MEGATRON)
def test_two_ranks_load_and_export_every_weight_bit_exact(two_ranks, name):
    want = _on_disk(_hf(name))
    for per_rank in two_ranks:
        for sizes in _meshes(name):
            got = per_rank[name, str(sizes)]["exported"]
            assert got.keys() == want.keys(), sizes
            assert all(torch.equal(got[n], t) for n, t in want.items()), sizes


@pytest.mark.parametrize("name", MEGATRON)
def test_a_training_step_on_two_ranks_equals_one_process(one_process, two_ranks, name):
    """tp2, pp2 (and ep2 over dp2 for MoE) against the one-process megatron step."""
    for per_rank in two_ranks:
        for sizes in _meshes(name):
            _assert_same_step(per_rank[name, str(sizes)], one_process[1][name]["step"])


@pytest.mark.parametrize("name", TRANSFORMERS_TP)
def test_a_transformers_tp2_step_equals_one_process(two_ranks, name):
    """The transformers backend's tp plan on two ranks trains as one process: every replicated
    parameter whose gradient each rank computes from its own heads only (q/k norms) is summed
    over tp."""
    want = _step(name, "transformers")
    for per_rank in two_ranks:
        _assert_same_step(per_rank[name, "transformers-tp2"], want)


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_logps_equal_the_hf_models(one_process, name):
    got = one_process[1][name]["logps"]
    torch.testing.assert_close(got, hf_logps(_hf(name), _batch()), rtol=0, atol=LOGPS_ATOL)


@pytest.mark.parametrize("name", EXPERT_BIAS)
def test_megatron_routes_with_the_checkpoints_expert_bias(one_process, name):
    """A random bias moves tokens to other experts: megatron, loading the files, follows."""
    root, runs = one_process
    biased = AutoModelForCausalLM.from_pretrained(root / f"{name}_biased", dtype=torch.float32)
    want = hf_logps(biased.eval(), _batch())
    torch.testing.assert_close(runs[name]["biased_logps"], want, rtol=0, atol=LOGPS_ATOL)
    assert (want - hf_logps(_hf(name), _batch())).abs().max() > 1e-4  # the bias mattered


@pytest.mark.parametrize("name", MEGATRON)
def test_one_training_step_is_the_same_on_both_backends(one_process, name):
    mega, ref = one_process[1][name]["step"], _step(name, "transformers")
    _assert_same_step(mega, ref)
    init = _on_disk(_hf(name))
    assert any(not torch.equal(p, init[n]) for n, p in ref["params"].items())


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tp_plan_splits_every_linear_that_can_be(name):
    """Every ``nn.Linear`` of a decoder layer is in the plan, but a shared expert's ``[1, hidden]``
    gate and the row's `tp_whole` linears (the routed experts and routers are not linears:
    transformers fuses them), and every
    plan entry is a linear of some layer (first dense layers and MoE layers differ)."""
    row = family(name)
    shared = row.moe.shared if row.moe else None
    whole = {shared.gate} if shared and shared.gate else set()
    whole |= set(row.tp_whole)
    seen = set()
    # q_lora_rank=None: MLA's q_proj in place of q_a_proj/q_b_proj (other families ignore it)
    variants = (_hf(name), AutoModelForCausalLM.from_config(tiny_config(name, q_lora_rank=None)))
    for layer in (layer for hf in variants for layer in hf.model.layers):
        linears = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        assert linears - whole <= set(row.tp_plan), name
        seen |= linears - whole
    assert seen == set(row.tp_plan), name


@pytest.mark.parametrize("name", MEGATRON)
def test_a_megatron_lora_adapter_loads_in_peft(one_process, name):
    root, runs = one_process
    model = PeftModel.from_pretrained(_hf(name), root / name).eval()
    got = hf_logps(model, _batch())
    torch.testing.assert_close(got, runs[name]["lora_logps"], rtol=0, atol=LOGPS_ATOL)
    with model.disable_adapter():
        base = hf_logps(model, _batch())
    assert (got - base).abs().max() > 1e-3  # the adapter changed the model


@pytest.mark.parametrize("name", FAMILIES)
def test_the_transformers_export_loads_into_an_hf_model(name):
    state = tf.init(tf.models.from_hf_config(tiny_config(name), seed=0), tf.optim.adamw(LR))
    state, _ = tf.step(state, tf.fwd_bwd(state, _batch())[0])
    stream = tf.export_weights(state, dtype=torch.float32, bucket_bytes=16 << 10)
    with tempfile.TemporaryDirectory() as files:
        hf, _ = consume(stream, tiny_config(name), 16 << 10, files if family(name).moe else None)
    # persistent buffers (a router's expert bias) are exported as they are: not trained
    untrained = persistent_buffers(state.model.module)
    want = revert_weight_conversion(_hf(name), tf.unshard(state) | untrained)
    got = _on_disk(hf)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], t) for n, t in want.items())
    logps = tf.token_logps(state, _batch())["logps"]
    torch.testing.assert_close(hf_logps(hf, _batch()), logps, rtol=0, atol=LOGPS_ATOL)


@pytest.mark.parametrize("name", TRANSFORMERS_ONLY)
def test_a_transformers_lora_adapter_loads_in_peft(tmp_path, name):
    model = tf.lora.add_lora(tf.models.from_hf_config(tiny_config(name), seed=0), LORA)
    state = tf.init(model, tf.optim.adamw(LR))
    tf.lora.save_adapter(state, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(_hf(name), tmp_path / "adapter").eval()
    got = tf.token_logps(state, _batch())["logps"]
    torch.testing.assert_close(hf_logps(peft_model, _batch()), got, rtol=0, atol=LOGPS_ATOL)
    with peft_model.disable_adapter():
        assert (hf_logps(peft_model, _batch()) - got).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU)")
@pytest.mark.parametrize("backend", ["transformers", "megatron"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_bf16_training_step_on_gpu(name, backend):
    """One bf16 AdamW step of each family's tiny model on one GPU: its loss is the float32 CPU
    step's to bf16 rounding (2e-2 relative: 8-bit mantissas through two layers), the grad norm
    is finite and the step moves the weights. A family megatron-core cannot express is refused
    there, with its reason."""
    import torch.distributed as dist

    from twinkle_fn.backends.megatron import parallel

    model = tf.models.from_hf_config(
        tiny_config(name), seed=0, backend=backend, device="cuda", precision="bf16"
    )
    if backend == "megatron":
        tx = tf.optim.megatron_optimizer(LR, clip_grad=0.0, weight_decay=0.0)
    else:
        tx = tf.optim.adamw(LR, weight_decay=0.0)
    try:
        if backend == "megatron" and family(name).megatron is not None:
            with pytest.raises(ValueError, match=f"model family {name!r} is supported by the"):
                tf.init(model, tx)
            return
        state = tf.init(model, tx)
        before = {n: p.detach().float().cpu() for n, p in tf.unshard(state).items()}
        state, info = tf.step(state, tf.fwd_bwd(state, _batch())[0])
        after = tf.unshard(state)
        assert float(info["loss"]) == pytest.approx(_step(name, "transformers")["loss"], rel=2e-2)
        assert torch.isfinite(info["grad_norm"]).item()
        assert any(not torch.equal(p.float().cpu(), before[n]) for n, p in after.items())
    finally:
        if backend == "megatron" and dist.is_initialized():
            parallel.destroy()
            dist.destroy_process_group()
