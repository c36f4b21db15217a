"""Starting CUDA on a thread while the launcher imports Megatron.

A GPU worker's first CUDA work waits in the driver: creating the device's context (0.2-0.3 s
on an H100) and cuBLAS's first matrix product (0.1 s: its handle and its first kernel). The
imports before it (Megatron-Core and what it pulls in) are seconds of Python holding the GIL.
:func:`start` does that CUDA work on a thread meanwhile, through calls that release the GIL:
the driver's own entry points through ``ctypes`` for the context, torch operators for cuBLAS
(a thread's cuBLAS handle goes back to torch's pool when the thread ends, and the launcher's
thread takes it from there). :func:`wait` ends it before the launcher uses CUDA itself: a CUDA
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
    """Starts creating the context of this worker's device (``cuda:LOCAL_RANK``, the launcher's) and
    cuBLAS's state on a thread."""
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
            matrix = torch.ones((64, 64), device=device)
            for dtype in (torch.float32, torch.bfloat16):  # the trainer's products and the engine's
                matrix.to(dtype) @ matrix.to(dtype)
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
