"""Which engine generates the loop's rollouts (``--rollout-engine``), and building it.

``megatron``: megatron-core's ``DynamicInferenceEngine`` (KV cache;
:mod:`megatron_r3.rl.rollout.megatron_engine`). ``local``: the built-in engine, which runs every
layout and on CPUs (:mod:`megatron_r3.rl.rollout.engine`). Without the flag, ``megatron``
where it runs, else ``local``.
"""

from __future__ import annotations

import argparse
from typing import Union

import torch

from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.rl.rollout.megatron_engine import MegatronRolloutEngine, megatron_engine_problem
from megatron_r3.rl.model.factory import ModelSettings, build_model, transformer_config
from megatron_r3.rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_r3.rl.rollout.tasks import EOS

ROLLOUT_ENGINES = ("megatron", "local")


def resolve_rollout_engine(args: argparse.Namespace, device: torch.device) -> str:
    """``--rollout-engine``, its default filled: ``megatron`` where Megatron's engine runs, else ``local``.

    Raises:
        ValueError: ``--rollout-engine megatron`` where it cannot run (the message says why).
    """
    if args.rollout_engine == "local":
        return "local"
    problem = megatron_engine_problem(args, device)
    if problem is None:
        return "megatron"
    if args.rollout_engine == "megatron":
        raise ValueError(f"--rollout-engine megatron cannot run here: {problem} (--rollout-engine local runs "
                         f"the built-in engine)")
    return "local"


def build_rollout_engine(args: argparse.Namespace, model: ModelSettings, device: torch.device, policy: list, spec: RoutingSpec,
                         rows: RowLayout, per_rank: int) -> Union[RolloutEngine, MegatronRolloutEngine]:
    """The engine ``--rollout-engine`` names, trailing ``policy``'s weights by ``--rollout-staleness`` steps.

    Args:
        per_rank: Samples this data-parallel rank generates per iteration.
    """
    sampling = SamplingParams(args.rollout_temperature, args.max_new_tokens, EOS, args.seed)
    if resolve_rollout_engine(args, device) == "local":
        config = transformer_config(model, device, rollout_engine=True)
        return RolloutEngine(lambda: build_model(model, config, device), policy, spec, rows, sampling,
                             args.rollout_staleness, cuda_graphs=args.rollout_cuda_graphs)
    config = transformer_config(model, device, rollout_engine=True)
    return MegatronRolloutEngine(lambda: build_model(model, config, device), policy, spec, sampling,
                                 args.rollout_staleness, max_requests=per_rank, max_sequence_length=args.seq_length)
