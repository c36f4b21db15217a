"""The trainer's update pass, forward and backward through Megatron's schedule, as a CUDA graph replay.

On a small model the update pass costs the host's time to issue its kernels, forward and
backward (docs/benchmarks.md). Where :func:`~megatron_r3.rl.model.forward_graphs.graphs_apply`
(one chunk on a GPU, one rank per model replica, experts that take their token counts on
the device), a pass of one microbatch is captured once per shape: the whole of
:func:`~megatron_r3.rl.model.passes.run_pass` (Megatron's schedule, the forward with its
routes, the loss, the backward into DDP's gradient buffers and ``finalize_model_grads``).
A later pass copies its microbatch (tokens, masks, log-probs, advantages, routes, R2's old
log-probs) into the captured inputs and replays.

A capture holds while:

* the weights and DDP's gradient buffers keep their storage: the optimizer steps in place,
  and the trainer zeroes the buffers in place before each pass;
* nothing is read back to the host: the routes replay on the device and the dispatcher keeps
  its token counts there (host split sizes would be constants of the graph, so the capture
  does not take them), and the loss's outputs stay on the device until the replay is done;
* collectives are within one rank: NCCL communicators of one rank that exist before the
  capture (it runs the pass once eagerly first, as torch asks);
* the backward accumulates each gradient on the stream DDP was built on (where its
  ``AccumulateGrad`` node was made), so every update pass, eager or captured, runs on that
  stream (:func:`~megatron_r3.rl.trainer.training_stack.on_training_stream`).

Several microbatches or chunks, several data-parallel ranks, or a row that is not THD run
eagerly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_r3.dataplane.device.microbatch_pipeline import PassItem
from megatron_r3.dataplane.device.prefetch import PreparedMicrobatches
from megatron_r3.dataplane.device.transport import PackedRoutes
from megatron_r3.rl.model.forward_graphs import graphs_apply, rope_table_length, static_padded
from megatron_r3.rl.model.passes import LossFn, PassResult, run_pass
from megatron_r3.rl.trainer.training_stack import on_training_stream

# The microbatch's device tensors a pass reads (RolloutMicrobatch fields).
_BATCH_TENSORS = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages", "dead_mask", "position_ids")


class UpdatePassGraphs:
    """Runs the trainer's update passes, as CUDA graph replays where they can be.

    Args:
        chunks: The policy's model chunks (in DDP).
        make_loss: The pass's loss function for R2's old log-probs (one tensor per
            microbatch) or None (the rollout's).
        zero_grad: Zeroes DDP's gradient buffers in place (the capture's eager first pass
            fills them).
        cuda_graphs: False runs every pass eagerly.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module],
                 make_loss: Callable[[Optional[Sequence[torch.Tensor]]], LossFn], zero_grad: Callable[[], None],
                 cuda_graphs: bool = True):
        self.chunks = list(chunks)
        self.enabled = (cuda_graphs and graphs_apply(self.chunks)
                        and parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1)
        self._device = next(self.chunks[0].parameters()).device
        self._make_loss = make_loss
        self._zero_grad = zero_grad
        self._graphs: dict[tuple, _CapturedUpdate] = {}

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def run(self, microbatches: PreparedMicrobatches,
            old_logprobs: Optional[Sequence[torch.Tensor]] = None) -> PassResult:
        """The update pass (forward and backward) over ``microbatches``, with DDP's buffers zeroed before."""
        with on_training_stream(self._device):
            return self._run(microbatches, old_logprobs)

    def _run(self, microbatches: PreparedMicrobatches, old_logprobs: Optional[Sequence[torch.Tensor]]) -> PassResult:
        if not self.enabled or microbatches.num_microbatches != 1 or microbatches.num_chunks != 1:
            return run_pass(self.chunks, microbatches, self._make_loss(old_logprobs), forward_only=False)
        item: PassItem = next(microbatches.data_iterator())
        old = None if old_logprobs is None else old_logprobs[0]
        key = _key(item, old)
        if key is None:
            return run_pass(self.chunks, _one_microbatch(item, microbatches.seq_length), self._make_loss(old_logprobs),
                            forward_only=False)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _CapturedUpdate(self.chunks, item, old, microbatches.seq_length,
                                                        self._make_loss, self._zero_grad)
        return graph.replay(item, old)


def _one_microbatch(item: PassItem, seq_length: int) -> PreparedMicrobatches:
    return PreparedMicrobatches(1, lambda index: [item], 1, seq_length)


def _key(item: PassItem, old: Optional[torch.Tensor]) -> Optional[tuple]:
    batch = item.batch
    params = batch.packed_seq_params
    if params is None or params.qkv_format != "thd" or batch.dead_mask is None:
        return None
    if params.cu_seqlens_kv is not params.cu_seqlens_q or params.cu_seqlens_kv_padded is not params.cu_seqlens_q_padded:
        return None
    padded = params.cu_seqlens_q_padded
    routes = item.routes
    return (tuple(batch.tokens.shape), tuple(params.cu_seqlens_q.shape), None if padded is None else tuple(padded.shape),
            None if routes is None else (tuple(routes.expert_ids.shape), tuple(routes.layer_numbers),
                                         routes.every_token_routed),
            old is None)


class _CapturedUpdate:
    """One captured update pass: its input tensors, its graph and its result."""

    def __init__(self, chunks, item: PassItem, old: Optional[torch.Tensor], seq_length: int,
                 make_loss: Callable, zero_grad: Callable[[], None]):
        batch = item.batch
        params = batch.packed_seq_params
        table_length = rope_table_length(batch.tokens.shape[-1])  # see forward_graphs
        self.cu_seqlens = params.cu_seqlens_q.clone()
        self.cu_seqlens_padded = static_padded(params, self.cu_seqlens)
        static = {name: getattr(batch, name).clone() for name in _BATCH_TENSORS}
        self.batch = dataclasses.replace(batch, **static, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=table_length, max_seqlen_kv=table_length,
        ))
        routes = item.routes
        self.routes = None if routes is None else PackedRoutes(routes.wait().clone(), routes.layer_numbers,
                                                               routes.every_token_routed)
        self.old = None if old is None else old.clone()
        # No host token counts: the dispatcher keeps the counts on the device, as a graph needs.
        static_item = PassItem(0, self.batch, self.routes, None, item.filler_rows)
        loss = make_loss(None if self.old is None else [self.old])

        def one_pass() -> PassResult:
            return run_pass(chunks, _one_microbatch(static_item, seq_length), loss, forward_only=False)

        # On the training stream (the caller's): DDP's gradient accumulation runs there too.
        stream = torch.cuda.current_stream()
        one_pass()
        zero_grad()  # the eager pass's gradients
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self.result = one_pass()

    def replay(self, item: PassItem, old: Optional[torch.Tensor]) -> PassResult:
        batch = item.batch
        for name in _BATCH_TENSORS:
            getattr(self.batch, name).copy_(getattr(batch, name))
        params = batch.packed_seq_params
        self.cu_seqlens.copy_(params.cu_seqlens_q)
        if self.cu_seqlens_padded is not None:
            self.cu_seqlens_padded.copy_(params.cu_seqlens_q_padded)
        if self.routes is not None:
            self.routes.expert_ids.copy_(item.routes.wait())
        if self.old is not None:
            self.old.copy_(old)
        self.graph.replay()
        # A replay makes no device sync, so it counts as the sync-free path.
        return PassResult(self.result.outputs, self.result.routings, [[item]], host_split_microbatches=1)
