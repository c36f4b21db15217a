"""The layout harness with routing replay: each microbatch carries forced routes.

Forced routes are given per global token id (``{layer: int64 [num_tokens, k]}``, 0-based
layer index as in ``RouterRecorder``). Each rank turns them into the data-plane contract
for every microbatch and model chunk: ``expert_ids [num_local_moe_layers, num_local_tokens,
k]`` in the router's row order (s-major, after SP scatter and CP partition), padding rows
-1, and hands them to the model as ``moe_routing`` from its forward step, on every
pipeline stage.
"""

import contextlib
import dataclasses
from functools import partial

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange
from megatron_r3.routing_replay import chunk_moe_layers, moe_routing_for_chunk
from tests.support.harness import Step, routes, run_layout
from tests.support.parallel import Layout
from tests.support.routes import full_routes, router_token_index
from tests.support.schedule import loss_func


def random_forced_routes(model, num_tokens: int, seed: int, no_route_every: int = 0) -> dict:
    """Distinct random experts per token for every MoE layer: ``{layer: [num_tokens, k]}``.

    With ``no_route_every=n``, every n-th token has no route (-1 row) in every layer.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in model.moe_layers:
        experts = torch.rand(num_tokens, model.num_experts, generator=gen).topk(model.topk).indices
        if no_route_every:
            experts[::no_route_every] = -1
        out[layer] = experts
    return out


def chunk_expert_ids(chunk, token_index: torch.Tensor, forced: dict) -> torch.Tensor:
    """This chunk's ``[num_moe_layers, len(token_index), k]`` routes; -1 rows for padding."""
    rows = []
    for layer_number in chunk_moe_layers(chunk):
        experts = forced[layer_number - 1][token_index.clamp(min=0).cpu()]
        experts[token_index.cpu() < 0] = -1
        rows.append(experts)
    if not rows:
        k = next(iter(forced.values())).shape[1]
        return torch.empty(0, token_index.numel(), k, dtype=torch.long)
    return torch.stack(rows).to(torch.long)


def replay_forward_step(
    data_iterator,
    model,
    recorder=None,
    forced=None,
    sequence_parallel=False,
    recordings=None,
    exchange=None,
):
    """The harness's forward step, plus this microbatch's routes as ``moe_routing``.

    ``forced=None`` routes live (and only records). Each microbatch's MoERouting is
    appended to ``recordings`` with the global token id of each router row. With an
    ``exchange`` (:class:`~megatron_r3.dataplane.device.expert_counts.ExpertCountExchange`) the routes also
    carry the host token counts of the expert tensor-and-model-parallel group.
    """
    mb = next(data_iterator)
    token_index = router_token_index(mb, sequence_parallel)
    expert_ids = host_counts = None
    complete = False
    if forced is not None:
        expert_ids = chunk_expert_ids(model, token_index, forced)
        complete = bool((expert_ids >= 0).all())  # on the host, before the upload
        if exchange is not None:
            (host_counts,) = exchange.gather([_counts(expert_ids, exchange.num_experts)], [len(expert_ids)])
        expert_ids = expert_ids.to(mb.tokens.device)
    routing = moe_routing_for_chunk(model, expert_ids, every_token_routed=complete,
                                    host_tokens_per_expert=host_counts, record=True)
    if recordings is not None:
        recordings.append((token_index.cpu(), routing))
    # Only the first stage gets token ids: later stages count their router rows from the
    # received activation, and still route their own MoE layers.
    first = get_attr_wrapped_model(model, "pre_process")
    with recorder.microbatch(mb) if recorder else contextlib.nullcontext():
        per_token_loss = model(
            input_ids=mb.tokens if first else None,
            position_ids=mb.position_ids if first else None,
            attention_mask=None,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params,
            extra_block_kwargs={"moe_routing": routing},
        )
    return per_token_loss, partial(loss_func, mb)


def _counts(expert_ids: torch.Tensor, num_experts: int):
    """Tokens per expert per layer of ``[L, n, k]`` routes, or None if a row has no route."""
    if (expert_ids < 0).any():
        return None
    counts = [torch.bincount(ids.reshape(-1), minlength=num_experts) for ids in expert_ids]
    return torch.stack(counts).numpy() if counts else np.zeros((0, num_experts), dtype=np.int64)


def host_count_exchange(config) -> dict:
    """``Step.setup``: the forward step's exchange of host token counts."""
    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    return {"exchange": ExpertCountExchange(group, config.num_moe_experts)}


def run_replay_layout(layout: Layout, data, step: Step, forced: dict, host_counts: bool = False) -> dict:
    """Worker: ``harness.run_layout`` with every microbatch replaying ``forced``.

    With ``host_counts`` each microbatch's routes carry the host token counts (the
    dispatcher's sync-free path).

    Returns what ``run_layout`` returns, plus ``"recorded"``: the routes each
    MoERouting recorded, in ``RouterRecorder.routes`` form.
    """
    fields = dict(step.config_fields)
    if layout.recompute == "selective":
        fields["recompute_modules"] = ["moe"]
    recordings = []
    replay_step = dataclasses.replace(
        step,
        flags=(*step.flags, "--moe-enable-routing-replay"),
        config_fields=tuple(fields.items()),
        forward_step_func=partial(
            replay_forward_step,
            forced=forced,
            sequence_parallel=layout.sp,
            recordings=recordings,
        ),
        setup=host_count_exchange if host_counts else None,
    )
    out = run_layout(layout, data, replay_step)
    out["recorded"] = _recorded_routes(recordings)
    return out


def _recorded_routes(recordings) -> dict:
    """What the MoERoutings recorded, in ``RouterRecorder.routes`` form (experts ascending)."""
    out = {}
    for token_index, routing in recordings:
        real = token_index >= 0
        recorded = routing.recorded_expert_ids().cpu()
        for row, layer_number in enumerate(routing.layer_numbers):
            experts = recorded[row][real].sort(dim=-1).values
            out.setdefault(layer_number - 1, []).append((token_index[real], experts))
    return out


def taken_and_recorded(results: list[dict], num_tokens: int, topk: int) -> dict:
    """The experts each token took (router hooks), ``{layer: [num_tokens, k]}``, after checking that
    every MoERouting recorded exactly those (R2)."""
    taken = routes(results, num_tokens, topk)
    recorded = full_routes([r["recorded"] for r in results], num_tokens, topk)
    assert recorded.keys() == taken.keys()
    for layer in taken:
        assert torch.equal(recorded[layer], taken[layer]), f"layer {layer}: the recording differs from the routes taken"
    return taken
