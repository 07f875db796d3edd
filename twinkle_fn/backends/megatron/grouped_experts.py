"""MoE experts on torch's grouped GEMM, with megatron-core ``SequentialMLP``'s parameters.

`GroupedSequentialMLP` keeps ``SequentialMLP``'s modules and parameter names
(``local_experts.{i}.linear_fc1.weight``...), so the bridge, LoRA's refusal of experts, dist
checkpoints and export see the same model; only the forward changes: all local experts run in
two grouped GEMMs (fc1, activation, fc2) over the tokens the dispatcher sorted by expert,
instead of a Python loop of ``2 * num_local_experts`` matmuls.

`grouped_linear` stacks the experts' weights inside its forward and again inside its backward,
so the stacked copy is never saved for backward (saving it would double expert weight memory
per layer). Expert LoRA (`twinkle_fn.backends.megatron.lora_linear.ExpertLora`, registered as
the submodules ``lora_fc1`` / ``lora_fc2``) adds its update to the grouped GEMM's output. Expert linears communicate nothing inside the MLP (megatron's
``explicit_expert_comm``: the token dispatcher gathers and reduces over the expert
tensor-parallel group), so each rank multiplies by its own shard of each expert, as
``SequentialMLP`` does.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


def _kernel_fits(*mats: Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: its kernels need every row stride
    to be a multiple of 16 bytes (on CPU too) and refuse empty operands (a rank that received
    no tokens); CUDA needs bfloat16."""
    if any(m.numel() == 0 for m in mats):
        return False
    if mats[0].is_cuda and any(m.dtype != torch.bfloat16 for m in mats):
        return False
    return all((m.shape[-1] * m.element_size()) % 16 == 0 for m in mats)


def _mm_per_group(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``x[rows of g] @ w[g]`` for each group g; `x` ``[tokens, k]``, `w` ``[groups, k, n]``."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    return torch.cat([xg @ wg for xg, wg in zip(x.split(counts), w, strict=True)])


def _wgrad_per_group(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """``dy[rows of g].T @ x[rows of g]`` per group: ``[groups, n, k]``."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    return torch.stack(
        [dg.t() @ xg for dg, xg in zip(dy.split(counts), x.split(counts), strict=True)]
    )


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``[tokens, n]``: rows of `x` ``[tokens, k]`` in group g times `w[g]` (`w`: ``[groups, k, n]``).

    `offs` ``[groups]`` int32: the cumulative group ends (the last one is ``tokens``). torch's
    grouped GEMM where it takes the operands (`_kernel_fits`), else a loop over groups.
    """
    if _kernel_fits(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return _mm_per_group(x, w, offs)


def grouped_wgrad(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """``[groups, n, k]``: per group g, ``dy_g.T @ x_g`` (`dy` ``[tokens, n]``, `x` ``[tokens, k]``).

    The 2d x 2d grouped GEMM (the groups split the contraction over tokens); a group of zero
    tokens gets zeros. Loop over groups where the kernel does not take the operands.
    """
    if _kernel_fits(dy, x):
        return torch._grouped_mm(dy.t(), x, offs=offs)
    return _wgrad_per_group(dy, x, offs)


class _GroupedLinear(torch.autograd.Function):
    """``y = x_g @ W_g.T`` for every group g, weights given one tensor per group."""

    @staticmethod
    def forward(ctx, x: Tensor, offs: Tensor, *weights: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, offs, *weights)  # the parameters, not the stacked copy
        return grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, offs, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_mm(dy, torch.stack(weights), offs) if ctx.needs_input_grad[0] else None
        dw = grouped_wgrad(dy, x, offs)  # [groups, out, in]
        return (dx, None, *dw.unbind(0))


def grouped_linear(x: Tensor, offs: Tensor, weights: list[Tensor]) -> Tensor:
    """``[tokens, out]``: each row of `x` ``[tokens, in]`` times its group's weight transposed.

    `weights`: one ``[out, in]`` tensor per group (`offs` ``[groups]`` int32, cumulative ends).
    Gradients flow to `x` and to every weight (zeros for a group with no rows).
    """
    return _GroupedLinear.apply(x, offs, *weights)


def grouped_supported(config: TransformerConfig) -> bool:
    """Whether `GroupedSequentialMLP` computes this config's experts in grouped GEMMs.

    Not for fp8/fp4, expert biases, TE's activation modules, or a fused activation other than
    SwiGLU: those run ``SequentialMLP``'s loop.
    """
    fused_ok = not config.bias_activation_fusion or (
        config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    )
    return not (
        config.fp8 or config.fp4 or config.add_bias_linear or config.use_te_activation_func
    ) and bool(fused_ok)


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` (same parameters, names and sharded state dict) whose forward runs the
    local experts as two grouped GEMMs. Configs `grouped_supported` refuses run the loop."""

    def forward(
        self,
        permuted_local_hidden_states: Tensor,
        tokens_per_expert: Tensor,
        permuted_probs: Tensor,
    ) -> tuple[Tensor, None]:
        """``([tokens, hidden], None)``: every token through its expert, scaled by its prob.

        `permuted_local_hidden_states` ``[tokens, hidden]`` sorted by local expert,
        `tokens_per_expert` ``[num_local_experts]`` (summing to ``tokens``), `permuted_probs`
        ``[tokens]``; applied on the input under ``moe_apply_probs_on_input``, else after the
        activation, as ``SequentialMLP`` does.
        """
        if not grouped_supported(self.config):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError(
                    f"moe_apply_probs_on_input=True with moe_router_topk="
                    f"{self.config.moe_router_topk}; it needs moe_router_topk=1"
                )
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        h = self._with_lora("lora_fc1", grouped_linear(x, offs, fc1), x, offs)
        h = self._activate(h, probs)  # [tokens, (2 *) ffn / etp]
        out = self._with_lora("lora_fc2", grouped_linear(h, offs, fc2), h, offs)
        return out, None  # [tokens, hidden]: partial sums under etp

    def _with_lora(self, name: str, y: Tensor, x: Tensor, offs: Tensor) -> Tensor:
        lora = self._modules.get(name)
        if lora is None or not lora.enabled:
            return y
        return y + lora(x, offs)

    def _activate(self, h: Tensor, probs: Tensor) -> Tensor:
        """``MLP.forward``'s activation scaled by `probs` ``[tokens]``, for a bias-free expert."""
        config = self.config
        if config.bias_activation_fusion:
            return weighted_bias_swiglu_impl(
                h, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store
            )
        if config.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            if (val := config.activation_func_clamp_value) is not None:
                gate = gate.clamp(min=None, max=val)
                linear = linear.clamp(min=-val, max=val)
            out = config.activation_func(gate) * (linear + config.glu_linear_offset)
        else:
            out = config.activation_func(h)
        return (out * probs.unsqueeze(-1)).to(out.dtype)
