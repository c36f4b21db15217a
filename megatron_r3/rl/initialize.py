"""Process group, Megatron's parallel state and RNG for a launcher run under torchrun (or without it).

It also remembers, in the torchrun agent's store, what an earlier attempt of the same run
created (its metrics file), so that a restarted attempt (``--max-restarts``) carries on.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_r3.rl.model.factory import ParallelSettings
from megatron_r3.rl.rollout.engine_choice import graph_safe_rng_tracker
from megatron_r3.rl.run_checks import RunCheckError, world_problems
from megatron_r3.rl.run_settings import RunSettings



def init_model_parallel(parallel: ParallelSettings, *, create_gloo_process_groups: bool = True) -> None:
    """Megatron's parallel state for ``parallel``'s sizes, on an initialised default process group.

    Args:
        parallel: The parallel sizes.
        create_gloo_process_groups: Also build Megatron's gloo copies of its process groups
            (Megatron-LM's default).
    """
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        create_gloo_process_groups=create_gloo_process_groups,
    )


# What torchrun tells each process it starts (env://); Megatron-LM's launchers read the same.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The torchrun agent's store (None outside torchrun): it outlives a worker group, so a restarted
# attempt reads there what an earlier attempt of the same run noted (_note_metrics_file).
_agent_store: Optional[dist.Store] = None


def init_process_group(device: torch.device, backend: Optional[str] = None) -> None:
    """The default process group from torchrun's environment (``env://``): ``backend``
    (``--distributed-backend``), else NCCL on GPUs and gloo on CPUs, as in Megatron-LM.

    Without torchrun's variables (:data:`TORCHRUN_VARIABLES`) it says how to start the launcher.

    Its store keys are scoped to this attempt of the worker group: after a torchrun restart
    (``--max-restarts``) the agent's store still holds the addresses the dead workers
    published under the same keys, and a restarted worker would try to connect to them.

    No ``device_id``: NCCL communicators are created when a group first communicates,
    not when Megatron builds it. Megatron builds about 25 groups and a run uses a few; each
    communicator costs about 0.45 s to tear down at exit (on one H100, 9.0 s for the
    default run's groups created eagerly against 1.3 s created on first use).
    """
    global _agent_store
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RunCheckError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: torchrun sets them "
                            f"for each process it starts; start the launcher with it: torchrun --nproc-per-node N "
                            f"launch/pretrain_gpt_r3.py [flags] (N processes; 1 for one)")
    store, rank, world_size = next(dist.rendezvous("env://"))
    _agent_store = store
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, store=dist.PrefixStore(f"/worker_group_attempt_{attempt}", store),
                            rank=rank, world_size=world_size)


def initialize(settings: RunSettings) -> torch.device:
    """Process group (from torchrun's environment unless one exists), parallel state and RNG for a run.

    CUDA where it is available, else the CPU; the backend is :func:`init_process_group`'s.
    The parallel sizes' and the batch's arithmetic with the world size is checked before the
    parallel state is built.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        init_process_group(device, settings.distributed_backend)
    parallel = settings.model.parallel
    problems = world_problems(parallel, dist.get_world_size(), global_batch_size=settings.global_batch_size,
                              micro_batch_size=settings.micro_batch_size,
                              rollouts_per_prompt=settings.rollouts.group_size)
    if problems:
        raise RunCheckError("; ".join(problems))
    init_model_parallel(parallel)
    # Graph-safe where a CUDA graph registers the tracker's generators: Megatron's engine's, the update pass's.
    graph_safe = (graph_safe_rng_tracker(settings.rollouts.engine, settings.model, device)
                  or (settings.update.cuda_graphs and device.type == "cuda"))
    tensor_parallel.model_parallel_cuda_manual_seed(settings.seed, use_cudagraphable_rng=graph_safe)
    torch.manual_seed(settings.seed)
    return device


def _metrics_file_key(path: str) -> str:
    return f"megatron_r3/metrics_file_created/{os.path.abspath(path)}"


def noted_by_an_earlier_attempt(path: str) -> bool:
    """Whether an earlier attempt of this torchrun run created the metrics file (:func:`note_metrics_file`)."""
    return _agent_store is not None and _agent_store.check([_metrics_file_key(path)])


def note_metrics_file(path: str) -> None:
    """Tells later attempts of this torchrun run (after a restart) that the metrics file is this run's."""
    if _agent_store is not None:
        _agent_store.set(_metrics_file_key(path), "1")
