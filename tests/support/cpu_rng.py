"""A CPU stand-in for Megatron's CUDA RNG tracker (test scaffolding only).

Megatron forks named CUDA generator states for dropout and initialisation, and
full recompute saves and restores them. On a CPU-only torch those calls fail;
here the same bookkeeping runs on CPU generator states.
"""

import torch
from megatron.core.tensor_parallel import random as megatron_random


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Keeps named CPU generator states instead of CUDA ones."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def install_cpu_rng(seed: int = 1234) -> None:
    """Point Megatron's RNG tracker and recompute state saving at CPU generators."""
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    tracker = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 100)
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    torch.manual_seed(seed)
