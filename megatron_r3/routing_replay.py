"""Glue between per-microbatch routes and Megatron's MoERouting forward input.

The data plane produces, per microbatch and per model chunk, an int64 device tensor
``expert_ids [num_local_moe_layers, num_local_tokens, topk]`` (rows of all -1: no route)
and the ``layer_numbers`` its dim 0 follows. A forward step wraps it for the model chunk it
runs, on every pipeline stage (stages without input ids still route their own layers), and
hands it to the model through ``extra_block_kwargs`` (GPTModel and HybridModel take it alike):

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        routing = moe_routing_for_chunk(model, batch["expert_ids"], batch["layer_numbers"])
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       extra_block_kwargs={"moe_routing": routing})
        return output, loss_func

See docs/routing_replay.md.
"""

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron.core.transformer.moe.moe_routing import NO_ROUTE, MoERouting

__all__ = [
    "NO_ROUTE",
    "MoERouting",
    "add_routing_replay_args",
    "chunk_moe_layers",
    "RoutingReplaySettings",
    "moe_routing_for_chunk",
]


def _language_model(model_chunk):
    """The GPTModel or HybridModel inside DDP / Float16Module wrappers."""
    module = model_chunk
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "decoder"):
        raise TypeError(f"{type(model_chunk).__name__} does not wrap a model with a decoder")
    return module


def chunk_moe_layers(model_chunk) -> list:
    """The MoE layers a model chunk (GPTModel or HybridModel) builds: global 1-based layer numbers,
    increasing. MTP layers are not included: the routes of a chunk cover its decoder's MoE layers."""
    return _language_model(model_chunk).decoder.moe_layer_numbers


def moe_routing_for_chunk(
    model_chunk,
    expert_ids: Optional[torch.Tensor] = None,
    layer_numbers: Optional[Sequence[int]] = None,
    every_token_routed: bool = False,
    host_tokens_per_expert: Optional[torch.Tensor] = None,
    record: bool = False,
    keep_live_routes: bool = False,
) -> MoERouting:
    """A MoERouting for one microbatch on ``model_chunk``.

    The arguments are checked against each other and the model before anything runs, each
    message naming the argument: ``expert_ids`` an int64 tensor ``[layers, tokens, topk]`` on the
    model's device with the model's top-k, one row per entry of ``layer_numbers`` (distinct
    MoE layers of the model), ``host_tokens_per_expert`` one count per layer. Where the routes
    are on the CPU their values are checked too, for free: ids in ``[0, num_experts)``, distinct
    within a row, rows all -1 or none, and under ``every_token_routed`` no row of -1. Routes on a
    device are checked so only with the config's ``moe_routing_replay_check_values``
    (``--moe-routing-replay-check-values``: one device sync per forward), and host counts only
    by ``MoERouting.verify()``, which the caller runs after the pass.

    Args:
        model_chunk: the (possibly wrapped) GPTModel or HybridModel chunk the forward step runs.
        expert_ids: int64 ``[len(layer_numbers), num_local_tokens, topk]`` routes, or None
            to route live (the routes taken are recorded either way).
        layer_numbers: the MoE layer each row of ``expert_ids`` belongs to; rows of layers
            other pipeline stages build are dropped, numbers that are no decoder MoE layer of
            the model refused. Default: exactly the chunk's MoE layers.
        every_token_routed: no row of ``expert_ids`` is -1 (known on the host): the routers
            take upstream's precomputed-indices path, no live top-k runs.
        host_tokens_per_expert: int64 CPU ``[tp_ep_size, len(layer_numbers), num_experts]``
            token counts of every rank of the expert tensor-and-model-parallel group, when
            every token replays a route, the same matrix on every rank of the group (the
            all-gather of :mod:`megatron_r3.dataplane.device.expert_counts` gives it), and only where
            Megatron's ``host_counts_unsupported`` is None for the model's config: the alltoall
            dispatcher then takes its split sizes from the host, with no device sync. They
            are trusted until ``MoERouting.verify()`` (counts right in sum but wrong per expert
            send tokens to the wrong experts): call it after the pass, where the host waits anyway.
        record: keep the routes every layer takes (``recorded_expert_ids()``).
        keep_live_routes: also keep what the routers' own top-k chose
            (``live_expert_ids()``, for agreement metrics; costs a live top-k per layer).
    """
    moe_layers = chunk_moe_layers(model_chunk)
    if expert_ids is not None:
        model = _language_model(model_chunk)
        layer_numbers = _check_replay_arguments(
            model, moe_layers, expert_ids, layer_numbers, every_token_routed, host_tokens_per_expert
        )
        _check_layer_numbers(model, moe_layers, layer_numbers)
        if expert_ids.device.type == "cpu":
            _check_host_values(expert_ids, layer_numbers, model.config.num_moe_experts)
        if layer_numbers != moe_layers:
            missing = sorted(set(moe_layers) - set(layer_numbers))
            if missing:
                raise ValueError(
                    f"layer_numbers {layer_numbers} lacks MoE layers {missing} of this chunk (it "
                    f"builds {moe_layers})"
                )
            rows = [layer_numbers.index(n) for n in moe_layers]
            # Rows taken by Python indices, no index tensor: its host-to-device copy would wait for
            # the stream if blocking, and a CUDA graph capture would record its host buffer if not.
            # Consecutive rows (another stage's layers around this chunk's) stay a view; a chunk
            # without MoE layers gets none.
            start = rows[0] if rows else 0
            if rows == list(range(start, start + len(rows))):
                expert_ids = expert_ids[start : start + len(rows)]
            else:
                expert_ids = torch.stack([expert_ids[r] for r in rows])
            if host_tokens_per_expert is not None:
                host_tokens_per_expert = host_tokens_per_expert[:, rows]
    return MoERouting(
        layer_numbers=moe_layers,
        expert_ids=expert_ids,
        every_token_routed=every_token_routed and expert_ids is not None,
        host_tokens_per_expert=host_tokens_per_expert,
        record=record,
        keep_live_routes=keep_live_routes,
    )


def _check_replay_arguments(
    model, moe_layers, expert_ids, layer_numbers, every_token_routed, host_tokens_per_expert
) -> list:
    """``layer_numbers`` as a list (default: the chunk's MoE layers); raises ValueError naming the argument."""
    if not isinstance(expert_ids, torch.Tensor):
        raise ValueError(f"expert_ids must be a torch.Tensor, got {type(expert_ids).__name__}")
    if expert_ids.dtype != torch.int64:
        raise ValueError(
            f"expert_ids must be int64 (the routers gather with it), got {expert_ids.dtype}: "
            "pass expert_ids.long()"
        )
    if expert_ids.dim() != 3:
        raise ValueError(
            f"expert_ids must be [layers, tokens, topk], got shape {tuple(expert_ids.shape)}"
        )
    device = next(model.parameters()).device
    if expert_ids.device != device:
        raise ValueError(f"expert_ids is on {expert_ids.device}, the model on {device}")
    topk = model.config.moe_router_topk
    if expert_ids.shape[2] != topk:
        raise ValueError(
            f"expert_ids holds {expert_ids.shape[2]} experts per token (dim 2), the model's "
            f"moe_router_topk is {topk}"
        )
    given = layer_numbers is not None
    layer_numbers = [int(n) for n in layer_numbers] if given else list(moe_layers)
    name = "layer_numbers" if given else "the chunk's MoE layers (layer_numbers not given)"
    if len(set(layer_numbers)) != len(layer_numbers):
        raise ValueError(f"layer_numbers {layer_numbers} names a layer twice")
    if len(layer_numbers) != expert_ids.shape[0]:
        raise ValueError(
            f"{name} has {len(layer_numbers)} layers {layer_numbers}, expert_ids "
            f"{expert_ids.shape[0]} rows (dim 0): one row per layer"
        )
    if host_tokens_per_expert is not None and (
        host_tokens_per_expert.dim() != 3 or host_tokens_per_expert.shape[1] != len(layer_numbers)
    ):
        raise ValueError(
            f"host_tokens_per_expert must be [tp_ep_size, {len(layer_numbers)} layers, num_experts], "
            f"got shape {tuple(host_tokens_per_expert.shape)}"
        )
    on_device = expert_ids.device.type != "cpu"
    if every_token_routed and (not on_device or model.config.moe_routing_replay_check_values):
        no_route = (expert_ids == NO_ROUTE).all(dim=-1)
        if bool(no_route.any()):  # free on the CPU; one sync on a device, asked for by the config
            row, token = (int(i) for i in no_route.nonzero()[0])
            raise ValueError(
                f"every_token_routed=True, but expert_ids has no route (a row of -1) for token "
                f"{token} at layer {layer_numbers[row]}: pass every_token_routed=False"
                + (f" (checked on {expert_ids.device}: {_DEVICE_CHECK})" if on_device else "")
            )
    return layer_numbers


# How a user turns on the checks of replayed ids that need the device (one sync per forward).
_DEVICE_CHECK = "moe_routing_replay_check_values, --moe-routing-replay-check-values"


def _model_moe_layers(model) -> list:
    """The MoE layers of the whole model a chunk belongs to (every pipeline stage; MTP layers
    excluded), from its config or its hybrid layer pattern, and the chunk's own."""
    from megatron_r3.layers.moe_layers import hybrid_moe_layers, model_moe_layers

    config = model.config
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if pattern is not None:
        layers = hybrid_moe_layers(pattern)
    elif config.num_moe_experts:
        layers = model_moe_layers(config.num_layers, config.moe_layer_freq)
    else:
        layers = ()
    return sorted(set(layers) | set(model.decoder.moe_layer_numbers))


def _check_layer_numbers(model, moe_layers: list, layer_numbers: list) -> None:
    """Every row of ``layer_numbers`` is a MoE layer of the model: rows of other pipeline stages'
    layers are dropped by the chunk, rows of layers that are no MoE layer anywhere are refused."""
    model_layers = _model_moe_layers(model)
    stray = [n for n in layer_numbers if n not in model_layers]
    if not stray:
        return
    raise ValueError(
        f"layer_numbers {layer_numbers} names layers {stray}, not decoder MoE layers of this "
        f"{model.config.num_layers}-layer model (its MoE layers: {model_layers}; MTP layers route "
        f"live here): their rows would be dropped"
    )


def _check_host_values(expert_ids: torch.Tensor, layer_numbers: list, num_experts: int) -> None:
    """Ids in ``[0, num_experts)``, distinct within a row, and rows either routed or all -1
    (no route), checked where the routes are on the host (no device sync)."""
    no_route = (expert_ids == NO_ROUTE).all(dim=-1, keepdim=True)
    partial = ((expert_ids == NO_ROUTE) & ~no_route).any(dim=-1)
    out_of_range = (((expert_ids < 0) | (expert_ids >= num_experts)) & ~no_route).any(dim=-1)
    ordered = expert_ids.sort(dim=-1).values
    duplicate = ((ordered[..., 1:] == ordered[..., :-1]) & ~no_route).any(dim=-1)
    for bad, what in (
        (partial, f"is only partly {NO_ROUTE}: a row is all {NO_ROUTE} (no route) or top-k expert ids"),
        (out_of_range, f"holds an expert id outside [0, {num_experts}) (num_experts)"),
        (duplicate, "names an expert twice"),
    ):
        if bool(bad.any()):
            row, token = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"expert_ids: the row of token {token} at layer {layer_numbers[row]} "
                f"{expert_ids[row, token].tolist()} {what}"
            )


def add_routing_replay_args(
    parser: argparse.ArgumentParser, enable_help: Optional[str] = None
) -> argparse.ArgumentParser:
    """Megatron-style flags for routing replay (mirrors the TransformerConfig fields).

    Args:
        parser: Gets a "routing replay" group.
        enable_help: The help of ``--moe-enable-routing-replay`` where a program gives the flag
            a meaning of its own (the launcher: train on replayed routes).
    """
    group = parser.add_argument_group(title="routing replay")
    group.add_argument(
        "--moe-enable-routing-replay",
        action="store_true",
        help=enable_help
        or "Let MoE routers replay (R3) or record (R2) per-microbatch expert routes given as "
        "the moe_routing forward input; rejects options that would ignore the replayed routes.",
    )
    group.add_argument(
        "--moe-routing-replay-check-values",
        action="store_true",
        help="Also check the replayed expert ids on the device before each forward (range, "
        "duplicates, partly -1 rows): one device sync per forward. Routes from the data plane "
        "are validated on the host already; shapes are always checked.",
    )
    group.add_argument(
        "--no-moe-check-host-tokens-per-expert",
        dest="moe_check_host_tokens_per_expert",
        action="store_false",
        help="Skip the per-expert check of the host token counts the alltoall dispatcher takes "
        "its split sizes from under replay (each layer's counts kept on the device, no sync, and "
        "compared by MoERouting.verify() after the pass).",
    )
    return parser


@dataclass(frozen=True)
class RoutingReplaySettings:
    """The routing-replay fields of a ``TransformerConfig``, as the flags of :func:`add_routing_replay_args`
    set them (:func:`megatron_r3.rl.arguments.routing_replay_settings` reads them from the parsed flags).

    Attributes:
        enabled: The routers take a per-microbatch ``MoERouting`` (``moe_enable_routing_replay``).
        check_values: Check the replayed expert ids on the device before each forward.
        check_host_tokens_per_expert: Check the host token counts per expert, not only per rank.
    """

    enabled: bool = False
    check_values: bool = False
    check_host_tokens_per_expert: bool = True

    def config_kwargs(self) -> dict:
        """``TransformerConfig`` keyword arguments for a loop whose routers take a ``MoERouting`` exactly
        when ``enabled`` (the launcher decides ``moe_enable_routing_replay`` from more flags, in
        :func:`megatron_r3.rl.arguments.model_settings`)."""
        return {"moe_enable_routing_replay": self.enabled, **self.check_kwargs()}

    def check_kwargs(self) -> dict:
        """The ``TransformerConfig`` fields of the replay checks."""
        return {
            "moe_routing_replay_check_values": self.check_values,
            "moe_check_host_tokens_per_expert": self.check_host_tokens_per_expert,
        }
