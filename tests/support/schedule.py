"""Forward and backward through Megatron's real pipeline schedules."""

import contextlib
from functools import partial
from typing import Optional

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from tests.support.batches import Microbatch
from tests.support.routes import RouterRecorder


def forward_step(data_iterator, model, recorder: Optional[RouterRecorder] = None):
    """Megatron ``forward_step_func``: the GPT returns per-token losses.

    Args:
        data_iterator: Iterator over this model chunk's :class:`Microbatch` es.
        model: The model chunk.
        recorder: If given, records the routing of this forward pass.
    """
    mb: Microbatch = next(data_iterator)
    with recorder.microbatch(mb) if recorder else contextlib.nullcontext():
        per_token_loss = model(
            input_ids=mb.tokens,
            position_ids=mb.position_ids,
            attention_mask=None,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params,
        )
    return per_token_loss, partial(loss_func, mb)


def loss_func(mb: Microbatch, per_token_loss: torch.Tensor):
    """Sum of the unmasked per-token losses, their count, and the losses themselves.

    With ``config.calculate_per_token_loss`` the schedule does not rescale the sum,
    so gradients are those of the plain sum over tokens.
    """
    masked = per_token_loss.float() * mb.loss_mask
    num_tokens = mb.loss_mask.sum().to(torch.int)
    return (
        masked.sum(),
        num_tokens,
        {"per_token_loss": per_token_loss.detach(), "token_index": mb.token_index},
    )


def forward_backward(
    chunks: list[torch.nn.Module],
    microbatches: list[Microbatch],
    forward_only: bool = False,
    recorder: Optional[RouterRecorder] = None,
    forward_step_func=forward_step,
) -> list[dict]:
    """Run all microbatches through ``get_forward_backward_func()``.

    The schedule is the one Megatron picks from the parallel state: no pipelining,
    1F1B, or interleaved 1F1B with one data iterator per model chunk.

    Args:
        chunks: This rank's model chunks.
        microbatches: This rank's microbatches, in order.
        forward_only: Skip the backward passes.
        recorder: Passed to ``forward_step_func`` to record routing.
        forward_step_func: ``f(data_iterator, model, recorder)`` returning
            ``(per_token_loss, loss_func)``; defaults to :func:`forward_step`.

    Returns:
        On the last pipeline stage, one ``{"per_token_loss", "token_index"}`` dict
        per microbatch, in order; an empty list on other stages.
    """
    first = microbatches[0]
    data_iterator = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    return get_forward_backward_func()(
        forward_step_func=partial(forward_step_func, recorder=recorder),
        data_iterator=data_iterator,
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=first.seq_length,
        micro_batch_size=first.tokens.size(0),
        forward_only=forward_only,
    )
