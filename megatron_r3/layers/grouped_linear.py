"""fp32 grouped linear layers on CUDA that read no group ends back to the host.

torch's grouped GEMM (``torch._grouped_mm``) runs in bf16 on Hopper with the group offsets on
the device; in fp32 on CUDA it loops over the groups on the host and reads the offsets back,
a device sync per call. :func:`grouped_linear` runs the same product with kernels of our own
(``csrc/grouped_linear_cuda.cu``) that read the group ends on the device, forward and
backward, so an fp32 MoE layer with grouped experts can run with no sync (and be captured
in a CUDA graph). Plain fp32 arithmetic, no TF32: equal to per-group matmuls up to the
order of the sums.
"""

from __future__ import annotations

import torch

try:
    from megatron_r3 import _C
except ImportError:  # not built: grouped_linear_runs() says so
    _C = None


def grouped_linear_runs(x: torch.Tensor) -> bool:
    """Whether :func:`grouped_linear` takes ``x``: fp32 on CUDA, with the CUDA kernels built."""
    return x.is_cuda and x.dtype == torch.float32 and _C is not None and _C.WITH_CUDA


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, ends)
        return _C.grouped_linear_forward(x, weight, ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _C.grouped_linear_grad_input(grad, weight, ends) if ctx.needs_input_grad[0] else None
        grad_weight = _C.grouped_linear_grad_weight(grad, x, ends) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each group's rows of ``x`` through its own Linear weight, differentiably.

    Args:
        x: fp32 CUDA ``[rows, in]``, the rows sorted by group.
        weight: fp32 ``[groups, out, in]``, every group's Linear weight.
        ends: int32 ``[groups]`` on ``x``'s device: where each group's rows end
            (``torch._grouped_mm``'s ``offs``); never read on the host.

    Returns:
        ``[rows, out]``: ``x[rows of g] @ weight[g].T`` for every group ``g`` (zero for rows after
        the last end).
    """
    if not grouped_linear_runs(x):
        raise ValueError(f"grouped_linear takes fp32 CUDA rows with the CUDA kernels built, got {x.dtype} on "
                         f"{x.device}")
    return _GroupedLinear.apply(x.contiguous(), weight.contiguous(), ends)
