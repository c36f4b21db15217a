"""One pass of Megatron's pipeline schedule over prepared rollout microbatches.

The rollout engine, the trainer and the benchmarks run their model chunks the same
way: the microbatches of a pass come from a
:class:`~megatron_r3.dataplane.device.microbatch_pipeline.MicrobatchPipeline` (one ``seq_length`` THD
row each, and each chunk's routes to replay, prepared one microbatch ahead through
the schedules' prefetch hook) and go through ``get_forward_backward_func()`` (no
pipelining, 1F1B or interleaved 1F1B), forward only or forward and backward, with
one forward step. It gives its chunk a fresh ``MoERouting`` when it replays or
records, and the pass hands those back per microbatch and chunk, so a caller can
read the routes taken (``recorded_expert_ids()``) and, when it asked for them, what
the live router preferred (``live_expert_ids()``). Positions no loss can see are
Megatron's ``padding_mask``: the MoE layers leave them out of load balancing.

The model returns vocab-parallel logits ``[1, s_local, vocab / tp]``; the loss
function of the caller turns them into what it needs on the last pipeline
stage (:func:`token_logprobs` for the log-probs of the labels).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_r3.dataplane.device.microbatch_pipeline import PassItem
from megatron_r3.dataplane.device.microbatches import RolloutMicrobatch
from megatron_r3.dataplane.device.prefetch import PreparedMicrobatches
from megatron_r3.rl.model.forward_graphs import ForwardGraphs, RecordedRoutes, forward_model
from megatron_r3.routing_replay import MoERouting, moe_routing_for_chunk

LossFn = Callable[[int, RolloutMicrobatch, torch.Tensor], tuple]
"""``loss_fn(microbatch_index, batch, logits) -> (loss, num_tokens, dict)``, Megatron's loss-function contract."""


@dataclass
class PassResult:
    """What a pass hands back.

    Attributes:
        outputs: The dicts ``loss_fn`` returned, in microbatch order (last pipeline stage
            only; empty elsewhere).
        routings: Per microbatch and chunk, the ``MoERouting`` the forward used, or the routes a
            graph replay recorded (:class:`~megatron_r3.rl.model.forward_graphs.RecordedRoutes`); None
            where it routed live without recording.
        items: Per microbatch and chunk, what the forward step was given.
        host_split_microbatches: Microbatches on the sync-free path: whose routes carried host
            token counts (the dispatcher's split sizes) on every chunk, or that replayed a captured
            pass (:mod:`megatron_r3.rl.trainer.update_graphs`).
    """

    outputs: list[dict]
    routings: list[list[Union[MoERouting, RecordedRoutes, None]]]
    items: list[list[Optional[PassItem]]]
    host_split_microbatches: int

    def verify_routes(self) -> None:
        """Raise on what the pass's forwards found wrong in their routes on the device
        (``MoERouting.verify``: a row only partly without a route, a wrong host token count,
        named by layer, expert and rank). Reads device flags back: call it where the host
        waits for the device anyway, before the optimizer step."""
        for per_chunk in self.routings:
            for routing in per_chunk:
                if isinstance(routing, MoERouting):
                    routing.verify()


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``labels`` under ``softmax(logits / temperature)``, in float32.

    Args:
        logits: Vocab-parallel logits ``[..., vocab / tp]`` of any dtype.
        labels: int64 ids, the leading shape of ``logits``.
        temperature: The sampling temperature the log-probs refer to.
    """
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float() / temperature, labels)


def run_pass(
    chunks: Sequence[torch.nn.Module],
    microbatches: PreparedMicrobatches,
    loss_fn: LossFn,
    *,
    replay: bool = True,
    record: bool = False,
    keep_live_routes: bool = False,
    forward_only: bool = True,
    graphs: Optional[ForwardGraphs] = None,
    forward_backward_func: Optional[Callable] = None,
    item_of: Optional[Callable[[Any], PassItem]] = None,
) -> PassResult:
    """Runs the schedule once over ``microbatches`` on this rank's model ``chunks``.

    Args:
        chunks: This rank's model chunks (possibly wrapped), in virtual-stage order.
        microbatches: The pass's prepared microbatches
            (:meth:`~megatron_r3.dataplane.device.microbatch_pipeline.MicrobatchPipeline.prepare`).
        loss_fn: Called on the last pipeline stage for each microbatch.
        replay: Replay the routes the microbatches carry; False routes live and keeps them
            only for the caller (e.g. to compare them with the routes taken).
        record: Record the routes every chunk takes (``recorded_expert_ids()``), also
            without routes to replay (the model config needs ``moe_enable_routing_replay``).
        keep_live_routes: With routes, also keep what the routers' own top-k chose
            (``live_expert_ids()``, for agreement metrics).
        forward_only: No backward pass (and no autograd graph).
        graphs: Run the microbatches that replay no routes through these CUDA graphs
            (:class:`~megatron_r3.rl.model.forward_graphs.ForwardGraphs`), where they apply.
        forward_backward_func: The schedule (default ``get_forward_backward_func()``), or a
            wrapper of it (Megatron's ``FullCudaGraphWrapper``,
            :mod:`megatron_r3.rl.trainer.update_graphs`).
        item_of: Turns what the data iterator yields into the microbatch's :class:`PassItem`
            (default: it yields them), for a schedule wrapper that hands the forward step its
            own copies of the inputs.
    """
    count = microbatches.num_microbatches
    if count == 0:
        raise ValueError("a pass needs at least one microbatch")
    chunk_of = {id(chunk): c for c, chunk in enumerate(chunks)}
    routings: list[list[Union[MoERouting, RecordedRoutes, None]]] = [[None] * len(chunks) for _ in range(count)]
    items: list[list[Optional[PassItem]]] = [[None] * len(chunks) for _ in range(count)]

    def forward_step(data_iterator, model):
        item: PassItem = next(data_iterator) if item_of is None else item_of(next(data_iterator))
        batch = item.batch
        if item.routes is not None and replay:
            routing = moe_routing_for_chunk(
                model, item.routes.wait(), item.routes.layer_numbers,
                every_token_routed=item.routes.every_token_routed,
                host_tokens_per_expert=item.host_tokens_per_expert,
                record=record, keep_live_routes=keep_live_routes,
            )
            logits = forward_model(model, batch, routing)
        elif graphs is not None:
            logits, routing = graphs(model, batch, record=record)
        else:
            routing = moe_routing_for_chunk(model, record=True) if record else None
            logits = forward_model(model, batch, routing)
        chunk = chunk_of[id(model)]
        routings[item.index][chunk] = routing
        items[item.index][chunk] = item
        return logits, partial(loss_fn, item.index, batch)

    config = get_model_config(chunks[0])
    with torch.no_grad() if forward_only else contextlib.nullcontext(), microbatches.installed(config):
        outputs = (forward_backward_func or get_forward_backward_func())(
            forward_step_func=forward_step,
            data_iterator=microbatches.data_iterator(),
            model=list(chunks),
            num_microbatches=count,
            seq_length=microbatches.seq_length,
            micro_batch_size=1,
            forward_only=forward_only,
        )
    host_split = 0
    if replay:
        host_split = sum(all(i is not None and i.host_tokens_per_expert is not None for i in per_chunk)
                         for per_chunk in items)
    return PassResult(list(outputs), routings, items, host_split)


def no_loss(values: dict, like: torch.Tensor) -> tuple:
    """A forward-only loss-function result carrying ``values``: zero loss, zero tokens."""
    return torch.zeros((), device=like.device), torch.zeros((), dtype=torch.int, device=like.device), values
