"""Packing routes between the global per-sample layout and a rank's router layout.

Two directions, one pass each, driven by a :class:`~megatron_r3.dataplane.device.plan.RoutingPlan`:

* :func:`gather_routes` (replay): compact source ``ids [N, L, K]`` (uint8/int16)
  and the per-token ``valid [N]`` -> this rank's ``expert_ids [L_local, n_local, K]``
  int64, a row of -1 where there is no route (padding, tokens without routes).
* :func:`scatter_routes` (record): this rank's recorded ``expert_ids`` -> rows
  of the global compact layout and a per-row ``recorded [N, L]`` mask, in place;
  rows the rank does not see are left as they are, so the parts of several
  ranks and chunks combine.

Each has three implementations that agree exactly: a pure-torch reference
(``*_reference``), the C++ CPU kernel and the CUDA kernel (``megatron_r3._C``).
The front ends pick the compiled kernel for the tensors' device and fall back
to the reference when the extension was not built.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    from megatron_r3 import _C
except ImportError:  # extension not built: the reference path still works
    _C = None


def check_packing_args(
    compact_ids: torch.Tensor, mask: torch.Tensor, mask_dims: int, token_index: torch.Tensor, layer_index: torch.Tensor
) -> None:
    """Raise ValueError on arguments the kernels would reject, before any kernel runs.

    ``mask`` is bool with the leading ``mask_dims`` sizes of ``compact_ids``
    (gather's per-token ``valid``, scatter's per-row ``recorded``).

    Bounds are checked for host plans only: reading a device plan would sync with
    the device, and device plans come from :class:`~megatron_r3.dataplane.device.plan.RoutingPlan`.
    """
    if compact_ids.dtype not in (torch.uint8, torch.int16):
        raise ValueError(f"compact ids must be uint8 or int16, got {compact_ids.dtype}")
    if compact_ids.dim() != 3:
        raise ValueError(f"compact ids must be [tokens, layers, topk], got shape {tuple(compact_ids.shape)}")
    if mask.dtype != torch.bool or mask.shape != compact_ids.shape[:mask_dims]:
        raise ValueError(
            f"mask must be bool {tuple(compact_ids.shape[:mask_dims])}, got {mask.dtype} {tuple(mask.shape)}"
        )
    if token_index.dtype != torch.int32 or layer_index.dtype != torch.int32:
        raise ValueError(
            f"token_index and layer_index must be int32, got {token_index.dtype} and {layer_index.dtype}"
        )
    if not token_index.is_cpu:
        return
    num_tokens, num_layers = compact_ids.shape[0], compact_ids.shape[1]
    bad = ((token_index < -1) | (token_index >= num_tokens)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"token_index[{i}] = {int(token_index[i])} outside [-1, {num_tokens})")
    bad = ((layer_index < 0) | (layer_index >= num_layers)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"layer_index[{i}] = {int(layer_index[i])} outside [0, {num_layers})")


def gather_routes_reference(
    ids: torch.Tensor, valid: torch.Tensor, token_index: torch.Tensor, layer_index: torch.Tensor
) -> torch.Tensor:
    """Pure-torch gather; the definition the kernels are tested against."""
    tokens = token_index.long()
    padding = tokens < 0
    tokens = tokens.clamp(min=0)
    layers = layer_index.long()
    picked = ids[tokens][:, layers].long()  # [n, l, K]
    routed = valid[tokens] & ~padding  # [n]
    out = torch.where(routed[:, None, None], picked, torch.full_like(picked, -1))
    return out.permute(1, 0, 2).contiguous()


def scatter_routes_reference(
    expert_ids: torch.Tensor,
    token_index: torch.Tensor,
    layer_index: torch.Tensor,
    out_ids: torch.Tensor,
    out_recorded: torch.Tensor,
) -> None:
    """Pure-torch scatter, in place; the definition the kernels are tested against."""
    rows = expert_ids.permute(1, 0, 2)  # [n, l, K]
    recorded = (rows != -1).any(dim=2) & (token_index >= 0)[:, None]
    token_pos, layer_pos = torch.nonzero(recorded, as_tuple=True)
    dst_tokens = token_index.long()[token_pos]
    dst_layers = layer_index.long()[layer_pos]
    out_ids[dst_tokens, dst_layers] = rows[token_pos, layer_pos].to(out_ids.dtype)
    out_recorded[dst_tokens, dst_layers] = True


def gather_routes(
    ids: torch.Tensor,
    valid: torch.Tensor,
    token_index: torch.Tensor,
    layer_index: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This rank's ``expert_ids [L_local, n_local, K]`` int64 from compact routes.

    Args:
        ids: Compact source ids ``[N, L, K]``, uint8 or int16, contiguous.
        valid: bool ``[N]``, per source token; False = no route (the live router decides).
        token_index: int32 ``[n_local]`` (:attr:`RoutingPlan.token_index`), -1 = padding.
        layer_index: int32 ``[L_local]`` (:attr:`RoutingPlan.layer_index`).
        out: Optional preallocated int64 output.

    All tensors on one device. Launches one kernel on the current stream; never
    synchronises with the host.
    """
    check_packing_args(ids, valid, 1, token_index, layer_index)
    if _C is not None and (ids.is_cpu or _C.WITH_CUDA):
        return _C.gather_routes(ids, valid, token_index, layer_index, out)
    result = gather_routes_reference(ids, valid, token_index, layer_index)
    if out is None:
        return result
    return out.copy_(result)


def scatter_routes(
    expert_ids: torch.Tensor,
    token_index: torch.Tensor,
    layer_index: torch.Tensor,
    out_ids: torch.Tensor,
    out_recorded: torch.Tensor,
) -> None:
    """Writes this rank's recorded routes into the global compact layout, in place.

    Args:
        expert_ids: Recorded ``[L_local, n_local, K]`` int64 or int32 in router order;
            a row of all -1 means nothing was recorded there.
        token_index: int32 ``[n_local]`` from the plan the routes were recorded under.
        layer_index: int32 ``[L_local]`` from the same plan.
        out_ids: Compact ``[N, L, K]`` uint8/int16 to write into.
        out_recorded: bool ``[N, L]``, set True where a row is written.
    """
    check_packing_args(out_ids, out_recorded, 2, token_index, layer_index)
    if _C is not None and (expert_ids.is_cpu or _C.WITH_CUDA):
        _C.scatter_routes(expert_ids, token_index, layer_index, out_ids, out_recorded)
    else:
        scatter_routes_reference(expert_ids, token_index, layer_index, out_ids, out_recorded)
