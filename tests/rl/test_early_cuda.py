"""megatron_r3.rl.early_cuda: the launcher's device context, cuBLAS and kernel modules, started on a
thread while Megatron imports; nothing where there is no CUDA device, and the thread's errors reach the
launcher."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_r3.rl import early_cuda


def _run(code: str, **env) -> str:
    """``code`` in a fresh interpreter (its CUDA state is its own); its stdout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_without_a_visible_device_the_thread_ends_without_touching_cuda():
    # torch taken for a CUDA build, so that the thread starts even on a CPU build.
    out = _run("""
        import torch
        torch.version.cuda = torch.version.cuda or "13.0"
        from megatron_r3.rl import early_cuda
        early_cuda.start()
        started = early_cuda._thread is not None
        early_cuda.wait()
        print(started, torch.cuda.is_initialized())
    """, CUDA_VISIBLE_DEVICES="", LOCAL_RANK="0")
    assert out == "True False"


def test_a_cpu_build_of_torch_starts_no_thread(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    early_cuda.start()
    assert early_cuda._thread is None
    early_cuda.wait()  # nothing to wait for


def test_an_error_on_the_thread_is_raised_by_wait(monkeypatch):
    def broken(index):
        raise RuntimeError(f"no context for device {index}")

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(early_cuda, "_retain_primary_context", broken)
    monkeypatch.setenv("LOCAL_RANK", "3")
    early_cuda.start()
    with pytest.raises(RuntimeError, match="no context for device 3"):
        early_cuda.wait()
    early_cuda.wait()  # raised once: the next wait has nothing left


@pytest.mark.gpu
def test_on_a_gpu_the_context_and_cublas_are_ready_when_wait_returns():
    out = _run("""
        import ctypes, torch
        from megatron_r3.rl import early_cuda
        early_cuda.start()
        early_cuda.wait()
        driver = ctypes.CDLL("libcuda.so.1")
        flags, active = ctypes.c_uint(), ctypes.c_int()
        assert driver.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
        kept = torch.cuda.memory_allocated()
        matrix = torch.ones((64, 64), device="cuda")
        (matrix @ matrix).sum().item()
        del matrix
        print(torch.cuda.is_initialized(), active.value, kept > 0, torch.cuda.memory_allocated() == kept)
    """, LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="0")
    # The thread kept only cuBLAS's workspace, and the launcher's thread computes in it: the
    # thread's handle went back to torch's pool, and this thread took it from there.
    assert out == "True 1 True True"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_stand_in_draws_no_random_numbers(dtype):
    state = torch.get_rng_state()
    early_cuda._load_kernels(torch.device("cpu"), dtype)
    assert torch.equal(torch.get_rng_state(), state)
