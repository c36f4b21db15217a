"""Run a function in N processes that share a torch.distributed process group.

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes, each of
which joins a process group (gloo on CPU; NCCL with ``device = cuda:rank`` when
enough GPUs are visible), calls ``fn(*args, **kwargs)`` and sends its return
value back through ``torch.save``. A worker's exception is re-raised in the
parent with that rank's traceback; a hung run is killed after ``timeout``, its
report holding where each rank's threads were (Python's faulthandler, on SIGUSR1).

Workers come from a forkserver that has already imported torch and
Megatron-Core, so a launch costs a fork, not a fresh interpreter. The
forkserver must not initialise CUDA (it answers CUDA availability from NVML),
so that an NCCL worker initialises CUDA itself after the fork. Where importing
Megatron-Core does initialise it (FlashAttention-4, which Megatron-Core's
attention imports, asks the device at import), a forked worker could not use
CUDA at all, so every worker starts as a fresh interpreter instead; a probe
interpreter tells, once per process, on machines with a GPU. A gloo worker
hides the GPUs before anything asks, so that Megatron's "current device" is
the CPU its tensors live on. ``R3_NCCL_WORKERS=spawn`` starts NCCL workers as
fresh interpreters too, for a platform where CUDA misbehaves after a fork.
Ranks meet through a file store in the run's own temporary directory, so
concurrent runs (``pytest -n``) never race for a port.
"""

import contextlib
import datetime
import faulthandler
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# Saved before tests' CPU view (tests/conftest.py) patches torch.cuda.is_available.
_cuda_is_available = torch.cuda.is_available
_PRELOAD = ["torch", "megatron.core.models.gpt", "megatron.core.pipeline_parallel", "megatron_r3"]
_forkserver = None


class WorkerError(RuntimeError):
    """A worker raised; the message holds each failed rank's traceback."""


def default_backend(world_size: int) -> str:
    """NCCL when every rank can have its own visible GPU, gloo otherwise.

    Tests without the ``gpu`` marker see no GPU (``tests/conftest.py``), so theirs is gloo.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def worker_device() -> torch.device:
    """The device a worker computes on: ``cuda:rank`` under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout: float = 180.0,
    backend: Optional[str] = None,
    **kwargs,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

    Args:
        fn: A module-level function (it is pickled by name). Inside it the default
            process group is initialised; ``torch.distributed.get_rank()`` is its rank.
        world_size: Number of processes.
        *args: Positional arguments of ``fn``; must be picklable.
        timeout: Seconds the whole run may take; also the process-group timeout.
        backend: ``"gloo"`` or ``"nccl"``; default :func:`default_backend`.
        **kwargs: Keyword arguments of ``fn``; must be picklable.

    Returns:
        The return values of ``fn``, indexed by rank (loaded onto the CPU).

    Raises:
        WorkerError: a worker raised, exited abnormally, or the run timed out.
    """
    backend = backend or default_backend(world_size)
    ctx = _get_context(backend)
    with tempfile.TemporaryDirectory(prefix="r3-workers-") as outdir:
        procs = [
            ctx.Process(
                target=_worker_main,
                args=(fn, rank, world_size, backend, timeout, outdir, args, kwargs),
                name=f"r3-worker-{rank}",
            )
            for rank in range(world_size)
        ]
        # The forkserver, started by the first launch, keeps this environment; a spawned gloo
        # worker must not see the GPUs while its imports run.
        hidden = {"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" and ctx is not _forkserver else {}
        with _environ(PYTORCH_NVML_BASED_CUDA_CHECK="1", **hidden):
            for proc in procs:
                proc.start()
        try:
            _wait(procs, timeout, outdir)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        return [
            torch.load(os.path.join(outdir, f"{rank}.pt"), map_location="cpu", weights_only=False)
            for rank in range(world_size)
        ]


def _get_context(backend: str):
    if (backend == "nccl" and os.environ.get("R3_NCCL_WORKERS") == "spawn") or _preload_initialises_cuda():
        return multiprocessing.get_context("spawn")
    global _forkserver
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(_PRELOAD)
    return _forkserver


@functools.cache
def _preload_initialises_cuda() -> bool:
    """Whether importing the forkserver's modules initialises CUDA, asked of a fresh interpreter."""
    if not _cuda_is_available():
        return False
    probe = (f"import importlib, torch\nfor name in {_PRELOAD!r}: importlib.import_module(name)\n"
             f"print(torch.cuda.is_initialized())")
    env = dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="1")
    answer = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return answer.stdout.split()[-1] == "True"


@contextlib.contextmanager
def _environ(**values):
    """Set environment variables while spawned children start (they copy os.environ)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait(procs, timeout: float, outdir: str) -> None:
    """Wait for every worker; raise as soon as one fails (its peers would hang)."""
    deadline = time.monotonic() + timeout
    while any(proc.is_alive() for proc in procs):
        failed = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
        if failed:
            # Give the peers a moment to report their own errors, then stop them.
            grace = time.monotonic() + 5
            while time.monotonic() < grace and any(proc.is_alive() for proc in procs):
                time.sleep(0.05)
            raise WorkerError(_failure_report(procs, outdir))
        if time.monotonic() > deadline:
            running = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
            for rank in running:  # each writes its threads' stacks to its .stacks file
                os.kill(procs[rank].pid, signal.SIGUSR1)
            time.sleep(2)
            raise WorkerError(
                f"timed out after {timeout:.0f}s; ranks still running: {running}\n"
                + _failure_report(procs, outdir)
            )
        time.sleep(0.02)
    if any(proc.exitcode != 0 for proc in procs):
        raise WorkerError(_failure_report(procs, outdir))


def _failure_report(procs, outdir: str) -> str:
    parts = []
    for rank, proc in enumerate(procs):
        err = os.path.join(outdir, f"{rank}.err")
        if os.path.exists(err):
            with open(err) as f:
                parts.append(f"--- rank {rank} raised:\n{f.read()}")
        elif proc.exitcode not in (None, 0):
            parts.append(f"--- rank {rank} exited with code {proc.exitcode} and no traceback")
        stacks = os.path.join(outdir, f"{rank}.stacks")
        if os.path.exists(stacks) and os.path.getsize(stacks):
            with open(stacks) as f:
                parts.append(f"--- rank {rank} was at:\n{f.read()}")
    return "\n".join(parts) or "no worker reported an error"


def _worker_main(fn, rank, world_size, backend, timeout, outdir, args, kwargs):
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA is first queried, which is after this
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # The CPU machine is shared: one compute thread per rank.
    torch.set_num_threads(1)
    # Where a hung run's ranks were: the parent signals them at its timeout. The file stays open for it.
    faulthandler.register(signal.SIGUSR1, file=open(os.path.join(outdir, f"{rank}.stacks"), "w"), all_threads=True)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            # Layout comparisons need the same fp32 math on every rank.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group(
            backend,
            init_method="file://" + os.path.join(outdir, "store"),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
            device_id=torch.device("cuda", rank) if backend == "nccl" else None,
        )
        result = fn(*args, **kwargs)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
