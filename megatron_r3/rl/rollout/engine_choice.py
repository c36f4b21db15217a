"""Which engine generates the loop's rollouts (``--rollout-engine``), and building it.

``megatron``: megatron-core's ``DynamicInferenceEngine`` (KV cache;
:mod:`megatron_r3.rl.rollout.megatron_engine`). ``local``: the built-in engine, which runs every
layout and on CPUs (:mod:`megatron_r3.rl.rollout.engine`). Without the flag, ``megatron``
where it runs, else ``local``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.rl.model.factory import ModelSettings, build_model, transformer_config
from megatron_r3.rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_r3.rl.rollout.megatron_engine import MegatronRolloutEngine, megatron_engine_problem

ROLLOUT_ENGINES = ("megatron", "local")


@dataclass(frozen=True)
class RolloutEngineSettings:
    """The rollout engine a run asks for, and how it generates.

    Attributes:
        requested: ``"megatron"``, ``"local"``, or None: Megatron's where it runs, else the built-in one.
        sampling: How it samples.
        staleness: Optimizer steps its weights trail the policy's.
        cuda_graphs: The built-in engine's passes replay CUDA graphs where a model replica is one GPU.
    """

    requested: Optional[str]
    sampling: SamplingParams
    staleness: int = 0
    cuda_graphs: bool = True

    def __post_init__(self):
        if self.requested not in (None, *ROLLOUT_ENGINES):
            raise ValueError(f"--rollout-engine must be one of {ROLLOUT_ENGINES}, got {self.requested!r}")


def resolve_rollout_engine(requested: Optional[str], model: ModelSettings, device: torch.device) -> str:
    """The engine that generates for ``model`` on ``device``: ``requested`` (``--rollout-engine``), or by default
    ``megatron`` where Megatron's engine runs, else ``local``.

    Raises:
        ValueError: ``megatron`` is requested where it cannot run (the message says why).
    """
    if requested == "local":
        return "local"
    problem = megatron_engine_problem(model, device)
    if problem is None:
        return "megatron"
    if requested == "megatron":
        raise ValueError(f"--rollout-engine megatron cannot run here: {problem} (--rollout-engine local runs "
                         f"the built-in engine)")
    return "local"


def build_rollout_engine(settings: RolloutEngineSettings, model: ModelSettings, device: torch.device, policy: list,
                         spec: RoutingSpec, rows: RowLayout,
                         per_rank: int) -> Union[RolloutEngine, MegatronRolloutEngine]:
    """The engine ``settings`` ask for, on ``model``'s bf16 copy, trailing ``policy``'s weights by
    ``settings.staleness`` steps.

    Args:
        per_rank: Samples this data-parallel rank generates per iteration.
    """
    engine = resolve_rollout_engine(settings.requested, model, device)
    config = transformer_config(model, device, rollout_engine=True)
    if engine == "local":
        return RolloutEngine(lambda: build_model(model, config, device), policy, spec, rows, settings.sampling,
                             settings.staleness, cuda_graphs=settings.cuda_graphs)
    return MegatronRolloutEngine(lambda: build_model(model, config, device), policy, spec, settings.sampling,
                                 settings.staleness, max_requests=per_rank, max_sequence_length=rows.seq_length)
