"""The Megatron backend: HF model families on megatron-core's ``GPTModel``.

- `cpu_compat`: run megatron-core's training path on a CPU-only torch (gloo), never on a GPU;
- `parallel`: megatron-core's process groups and RNG seeds from a `Mesh`;
- `config`: ``TransformerConfig`` from an HF config and a mesh;
- `spec`: layer specs with torch SDPA core attention (TransformerEngine's when importable);
- `context_parallel`: the zigzag batch split and the all-gather attention of context parallelism;
- `model`: ``GPTModel`` of an HF config on this rank's pipeline stage.
- `lora`: LoRA adapters on the parallel linears, exported as a peft adapter.
"""
