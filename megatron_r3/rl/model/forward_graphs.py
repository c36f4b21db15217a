"""Forward-only passes of a model chunk replayed as CUDA graphs, one graph per batch shape.

The rollout engine runs a forward-only pass per sampled token over packed rows of one
shape, then one that records the routes taken; the trainer runs forward-only passes that
route live and record (the comparison pass, R2's old-log-prob pass). On a small model such
a pass costs the host's time to issue its kernels, not the GPU's to run them
(docs/benchmarks.md): captured once per shape, a pass becomes copies of the new inputs into
the captured ones and one replay. A recording pass's graph records into the ``MoERouting``
it was captured with; each replay hands back a copy of what it recorded
(:class:`RecordedRoutes`), so the next replay cannot overwrite routes a caller still reads.

A capture holds only while the forward reads nothing back to the host and takes no host
value from its inputs. On one GPU per model replica it does:

* the MoE dispatcher leaves the token counts on the device when one rank holds every
  expert and the experts are grouped GEMMs that read them there (the series' patches "moe: the
  alltoall dispatcher leaves token counts on the device" and, with TE's fused permutation, "moe:
  the fused permutation takes host token counts and keeps device counts"; ``GroupedGemmExperts``
  in bf16); the allgather dispatcher reads them back, so its passes run eagerly;
* core attention builds its mask on the device from ``cu_seqlens``
  (:class:`~megatron_r3.layers.core_attention.ContextParallelDotProductAttention`), and so
  does RoPE's token gather (the series' rope patches);
* RoPE's table length is ``max_seqlen``, a host int: the graph is captured with one more
  than the row length, a bound of every sample's length that gives every position the
  same angles. (Not the row length itself: a table exactly as long as the packed row is
  read as positions in the row, not in each sequence, by Megatron's THD RoPE.)

Pipeline, tensor, context or expert parallelism, a CPU, a pass that replays routes or
builds an autograd graph, experts that need host token counts (``SequentialMLP``,
TransformerEngine's ``TEGroupedMLP``, whose GEMMs take host split sizes; grouped experts in
fp32, which run ``SequentialMLP``'s forward on CUDA): those run the chunk eagerly.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_r3.dataplane.device.microbatches import RolloutMicrobatch
from megatron_r3.routing_replay import MoERouting, moe_routing_for_chunk


def forward_model(model: torch.nn.Module, batch: RolloutMicrobatch, routing: Optional[MoERouting]) -> torch.Tensor:
    """The model chunk's forward on one microbatch: vocab-parallel logits ``[1, s_local, vocab / tp]``."""
    return model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params,
                 padding_mask=batch.dead_mask, extra_block_kwargs={"moe_routing": routing})


def graphs_apply(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether forward-only passes of ``chunks`` can be CUDA graphs: one chunk on a GPU, one rank per
    replica, and MoE layers that keep their token counts on the device."""
    return (len(chunks) == 1 and next(chunks[0].parameters()).device.type == "cuda" and one_rank_per_replica()
            and token_counts_stay_on_device(chunks[0]))


def token_counts_stay_on_device(chunk: torch.nn.Module) -> bool:
    """Whether every MoE layer of ``chunk`` keeps its token counts on the device: its dispatcher
    leaves them there (``counts_stay_on_device``: the alltoall one, dropless, at one expert rank, and
    the static-shape allgather one at any; Megatron's allgather one reads them back) and its experts
    take them there."""
    return all(getattr(layer.experts, "takes_device_tokens_per_expert", False)
               and getattr(layer.token_dispatcher, "counts_stay_on_device", False)
               for layer in chunk.modules() if isinstance(layer, MoELayer))


def only_expert_parallelism() -> bool:
    """No pipeline, tensor, context or expert-tensor parallelism: a forward talks to other ranks only in its
    MoE layers' token dispatch, if at all."""
    return all(size == 1 for size in (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    ))


def one_rank_per_replica() -> bool:
    """No pipeline, tensor, context or expert parallelism: a forward talks to no other rank."""
    return only_expert_parallelism() and parallel_state.get_expert_model_parallel_world_size() == 1


def static_padded(params: PackedSeqParams, cu_seqlens: torch.Tensor) -> Optional[torch.Tensor]:
    """A captured pass's ``cu_seqlens_*_padded``: the same tensor as its ``cu_seqlens`` where the batch's are
    one tensor (TransformerEngine reads that identity as "no padding between sequences"), else a copy."""
    padded = params.cu_seqlens_q_padded
    if padded is None or padded is params.cu_seqlens_q:
        return None if padded is None else cu_seqlens
    return padded.clone()


def rope_table_length(row_length: int) -> int:
    """The ``max_seqlen`` a graph of packed rows of ``row_length`` tokens is captured with (module docstring)."""
    return row_length + 1


class RecordedRoutes:
    """What a replayed recording pass recorded, as the caller reads a recording ``MoERouting``.

    Attributes:
        layer_numbers: The MoE layers the routes cover.
        keep_live_routes: False: a graph never replays routes, so there is no live top-k to keep.
    """

    keep_live_routes = False

    def __init__(self, routing: MoERouting):
        self.layer_numbers = list(routing.layer_numbers)
        self._expert_ids = routing.recorded_expert_ids()  # stacked: a tensor of its own, not the graph's

    def recorded_expert_ids(self) -> torch.Tensor:
        """int64 ``[len(layer_numbers), num_local_tokens, topk]``, as ``MoERouting.recorded_expert_ids``."""
        return self._expert_ids


class ForwardGraphs:
    """Runs a model chunk's forward-only passes as CUDA graphs, captured on first sight of each shape.

    Args:
        chunks: The model chunks the passes run on; unless :func:`graphs_apply`, every
            call runs the chunk eagerly.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module]):
        self.enabled = graphs_apply(chunks)
        self._graphs: dict[tuple, _CapturedForward] = {}

    def __call__(self, model: torch.nn.Module, batch: RolloutMicrobatch,
                 record: bool = False) -> tuple[torch.Tensor, Union[MoERouting, RecordedRoutes, None]]:
        """The logits of ``model``'s forward on ``batch``, routing live, from a replay where possible.

        With ``record``, also the routes every MoE layer took (a recording ``MoERouting``, or
        :class:`RecordedRoutes` from a replay); without, None. The returned logits belong to the
        graph: the next replay of the same shape overwrites them, so read what is needed from them
        first (a loss function does).
        """
        key = self._key(model, batch)
        if key is None or torch.is_grad_enabled():
            routing = moe_routing_for_chunk(model, record=True) if record else None
            return forward_model(model, batch, routing), routing
        key = (*key, record)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _CapturedForward(model, batch, record)
        logits = graph.replay(batch)
        return logits, RecordedRoutes(graph.routing) if record else None

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def _key(self, model: torch.nn.Module, batch: RolloutMicrobatch) -> Optional[tuple]:
        params = batch.packed_seq_params
        if not self.enabled or params is None or params.qkv_format != "thd" or batch.dead_mask is None:
            return None
        padded = params.cu_seqlens_q_padded
        if params.cu_seqlens_kv is not params.cu_seqlens_q or params.cu_seqlens_kv_padded is not padded:
            return None  # self-attention rows share one cu_seqlens; anything else runs eagerly
        padded_shape = None if padded is None else tuple(padded.shape)
        return id(model), tuple(batch.tokens.shape), tuple(params.cu_seqlens_q.shape), padded_shape


class _CapturedForward:
    """One captured forward: its input tensors, its graph and its output."""

    def __init__(self, model: torch.nn.Module, batch: RolloutMicrobatch, record: bool):
        params = batch.packed_seq_params
        table_length = rope_table_length(batch.tokens.shape[-1])
        self.tokens = batch.tokens.clone()
        self.position_ids = batch.position_ids.clone()
        self.dead_mask = batch.dead_mask.clone()
        self.cu_seqlens = params.cu_seqlens_q.clone()
        self.cu_seqlens_padded = static_padded(params, self.cu_seqlens)
        self.batch = _Inputs(self.tokens, self.position_ids, self.dead_mask, PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=table_length, max_seqlen_kv=table_length,
        ))
        # One eager pass on a side stream first, as torch asks: lazy state (caches, cuBLAS
        # workspaces, the grouped-GEMM probe) is made outside the capture.
        # A recording MoERouting replays what it recorded in a second forward: one each.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward_model(model, self.batch, moe_routing_for_chunk(model, record=True) if record else None)
        torch.cuda.current_stream().wait_stream(side)
        self.routing = moe_routing_for_chunk(model, record=True) if record else None
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = forward_model(model, self.batch, self.routing)

    def replay(self, batch: RolloutMicrobatch) -> torch.Tensor:
        params = batch.packed_seq_params
        self.tokens.copy_(batch.tokens)
        self.position_ids.copy_(batch.position_ids)
        self.dead_mask.copy_(batch.dead_mask)
        self.cu_seqlens.copy_(params.cu_seqlens_q)
        if self.cu_seqlens_padded is not None:
            self.cu_seqlens_padded.copy_(params.cu_seqlens_q_padded)
        self.graph.replay()
        return self.output


class _Inputs(NamedTuple):
    """What :func:`forward_model` reads of a microbatch."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    dead_mask: torch.Tensor
    packed_seq_params: PackedSeqParams
