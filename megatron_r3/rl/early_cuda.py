"""Starting CUDA on a thread while the launcher imports Megatron.

A GPU worker's first CUDA work waits in the driver: creating the device's context (0.2-0.3 s
on an H100), cuBLAS's first matrix product (0.1 s: its handle and its first kernel), and the
first use of each kernel module (10-30 ms each, dozens in the loop's first iteration). The
imports before it (Megatron-Core and what it pulls in) are seconds of Python holding the GIL.
:func:`start` does that CUDA work on a thread meanwhile, through calls that release the GIL:
the driver's own entry points through ``ctypes`` for the context, torch operators for cuBLAS
(a thread's cuBLAS handle goes back to torch's pool when the thread ends, and the launcher's
thread takes it from there) and for a tiny stand-in of an iteration's kernels
(:func:`_load_kernels`). :func:`wait` ends it before the launcher uses CUDA itself: a CUDA
graph capture must see no other thread's CUDA work.

Nothing here draws random numbers, and the only memory kept is cuBLAS's workspace, which the
launcher's thread computes in with the same handle: the run computes what it would without it.
Where there is no CUDA device (a CPU build of torch, no driver, no visible device) the thread
finds that out and ends.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import torch

_thread: Optional[threading.Thread] = None
_error: Optional[BaseException] = None


def start() -> None:
    """Starts making the context of this worker's device (``cuda:LOCAL_RANK``, the launcher's), cuBLAS's
    state and the first iteration's kernel modules on a thread."""
    global _thread
    if torch.version.cuda is None or _thread is not None:
        return
    _thread = threading.Thread(target=_run, args=(int(os.environ.get("LOCAL_RANK", "0")),),
                               name="early-cuda", daemon=True)
    _thread.start()


def wait() -> None:
    """Waits for :func:`start`'s thread (nothing without one); raises what it raised."""
    global _thread, _error
    if _thread is None:
        return
    _thread.join()
    _thread, error, _error = None, _error, None
    if error is not None:
        raise error


def _run(index: int) -> None:
    global _error
    try:
        if _retain_primary_context(index):
            device = torch.device("cuda", index)
            torch.cuda.set_device(device)
            for dtype in (torch.float32, torch.bfloat16):  # the trainer's and the engine's
                _load_kernels(device, dtype)
            torch.cuda.synchronize(device)
    except BaseException as error:  # noqa: BLE001  (raised again in the launcher's thread by wait())
        _error = error


def _retain_primary_context(index: int) -> bool:
    """Creates device ``index``'s primary context (the one the CUDA runtime, so torch, uses) through
    the driver API; False where the driver or the device is missing."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    device, context = ctypes.c_int(), ctypes.c_void_p()
    return (driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), index) == 0
            and driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0)


def _load_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """A tiny stand-in for one iteration of the loop, on constant inputs: the kinds of kernels its
    passes run (the model's forward and backward, the engine's sampling, Adam), so that their
    modules are loaded before the loop's first use of each waits for it (10-30 ms a module)."""
    positions = torch.arange(24, device=device)
    seq_id = torch.bucketize(positions, torch.tensor([8, 24], device=device), right=True)
    allowed = (seq_id[:, None] == seq_id[None, :]).logical_and(positions[:, None] >= positions[None, :])
    dead = ~((positions % 8) // 2).clamp(max=3).eq(3)
    weight = torch.ones((16, 16), device=device, dtype=dtype, requires_grad=True)
    embedding = torch.nn.functional.embedding(positions % 16, weight)
    hidden = torch.rms_norm(embedding, (16,)) @ weight
    angles = torch.outer(positions.to(dtype), torch.full((16,), 0.5, device=device, dtype=dtype))
    hidden = hidden * angles.cos() + torch.cat([-hidden[:, 8:], hidden[:, :8]], dim=-1) * angles.sin()
    scores = torch.bmm(hidden[None], hidden[None].transpose(1, 2)).masked_fill(~allowed, float("-inf"))
    hidden = torch.bmm(scores.softmax(-1), hidden[None])[0]
    probs = (hidden @ weight).float().softmax(-1)
    top, experts = torch.topk(probs, 2, dim=-1)
    order = experts.flatten().argsort(stable=True)
    routed = hidden.index_select(0, order // 2) * top.flatten()[order, None].to(dtype)
    counts = torch.zeros(16, dtype=torch.int64, device=device).scatter_add_(0, experts.flatten(),
                                                                           torch.ones_like(order))
    routed = torch.nn.functional.silu(routed) * routed * counts.cumsum(0)[-1].to(dtype)
    hidden = torch.zeros_like(hidden).index_add_(0, order // 2, routed)
    logits = (hidden @ weight.t()).float()
    logprobs = logits.log_softmax(-1).gather(-1, (positions % 16)[:, None])
    loss = torch.where(dead[:, None], logprobs, 0.0).sum() - logits.max(-1).values.exp().log().mean()
    loss.backward()
    cdf = logits.detach().double().nan_to_num().softmax(-1).cumsum(-1)
    torch.searchsorted(cdf, torch.full((24, 1), 0.5, device=device, dtype=torch.float64), right=True)
    torch.isfinite(logits).all(dim=-1).any()
    params, grads = [weight.detach().float()], [weight.grad.float()]
    moments = [torch.zeros_like(params[0]), torch.zeros_like(params[0])]
    torch.linalg.vector_norm(grads[0]).maximum(torch.ones((), device=device))
    torch._foreach_mul_(grads, 0.5)
    torch._foreach_lerp_(moments[:1], grads, 0.1)
    torch._foreach_addcmul_(moments[1:], grads, grads, 0.01)
    denominators = torch._foreach_sqrt(moments[1:])
    torch._foreach_add_(denominators, 1e-8)
    torch._foreach_addcdiv_(params, moments[:1], denominators, -1e-3)
