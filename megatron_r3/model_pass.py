"""One pass of Megatron's pipeline schedule over packed rollout microbatches.

The rollout engine and the trainer run their model chunks the same way: a list
of :class:`~megatron_r3.rollout_batch.RolloutMicrobatch` (one ``seq_length``
THD row each), optionally each chunk's routes to replay, through
``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved 1F1B),
forward only or forward and backward. Every forward step gives its chunk a
fresh ``MoERouting`` when it replays or records, and the pass hands those back
per microbatch and chunk, so a caller can read the routes taken
(``recorded_expert_ids()``) and, when it asked for them, what the live router
preferred (``live_expert_ids()``).

The model returns vocab-parallel logits ``[1, s_local, vocab / tp]``; the loss
function of the caller turns them into what it needs on the last pipeline
stage (:func:`token_logprobs` for the log-probs of the labels).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_r3.rollout_batch import RolloutMicrobatch
from megatron_r3.routing_replay import MoERouting, moe_routing_for_chunk
from megatron_r3.transport import PackedRoutes

LossFn = Callable[[int, RolloutMicrobatch, torch.Tensor], tuple]
"""``loss_fn(microbatch_index, batch, logits) -> (loss, num_tokens, dict)``, Megatron's loss-function contract."""


@dataclass
class _Item:
    """What a chunk's data iterator yields: one microbatch and, to replay, that chunk's routes."""

    index: int
    chunk: int
    batch: RolloutMicrobatch
    routes: Optional[PackedRoutes]


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
    microbatches: Sequence[RolloutMicrobatch],
    loss_fn: LossFn,
    *,
    routes: Optional[Sequence[Sequence[PackedRoutes]]] = None,
    record: bool = False,
    keep_live_routes: bool = False,
    forward_only: bool = True,
) -> tuple[list[dict], list[list[Optional[MoERouting]]]]:
    """Runs the schedule once over ``microbatches`` on this rank's model ``chunks``.

    Args:
        chunks: This rank's model chunks, in virtual-stage order.
        microbatches: Packed rows of the same ``seq_length``.
        loss_fn: Called on the last pipeline stage for each microbatch.
        routes: Per microbatch, one :class:`PackedRoutes` per chunk to replay; None routes live.
        record: Record the routes every chunk takes (``recorded_expert_ids()``), also
            without routes to replay (the model config needs ``moe_enable_routing_replay``).
        keep_live_routes: With ``routes``, also keep what the routers' own top-k chose
            (``live_expert_ids()``, for agreement metrics).
        forward_only: No backward pass (and no autograd graph).

    Returns:
        The dicts ``loss_fn`` returned, in microbatch order (last pipeline stage only;
        empty elsewhere), and per microbatch and chunk the ``MoERouting`` the forward
        used (None where it routed live without recording).
    """
    if not microbatches:
        raise ValueError("a pass needs at least one microbatch")
    if routes is not None and len(routes) != len(microbatches):
        raise ValueError(f"routes for {len(routes)} microbatches, the pass has {len(microbatches)}")
    routings: list[list[Optional[MoERouting]]] = [[None] * len(chunks) for _ in microbatches]

    def forward_step(data_iterator, model):
        item: _Item = next(data_iterator)
        routing = None
        if item.routes is not None:
            routing = moe_routing_for_chunk(model, item.routes.wait(), item.routes.layer_numbers,
                                            every_token_routed=item.routes.every_token_routed,
                                            record=record, keep_live_routes=keep_live_routes)
        elif record:
            routing = moe_routing_for_chunk(model, record=True)
        routings[item.index][item.chunk] = routing
        batch = item.batch
        logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params,
                       extra_block_kwargs={"moe_routing": routing})
        return logits, partial(loss_fn, item.index, batch)

    per_chunk = [
        [_Item(i, c, batch, None if routes is None else routes[i][c]) for i, batch in enumerate(microbatches)]
        for c in range(len(chunks))
    ]
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(items) for items in per_chunk] if len(chunks) > 1 else iter(per_chunk[0]),
            model=list(chunks),
            num_microbatches=len(microbatches),
            seq_length=microbatches[0].seq_length,
            micro_batch_size=1,
            forward_only=forward_only,
        )
    return list(outputs), routings


def no_loss(values: dict, like: torch.Tensor) -> tuple:
    """A forward-only loss-function result carrying ``values``: zero loss, zero tokens."""
    return torch.zeros((), device=like.device), torch.zeros((), dtype=torch.int, device=like.device), values
