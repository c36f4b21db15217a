"""Which engine generates the loop's rollouts (``--rollout-engine``), and building it.

``megatron``: megatron-core's ``DynamicInferenceEngine`` (KV cache;
:mod:`megatron_r3.rl.rollout.megatron_engine`). ``local``: the built-in engine, which runs every
layout and on CPUs (:mod:`megatron_r3.rl.rollout.engine`). Without the flag, ``megatron``
where it runs, else ``local``.

Both replay their passes as CUDA graphs (``--no-rollout-cuda-graphs`` turns them off) where a
model replica is one GPU whose MoE layers keep their token counts on the device
(:func:`~megatron_r3.rl.model.forward_graphs.graphs_apply`). Megatron's engine captures its
own (its model built with ``cuda_graph_impl="local"``), whose graph managers need Megatron's
RNG tracker graph-safe: :func:`graph_safe_rng_tracker` tells :func:`~megatron_r3.rl.initialize.initialize`
to seed it so. ``--inference-cuda-graph-scope`` picks what one of them holds: each layer's own (``layer``:
captured on the engine's first steps) or the whole transformer block (``block``: Megatron's
``InferenceCudaGraphScope.block``, captured when the engine starts; one replay a decode step).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core import tensor_parallel

from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.rl.model.factory import ModelSettings, build_model, transformer_config
from megatron_r3.rl.model.forward_graphs import graphs_apply
from megatron_r3.rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_r3.rl.rollout.megatron_engine import MegatronRolloutEngine, flash_attention_name, megatron_engine_problem

ROLLOUT_ENGINES = ("megatron", "local")
ENGINE_GRAPH_SCOPES = ("layer", "block")
# Megatron's engine's graphs: token counts log-spaced up to its largest step (InferenceConfig.num_cuda_graphs).
MEGATRON_ENGINE_CUDA_GRAPHS = 8


@dataclass(frozen=True)
class RolloutEngineSettings:
    """The rollout engine a run asks for, and how it generates.

    Attributes:
        requested: ``"megatron"``, ``"local"``, or None: Megatron's where it runs, else the built-in one.
        sampling: How it samples.
        staleness: Optimizer steps its weights trail the policy's.
        cuda_graphs: The engine's passes replay CUDA graphs where they apply (module docstring).
        graph_scope: What one of Megatron's engine's graphs holds: ``"layer"`` or ``"block"`` (module docstring).
    """

    requested: Optional[str]
    sampling: SamplingParams
    staleness: int = 0
    cuda_graphs: bool = True
    graph_scope: str = "layer"

    def __post_init__(self):
        if self.requested not in (None, *ROLLOUT_ENGINES):
            raise ValueError(f"--rollout-engine must be one of {ROLLOUT_ENGINES}, got {self.requested!r}")
        if self.graph_scope not in ENGINE_GRAPH_SCOPES:
            raise ValueError(f"--inference-cuda-graph-scope must be one of {ENGINE_GRAPH_SCOPES}, "
                             f"got {self.graph_scope!r}")


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
                         spec: RoutingSpec, rows: RowLayout, per_rank: int,
                         max_sample_tokens: Optional[int] = None) -> Union[RolloutEngine, MegatronRolloutEngine]:
    """The engine ``settings`` ask for, on ``model``'s bf16 copy, trailing ``policy``'s weights by
    ``settings.staleness`` steps.

    Args:
        per_rank: Samples this data-parallel rank generates per iteration.
        max_sample_tokens: The most tokens of a prompt and its completion, what Megatron's engine sizes its
            KV cache for; None: a whole row of ``rows``.
    """
    engine = resolve_rollout_engine(settings.requested, model, device)
    config = transformer_config(model, device, rollout_engine=True)
    if engine == "local":
        return RolloutEngine(lambda: build_model(model, config, device), policy, spec, rows, settings.sampling,
                             settings.staleness, cuda_graphs=settings.cuda_graphs)
    # Whether graphs apply shows on a built replica (its experts' and dispatchers' kind); one with
    # graph managers is built only then, as they capture what they run.
    if (settings.cuda_graphs and tensor_parallel.get_cuda_rng_tracker().use_cudagraphable_rng
            and graphs_apply(build_model(model, config, device))):
        config = graphed_engine_config(config, settings.graph_scope)
        num_cuda_graphs = MEGATRON_ENGINE_CUDA_GRAPHS
    else:
        num_cuda_graphs = None
    return MegatronRolloutEngine(lambda: build_model(model, config, device), policy, spec, settings.sampling,
                                 settings.staleness, max_requests=per_rank,
                                 max_sequence_length=max_sample_tokens or rows.seq_length,
                                 num_cuda_graphs=num_cuda_graphs)


def graphed_engine_config(config, graph_scope: str):
    """A copy of ``config`` whose model Megatron's engine runs with its own CUDA graphs, each holding what
    ``graph_scope`` says. ``"layer"`` leaves the inference scope as the config made it without graphs, so each
    layer's graph manager captures on the engine's first steps; ``"block"`` makes the transformer block own them
    (Megatron's ``InferenceCudaGraphScope.block``), which the engine captures when it starts."""
    from megatron.core.transformer.enums import InferenceCudaGraphScope

    config = copy.copy(config)
    config.cuda_graph_impl = "local"
    if graph_scope == "block":
        config.inference_cuda_graph_scope = InferenceCudaGraphScope.block
    return config


def engine_summary(engine: Union[RolloutEngine, MegatronRolloutEngine], trainer_bf16: bool) -> str:
    """One start-up line: which engine generates the rollouts, and what its log-probs can differ from the
    trainer's by (the built-in engine runs the trainer's own layers and kernels)."""
    if isinstance(engine, MegatronRolloutEngine):
        graphs = (f"{engine.num_cuda_graphs} CUDA graphs {engine.graph_owner}" if engine.num_cuda_graphs
                  else "eager steps")
        return (f" rollouts: Megatron's DynamicInferenceEngine (paged KV cache, {flash_attention_name()}, batched "
                f"decode, {graphs}), an inference engine's kernels against the trainer's")
    graphs = ", CUDA graphs" if engine.graphs is not None and engine.graphs.enabled else ""
    line = f" rollouts: the built-in engine (the policy's own layers in bf16, no KV cache{graphs})"
    if trainer_bf16:
        return (line + ": it runs the trainer's own forward and kernels in the trainer's precision, so its "
                       "log-probs differ from the trainer's only where GEMM shapes round differently; no inference "
                       "engine's mismatch to show (docs/launcher.md)")
    return line + ": against the trainer's fp32, the mismatch shown is bf16 inference against fp32 training"


def graph_safe_rng_tracker(settings: Optional[RolloutEngineSettings], model: ModelSettings,
                           device: torch.device) -> bool:
    """Whether Megatron's RNG tracker must be graph-safe (``use_cudagraphable_rng``) for the rollout engine
    (None: rollouts from a dump): Megatron's engine with CUDA graphs asked for (its graph managers assert
    it when they are built)."""
    return (settings is not None and settings.cuda_graphs
            and resolve_rollout_engine(settings.requested, model, device) == "megatron")
