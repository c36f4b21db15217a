"""Host time per operator launch on this machine: the floor under a host-bound training pass.

    python -m bench.launch_cost

Issues each operator back to back from Python (after a warmup) and reports the host
microseconds per call and the wall microseconds per call once the device has caught
up: a trivial in-place ``add_``, a ``matmul`` of one shape, ``matmul`` of rows
varying from 1 to 199 (as expert GEMMs vary with their token counts), and
``F.linear``. On a GPU, a training pass of a small model costs about its kernel
count times these figures plus the framework's Python around each operator.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def per_call_us(fn: Callable[[int], object], device: torch.device, calls: int = 2000) -> tuple[float, float]:
    """(host, wall) microseconds per ``fn(i)``: issue time, and time until the device has finished."""
    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(50):
        fn(i)
    wait()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    issued = time.perf_counter()
    wait()
    done = time.perf_counter()
    return 1e6 * (issued - start) / calls, 1e6 * (done - start) / calls


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(64, 128, device=device)
    w = torch.randn(128, 256, device=device)
    rows = [torch.randn(m, 128, device=device) for m in range(1, 200)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"host time per launch on {name} (torch {torch.__version__})")
    for label, fn in (("add_ [64, 128]", lambda i: x.add_(1.0)),
                      ("matmul [64, 128] x [128, 256]", lambda i: torch.matmul(x, w)),
                      ("matmul [1..199, 128] x [128, 256]", lambda i: torch.matmul(rows[i % len(rows)], w)),
                      ("linear [64, 128] -> 256", lambda i: torch.nn.functional.linear(x, w.t()))):
        host, wall = per_call_us(fn, device)
        print(f"{label:36s} host {host:6.1f} us/call   wall {wall:6.1f} us/call")


if __name__ == "__main__":
    main()
