"""What `benchmarks.multi_gpu` measures: the parity models, the meshes each is trained on
against one process, and the speed rows (a backend, a mesh and options each), with the process
count of each and the one-GPU row a speed row scales against."""

from __future__ import annotations

from typing import Any

import twinkle_fn as tf

# The parity models: small enough for seconds per mesh, wide enough for tp2 / cp2 / ep2 splits.
PARITY_MODELS = {
    "dense": dict(
        model_type="qwen2",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    "moe": dict(
        model_type="qwen3_moe",
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        decoder_sparse_step=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}
# mesh name -> (backend, model, mesh sizes, backend options)
MESHES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "fsdp/dp2": ("fsdp", "dense", {"dp": 2}, {}),
    "fsdp/fsdp2": ("fsdp", "dense", {"fsdp": 2}, {}),
    "fsdp/tp2": ("fsdp", "dense", {"tp": 2}, {}),
    "megatron/tp2": ("megatron", "dense", {"tp": 2}, {}),
    "megatron/pp2": ("megatron", "dense", {"pp": 2}, {"num_micro_batches": 2}),
    "megatron/cp2": ("megatron", "dense", {"cp": 2}, {}),
    "megatron/dp2": ("megatron", "dense", {"dp": 2}, {"overlap_param_gather": True}),
    "megatron/ep2": ("megatron", "moe", {"dp": 2, "ep": 2}, {"overlap_param_gather": True}),
    # four ranks (issue 8)
    "fsdp/fsdp4": ("fsdp", "dense", {"fsdp": 4}, {}),
    "fsdp/dp2xfsdp2": ("fsdp", "dense", {"dp": 2, "fsdp": 2}, {}),
    "megatron/tp2xpp2": ("megatron", "dense", {"tp": 2, "pp": 2}, {"num_micro_batches": 2}),
    "megatron/dp2xtp2": ("megatron", "dense", {"dp": 2, "tp": 2}, {}),
    "megatron/ep4": ("megatron", "moe", {"dp": 4, "ep": 4}, {}),
    "megatron/ep2xtp2": (
        "megatron",
        "moe",
        {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
        {},
    ),
}
# speed row -> (backend, mesh sizes, backend options); a row's process count is its mesh's size.
# The megatron rows reduce gradients bucket by bucket during backward (issue 7's overlap).
# "megatron/dp2-gather" also gathers the distributed optimizer's parameters during the next
# forward; it is not a default row: at 1.5B on two H200s it ran 19% slower than megatron/dp2
# (62.1k against 76.2k tok/s, benchmarks/RESULTS.md), so it is there to be profiled on demand.
_OVERLAP = {"overlap_grad_reduce": True}
_OVERLAP_GATHER = {**_OVERLAP, "overlap_param_gather": True}
SPEED_ROWS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "fsdp/1gpu": ("fsdp", {}, {}),
    "fsdp/dp2": ("fsdp", {"dp": 2}, {}),
    "fsdp/fsdp2": ("fsdp", {"fsdp": 2}, {}),
    "fsdp/tp2": ("fsdp", {"tp": 2}, {}),
    "megatron/1gpu": ("megatron", {}, _OVERLAP),
    "megatron/dp2": ("megatron", {"dp": 2}, _OVERLAP),
    "megatron/dp2-gather": ("megatron", {"dp": 2}, _OVERLAP_GATHER),
    "megatron/tp2": ("megatron", {"tp": 2}, _OVERLAP),
    "fsdp/fsdp4": ("fsdp", {"fsdp": 4}, {}),
    "fsdp/dp2xfsdp2": ("fsdp", {"dp": 2, "fsdp": 2}, {}),
    "megatron/tp2xpp2": ("megatron", {"tp": 2, "pp": 2}, _OVERLAP),
    "megatron/dp2xtp2": ("megatron", {"dp": 2, "tp": 2}, _OVERLAP),
}
# The "-compiled" rows compile each decoder layer (``compile_layers``): fewer kernel launches,
# for steps the host bounds in eager mode (benchmarks/NOTES.md, session 6). Each scales against
# its backend's compiled one-GPU row, and they are opt-in until measured on two GPUs.
_COMPILED = {"compile_layers": True}
SPEED_ROWS.update(
    {
        "fsdp/1gpu-compiled": ("fsdp", {}, _COMPILED),
        "fsdp/dp2-compiled": ("fsdp", {"dp": 2}, _COMPILED),
        "fsdp/fsdp2-compiled": ("fsdp", {"fsdp": 2}, _COMPILED),
        "megatron/1gpu-compiled": ("megatron", {}, {**_OVERLAP, **_COMPILED}),
        "megatron/dp2-compiled": ("megatron", {"dp": 2}, {**_OVERLAP, **_COMPILED}),
    }
)
OPT_IN = (  # rows run only when --speed names them
    "megatron/dp2-gather",
    "fsdp/1gpu-compiled",
    "fsdp/dp2-compiled",
    "fsdp/fsdp2-compiled",
    "megatron/1gpu-compiled",
    "megatron/dp2-compiled",
)


def default_speed_rows(nproc: int) -> list[str]:
    """The speed rows of one and of `nproc` processes, without the opt-in ones."""
    return [r for r in SPEED_ROWS if row_world(r) in (1, nproc) and r not in OPT_IN]


def one_gpu_row(row: str) -> str:
    """The one-GPU row `row` scales against: its backend's, with the same variant suffix
    (``fsdp/dp2-compiled`` -> ``fsdp/1gpu-compiled``) where there is one."""
    backend, mesh = row.split("/")
    variant = f"{backend}/1gpu-{mesh.partition('-')[2]}"
    return variant if variant in SPEED_ROWS else f"{backend}/1gpu"


def reference(mesh_name: str) -> str:
    """The one-process reference mesh `mesh_name` is compared with: ``ref/<backend>/<model>``."""
    backend, model, _, _ = MESHES[mesh_name]
    return f"ref/{backend}/{model}"


def mesh_world(mesh_name: str) -> int:
    """The processes parity mesh `mesh_name` runs on."""
    return tf.Mesh(**MESHES[mesh_name][2]).world_size


def row_world(row: str) -> int:
    """The processes speed row `row` runs on."""
    return tf.Mesh(**SPEED_ROWS[row][1]).world_size
