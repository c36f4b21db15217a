"""Megatron's local experts run as two grouped GEMMs, without TransformerEngine.

:class:`GroupedGemmExperts` is ``SequentialMLP`` with the same submodules, parameters,
state dict and sharded state dict (checkpoints move between the two), whose forward runs
every local expert's first linear layer as one grouped GEMM over the tokens sorted by
expert, the activation once, and every second linear layer as one more: 4 to 6 operators
per MoE layer instead of 4 or 5 per expert. The grouped GEMM is torch's
(``torch.nn.functional.grouped_mm``), with the group offsets as a tensor on the experts'
device, so the forward and backward read nothing back to the host. A small model's pass
costs the host's time to issue its operators (docs/benchmarks.md), which is what this saves.

The grouped path takes what ``MLP.forward`` computes without fusions: the activation (or
the gated one), the router's probability per token, the second linear layer. On a GPU with
TransformerEngine, SwiGLU and the probability run as TE's scaled SwiGLU, one kernel each way
(fp32 math, one rounding at the store) instead of about five elementwise ones. Anything
else (biases, expert tensor parallelism, fp8, ``moe_apply_probs_on_input``, selective
recompute of the activation, delayed weight gradients, a device or dtype where torch's
grouped GEMM does not run forward and backward, or reads its offsets back to the host: on
CUDA anything but bf16) runs ``SequentialMLP.forward``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


@lru_cache(maxsize=None)
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs, forward and backward, on this device type and dtype."""
    if not hasattr(F, "grouped_mm"):  # public from torch 2.10; older ones run SequentialMLP.forward
        return False
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else device_type
    try:
        # The first MoE layer to ask may run in a forward-only pass: under no_grad (the built-in
        # rollout engine) or inference_mode (Megatron's inference engine), where the backward
        # cannot run and the answer, cached for the training passes too, would be a wrong False.
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
            out = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
            out.backward(torch.ones_like(out))
            return bool(torch.all(out == 16)) and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@lru_cache(maxsize=None)
def te_scaled_swiglu(device_type: str, dtype: torch.dtype):
    """TransformerEngine's extension where its scaled SwiGLU kernels run on this device type in ``dtype``
    and give, forward and backward, what SwiGLU times a per-row scale gives under autograd; else None."""
    try:
        # TE's package loads its core library, which the extension links against, then the extension:
        # imported alone (a model of local layers has not imported TE) the extension does not load.
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine_torch as tex
    except (ImportError, OSError):  # OSError: a shared library of TE's that does not load
        return None
    if not (hasattr(tex, "scaled_swiglu") and hasattr(tex, "scaled_dswiglu")):
        return None
    # The first MoE layer to ask may run under no_grad or inference_mode (the rollout engines').
    with torch.inference_mode(False), torch.enable_grad():
        gen = torch.Generator().manual_seed(0)
        x, scales, grad = (torch.randn(3, 32, generator=gen), torch.rand(3, generator=gen),
                           torch.randn(3, 16, generator=gen))
        x, scales, grad = (t.to(device_type, dtype) for t in (x, scales, grad))
        try:
            out = tex.scaled_swiglu(x, scales, None, 0)
            grad_x, grad_scales = tex.scaled_dswiglu(grad, x, scales, None, 0, True)
        except RuntimeError:
            return None
        x32, scales32 = x.float().requires_grad_(), scales.float().requires_grad_()
        gate, linear = x32.chunk(2, dim=-1)
        want = F.silu(gate) * linear * scales32[:, None]
        want_grad_x, want_grad_scales = torch.autograd.grad(want, [x32, scales32], grad.float())
    close = dict(rtol=2e-2, atol=2e-2)
    if not (out.shape == want.shape and grad_x.shape == x.shape and grad_scales.shape == scales.shape
            and torch.allclose(out.float(), want, **close) and torch.allclose(grad_x.float(), want_grad_x, **close)
            and torch.allclose(grad_scales.float(), want_grad_scales, **close)):
        return None
    return tex


class ScaledSwiGLU(torch.autograd.Function):
    """``silu(x[:, :F]) * x[:, F:] * probs[:, None]`` as TransformerEngine's scaled SwiGLU: one kernel
    forward, one backward (the gradients of ``x`` and of ``probs``). The probabilities enter in ``x``'s
    dtype, as TE's ``ScaledSwiGLU`` operation (Megatron's fused ``TEGroupedMLP``) passes them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        scales = probs.to(x.dtype)
        ctx.save_for_backward(x, scales)
        ctx.probs_dtype = probs.dtype
        return te_scaled_swiglu(x.device.type, x.dtype).scaled_swiglu(x, scales, None, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, scales = ctx.saved_tensors
        grad_x, grad_scales = te_scaled_swiglu(x.device.type, x.dtype).scaled_dswiglu(
            grad, x, scales, None, 0, ctx.needs_input_grad[1])
        return grad_x, None if grad_scales is None else grad_scales.to(ctx.probs_dtype)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x[rows of g] @ weight[g].T`` for each group ``g`` of ``x``'s rows (sorted by group).

    ``weight`` is ``[groups, out, in]``, ``ends`` the int32 group ends on ``x``'s device.
    """
    return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)


class GroupedGemmExperts(SequentialMLP):
    """``SequentialMLP`` whose local experts run as grouped GEMMs (see the module docstring)."""

    @property
    def takes_device_tokens_per_expert(self) -> bool:
        """Whether the forward takes ``tokens_per_expert`` on the device without reading it back.

        On one expert rank the dispatcher hands every experts module the counts on the device
        (patch "moe: the alltoall dispatcher leaves token counts on the device at one tp_ep
        rank"); where this holds the forward never reads them back, so the pass makes no sync
        (``megatron_r3.rl.model.forward_graphs`` captures such passes). What only the input tells (an
        empty input, a dtype or device where no grouped GEMM runs) still runs
        ``SequentialMLP.forward``, which reads device counts back: right, with a sync.
        """
        config = self.config
        return (
            self.num_local_experts > 1
            and self.tp_group.size() == 1
            and not config.add_bias_linear
            and not (config.fp8 or config.fp4)
            and not config.moe_apply_probs_on_input
            and not config.use_te_activation_func
            and not config.bias_activation_fusion
            and not config.gradient_accumulation_fusion
            and not config.delay_wgrad_compute
            and config.recompute_granularity != "selective"
            and self._offsets_stay_on_device()
        )

    def _offsets_stay_on_device(self) -> bool:
        """Whether torch's grouped GEMM reads its group offsets where they are: on the CPU, or
        on CUDA in bf16 (its grouped kernels). In other dtypes on CUDA it copies them to the
        host and loops over the groups, a sync per GEMM that ``SequentialMLP`` with host
        counts does not make."""
        weight = self.local_experts[0].linear_fc1.weight
        return weight.device.type != "cuda" or weight.dtype == torch.bfloat16

    def _runs_grouped(self, hidden: torch.Tensor) -> bool:
        if not self.takes_device_tokens_per_expert or hidden.shape[0] == 0:
            return False
        return self._aligned(hidden) and grouped_mm_runs(hidden.device.type, hidden.dtype)

    def _aligned(self, hidden: torch.Tensor) -> bool:
        """torch's grouped GEMM kernels on CUDA take rows of whole 16-byte multiples."""
        expert = self.local_experts[0]
        widths = (hidden.shape[-1], *expert.linear_fc1.weight.shape, *expert.linear_fc2.weight.shape)
        return all(width * hidden.element_size() % 16 == 0 for width in widths)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """Every expert's tokens (sorted by expert, ``tokens_per_expert`` each) through its MLP."""
        hidden = permuted_local_hidden_states
        if not self._runs_grouped(hidden):
            return super().forward(hidden, tokens_per_expert, permuted_probs)
        offsets = _group_offsets(tokens_per_expert, hidden.device)
        experts = self.local_experts
        fc1 = torch.stack([expert.linear_fc1.weight for expert in experts])  # [experts, out, in]
        fc2 = torch.stack([expert.linear_fc2.weight for expert in experts])
        intermediate = grouped_matmul(hidden, fc1, offsets)
        if self._fused_swiglu(intermediate, permuted_probs):
            intermediate = ScaledSwiGLU.apply(intermediate, permuted_probs)
        else:
            intermediate = self._activation(intermediate)
            intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)
        return grouped_matmul(intermediate, fc2, offsets), None

    def _fused_swiglu(self, x: torch.Tensor, probs: torch.Tensor) -> bool:
        """Whether the activation and the probability run as TE's scaled SwiGLU: plain SwiGLU (no clamp,
        no offset) on a GPU where TE's kernels run in ``x``'s dtype."""
        config = self.config
        return (x.is_cuda and config.gated_linear_unit and config.activation_func is F.silu
                and config.activation_func_clamp_value is None and not config.glu_linear_offset
                and probs.dim() == 1 and te_scaled_swiglu("cuda", x.dtype) is not None)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """``MLP.forward``'s activation without fusions, gated or not."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)


def _group_offsets(tokens_per_expert, device: torch.device) -> torch.Tensor:
    """The grouped GEMM's ``offs``: the end of each expert's rows, int32 on ``device``.

    Counts the dispatcher left on the device stay there. Host counts (the dispatcher's, or
    replay's host split sizes) go up without a sync: pinned and copied asynchronously on a GPU.
    """
    counts = torch.as_tensor(tokens_per_expert)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    if ends.device == device:
        return ends
    if device.type == "cuda":
        ends = ends.pin_memory()
    return ends.to(device, non_blocking=True)
