"""The trainer's update pass, every microbatch forward and backward, as one CUDA graph: Megatron's own.

Megatron-Core captures a whole training iteration (each microbatch's forward and backward
through its schedule, and ``finalize_model_grads``) with ``FullCudaGraphWrapper``
(``megatron/core/full_cuda_graph.py``: Megatron-LM's ``--cuda-graph-impl full_iteration``; the
same file in megatron-core 0.19.2 and in Megatron-LM main d98e8a64dd). The wrapper takes the
schedule's keyword arguments, reads every microbatch from the data iterator first and copies
its tensors (a dict per microbatch) into static buffers of its own; its first call runs the
schedule eagerly, its second captures it on Megatron's shared capture stream and replays it,
and later calls replay. :class:`UpdatePassGraphs` runs the trainer's update pass through it
where the layout allows (:func:`eager_reason`):

* one model chunk on a GPU and no pipeline, tensor or context parallelism; several expert ranks
  where every MoE layer keeps its counts on the device, which at more than one expert rank only the
  static-shape allgather dispatcher does (``--moe-allgather-static-shapes``: its all-gathers are
  then the forward's only collectives; the alltoall dispatcher needs its split sizes on the host,
  which a graph would keep from the captured batch); several data-parallel ranks, whose reduction
  ``finalize_model_grads`` makes at the end of the schedule, in the graph, as in Megatron-LM's
  full-iteration graphs (NCCL's collectives are captured as any kernel; the token count it divides
  by is a device tensor), but not with ``--overlap-grad-reduce``, whose bucket hooks start the
  reduction from inside the backward;
* MoE layers that keep their token counts on the device (the alltoall dispatcher at one expert
  rank, the static-shape allgather dispatcher, and grouped experts that read them there:
  ``GroupedGemmExperts``; ``TEGroupedMLP``, ``SequentialMLP`` and Megatron's allgather dispatcher
  read them on the host); host token counts are not used in a graph, as they would be constants of it;
* Megatron's RNG tracker is graph-safe (``use_cudagraphable_rng``): the wrapper registers its
  generators with the graph. The launcher makes it so where the trainer's graphs are on.

The forward step gets the wrapper's copies of its microbatch (tokens, masks, log-probs,
advantages, ``cu_seqlens``, the routes to replay, R2's old log-probs); RoPE's table length is
one more than the row (:func:`~megatron_r3.rl.model.forward_graphs.rope_table_length`), the
same for every batch. The weights and DDP's gradient buffers keep their storage (the optimizer
steps in place, the trainer zeroes the buffers in place before each pass), and the pass runs on
the stream DDP was built on, which is Megatron's capture stream
(:func:`~megatron_r3.rl.trainer.training_stack.on_training_stream`).

A graph that captured NCCL's collectives keeps their communicator from being destroyed (NCCL counts
the graphs that hold it): :meth:`UpdatePassGraphs.reset` drops the graph, which the run does before
it destroys the process group.

The wrapper's state belongs to its class: one update graph per process. A pass of another
shape (number of microbatches, row length, routes or none, a microbatch with tokens routed
live, R2's old log-probs or none) resets it; the next pass then runs eagerly and the one after
captures again. Where the graph holds other ranks' collectives (several data-parallel or expert
ranks) every rank must capture in the same pass (the capture's barriers, the collectives in the
graph), so the key holds nothing a rank's own data decides: whether every token of a microbatch
has a route is left to the device there (:func:`routes_left_to_the_device`).

TransformerEngine's graphed callables (``--cuda-graph-impl transformer_engine``, Megatron's
``TECudaGraphHelper``) are not used: they capture one layer at a time with its hidden states
as the only input, so a layer's attention would keep the captured batch's ``cu_seqlens`` while
packed rows change them every batch, and dropless MoE layers (token counts set by the data)
capture only their router and preprocessing upstream.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_r3.dataplane.device.microbatch_pipeline import PassItem
from megatron_r3.dataplane.device.prefetch import PreparedMicrobatches
from megatron_r3.dataplane.device.transport import PackedRoutes
from megatron_r3.rl.model.forward_graphs import only_expert_parallelism, rope_table_length, token_counts_stay_on_device
from megatron_r3.rl.model.passes import LossFn, PassResult, run_pass
from megatron_r3.rl.trainer.training_stack import on_training_stream

# The microbatch's device tensors a pass reads (RolloutMicrobatch fields).
_BATCH_TENSORS = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages", "dead_mask", "position_ids")
_STAGE = "training"  # the wrapper's name for a pass with a backward


def eager_reason(chunks: Sequence[torch.nn.Module]) -> Optional[str]:
    """Why the update pass of ``chunks`` cannot be one graph here, or None where it can."""
    if next(chunks[0].parameters()).device.type != "cuda":
        return "a CPU"
    return layout_reason(chunks)


def layout_reason(chunks: Sequence[torch.nn.Module]) -> Optional[str]:
    """Why the update pass of ``chunks`` cannot be one graph in this layout, model and RNG tracker, on a GPU."""
    if not only_expert_parallelism():
        return "pipeline, tensor or context parallelism: the pass talks to other ranks"
    if len(chunks) != 1:
        return "virtual pipeline stages"
    if not token_counts_stay_on_device(chunks[0]):
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            return ("several expert ranks: the dispatcher reads its token counts on the host "
                    "(--moe-token-dispatcher-type allgather --moe-allgather-static-shapes keeps them on the device)")
        return ("experts or a dispatcher that read their token counts on the host (TEGroupedMLP, SequentialMLP, "
                "the allgather dispatcher)")
    if (parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1
            and any(isinstance(chunk, DistributedDataParallel) and chunk.ddp_config.overlap_grad_reduce
                    for chunk in chunks)):
        return "--overlap-grad-reduce over several data-parallel ranks: DDP's bucket hooks are not captured"
    if not tensor_parallel.get_cuda_rng_tracker().use_cudagraphable_rng:
        return "Megatron's RNG tracker is not graph-safe (use_cudagraphable_rng)"
    return None


class UpdatePassGraphs:
    """Runs the trainer's update passes through Megatron's ``FullCudaGraphWrapper`` where it applies.

    One per process (the wrapper's state is its class's).

    Args:
        chunks: The policy's model chunks (in DDP).
        loss_fn: The pass's loss function (it reads R2's old log-probs from the microbatch).
        cuda_graphs: False runs every pass eagerly.

    Attributes:
        why_eager: Why every pass runs eagerly, or None where passes are graphed.
        captures: Graphs captured so far.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], loss_fn: LossFn, cuda_graphs: bool = True):
        self.chunks = list(chunks)
        self.loss_fn = loss_fn
        self.why_eager = eager_reason(self.chunks) if cuda_graphs else "--no-trainer-cuda-graphs"
        self.captures = 0
        self._device = next(self.chunks[0].parameters()).device
        self._wrapper = None  # made by the first pass (it makes a CUDA stream)
        self._key: Optional[tuple] = None
        self._routings: Optional[list] = None  # the captured pass's MoERoutings, which its replays write
        self._across_ranks = (parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1
                              or parallel_state.get_expert_model_parallel_world_size() > 1)

    @property
    def enabled(self) -> bool:
        return self.why_eager is None

    def summary(self) -> str:
        """One start-up line: how the update pass runs, and why where it runs eagerly."""
        if self.enabled:
            return (" update pass: one CUDA graph of all its microbatches, forward and backward (Megatron's "
                    "FullCudaGraphWrapper), captured on the second pass")
        return f" update pass: eager ({self.why_eager})"

    def run(self, microbatches: PreparedMicrobatches) -> PassResult:
        """The update pass (forward and backward) over ``microbatches``, DDP's buffers zeroed by the caller."""
        with on_training_stream(self._device):
            if not self.enabled:
                return run_pass(self.chunks, microbatches, self.loss_fn, forward_only=False)
            items = microbatches.all_items()
            if self._across_ranks:
                items = [[routes_left_to_the_device(item) for item in per_chunk] for per_chunk in items]
            key = graph_key(items)
            if key is None:
                return run_pass(self.chunks, PreparedMicrobatches.of(items, microbatches.seq_length), self.loss_fn,
                                forward_only=False)
            if self._wrapper is None:
                self._wrapper = FullCudaGraphWrapper(get_forward_backward_func(), cuda_graph_warmup_steps=1)
            if key != self._key:
                self.reset()
                self._key = key
            step = self._wrapper.curr_iter(_STAGE)  # 0: eager, 1: capture and replay, later: replay
            result = run_through(self._wrapper, self.chunks, items, self.loss_fn, microbatches.seq_length)
            if step == 0:
                return result
            if step == 1:
                self._routings = result.routings
                self.captures += 1
            # A replay makes no device sync, so it counts as the sync-free path.
            return PassResult(result.outputs, self._routings, items, host_split_microbatches=len(items))

    def reset(self) -> None:
        """Drop the graph: the next pass runs eagerly, the one after captures again."""
        if self._wrapper is not None:
            self._wrapper.reset_cuda_graph(_STAGE)
            StaticBufferLoader.static_buffers[_STAGE].clear()  # buffers of the old shapes
        self._key = None
        self._routings = None


def graph_key(items: Sequence[Sequence[PassItem]]) -> Optional[tuple]:
    """What a captured pass is specific to, or None for a pass that is not captured (a row that is not
    THD with one ``cu_seqlens`` tensor for every field, several chunks)."""
    key = []
    for per_chunk in items:
        if len(per_chunk) != 1:
            return None
        (item,) = per_chunk
        batch, routes = item.batch, item.routes
        params = batch.packed_seq_params
        if params is None or params.qkv_format != "thd" or batch.dead_mask is None:
            return None
        if not (params.cu_seqlens_q is params.cu_seqlens_kv is params.cu_seqlens_q_padded
                is params.cu_seqlens_kv_padded):
            return None
        key.append((tuple(batch.tokens.shape), tuple(params.cu_seqlens_q.shape),
                    None if routes is None else (tuple(routes.expert_ids.shape), tuple(routes.layer_numbers),
                                                 routes.every_token_routed),
                    batch.old_logprobs is not None))
    return tuple(key)


def routes_left_to_the_device(item: PassItem) -> PassItem:
    """``item`` with its routes not marked as covering every token: the routers then take a live top-k for any
    token without a route, on the device, whatever this rank's data (a graph shared by several ranks cannot
    depend on one rank's data)."""
    if item.routes is None or not item.routes.every_token_routed:
        return item
    return dataclasses.replace(item, routes=dataclasses.replace(item.routes, every_token_routed=False))


def graph_inputs(item: PassItem) -> dict:
    """A microbatch as the wrapper copies it: its device tensors (routes waited for) and its index."""
    batch = item.batch
    inputs = {name: getattr(batch, name) for name in _BATCH_TENSORS}
    inputs["cu_seqlens"] = batch.packed_seq_params.cu_seqlens_q
    inputs["index"] = item.index
    if item.routes is not None:
        inputs["expert_ids"] = item.routes.wait()
    if batch.old_logprobs is not None:
        inputs["old_logprobs"] = batch.old_logprobs
    return inputs


def with_graph_inputs(item: PassItem, inputs: dict) -> PassItem:
    """``item`` reading the wrapper's copies (:func:`graph_inputs`); no host token counts (a graph's constants)."""
    cu_seqlens = inputs["cu_seqlens"]
    table_length = rope_table_length(inputs["tokens"].shape[-1])
    batch = dataclasses.replace(
        item.batch, **{name: inputs[name] for name in _BATCH_TENSORS}, old_logprobs=inputs.get("old_logprobs"),
        packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                          cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                                          max_seqlen_q=table_length, max_seqlen_kv=table_length))
    routes = item.routes
    if routes is not None:
        routes = PackedRoutes(inputs["expert_ids"], routes.layer_numbers, routes.every_token_routed)
    return PassItem(item.index, batch, routes, None, item.filler_rows)


def run_through(wrapper: Callable, chunks: Sequence[torch.nn.Module], items: Sequence[Sequence[PassItem]],
                loss_fn: LossFn, seq_length: int) -> PassResult:
    """The update pass over ``items`` (one chunk) through a schedule wrapper that copies each microbatch's
    inputs (Megatron's ``FullCudaGraphWrapper``)."""
    inputs = [[graph_inputs(item) for item in per_chunk] for per_chunk in items]
    return run_pass(chunks, PreparedMicrobatches.of(inputs, seq_length), loss_fn, forward_only=False,
                    forward_backward_func=wrapper,
                    item_of=lambda copied: with_graph_inputs(items[copied["index"]][0], copied))
