"""The built-in rollout engine: a bf16 copy of the policy that samples completions and records routes.

The engine is a second set of model chunks in the trainer's parallel layout,
built with a bf16 config, grouped-GEMM experts and ``moe_enable_routing_replay``
(so its routers can record), whose weights trail the policy's by ``staleness``
optimizer steps (:class:`~megatron_r3.rl.rollout.weight_lag.LaggedWeights`). It stands in for vLLM or
SGLang: inference precision, possibly stale weights, and the routes it took.

Generation is a loop of forward-only passes through Megatron's schedule over THD
rows of the fixed ``seq_length`` (no KV cache: pipeline stages exchange activations of
one shape), packed once per rollout with a slot of fixed length per sample
(:class:`~megatron_r3.rl.rollout.generation_rows.GenerationRows`): each pass writes the tokens
drawn by the one before into the rows on the device. After each pass the last pipeline
stage takes every sample's logits at its last position (gathered over the
tensor-parallel vocabulary shards; under context parallelism the rank that holds the
position contributes it) and draws the next token from ``softmax(logits / temperature)``
on the device, by inverse CDF from a uniform drawn once per rollout from ``(seed,
iteration, data-parallel rank)`` (:mod:`megatron_r3.rl.rollout.token_sampling`), so every rank of a
replica and every layout draw the same tokens; the other stages get them by broadcast. A
sample stops at the stop token or after ``max_new_tokens``; all data-parallel replicas run
the same number of passes (expert parallelism spans them), and asking whether any sample
is still active is a step's one wait for the device. Where a replica is one GPU, the
generation passes replay a CUDA graph captured on the first one
(:class:`~megatron_r3.rl.model.forward_graphs.ForwardGraphs`; ``--no-rollout-cuda-graphs``
runs them eagerly).

One last forward-only pass over the finished samples records, per token, the
routes every MoE layer took and the log-prob of each sampled token (a graph replay
too, where the generation passes are). The routes
come back through the data plane (``adapters.from_megatron_recorded`` with the
``RoutingPlan`` each part was recorded under, the parts of the replica's TP, CP
and PP ranks gathered on every rank). Like vLLM and SGLang, the engine reports
no route for the final sampled token (it never ran through the model); no loss
sees that position, so the trainer gives it a filler route.

Non-finite numbers stop the engine where they appear, on every rank of the
replica: logits that are not finite when a token is sampled end the generation
(:class:`RolloutEngineError`, naming the iteration, the step and the sample),
and log-probs that are not finite or above 0 in the recorded samples
(:func:`megatron_r3.dataplane.sample_checks.check_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_r3.dataplane.device.microbatch_pipeline import MicrobatchPipeline
from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.engines.adapters import from_megatron_recorded
from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.dataplane.sample_checks import check_logprobs
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl.model.forward_graphs import ForwardGraphs
from megatron_r3.rl.model.passes import no_loss, run_pass, token_logprobs
from megatron_r3.rl.model.replica_comm import (
    broadcast_from_last_stage,
    gather_objects_in_replica,
    gather_vocab_parallel,
    sum_over_context_parallel,
)
from megatron_r3.rl.rollout.generation_rows import GenerationRows
from megatron_r3.rl.rollout.token_sampling import sample_tokens, sampling_uniforms
from megatron_r3.rl.rollout.weight_lag import LaggedWeights


class RolloutEngineError(RuntimeError):
    """The engine's model produced numbers it cannot sample from."""


@dataclass(frozen=True)
class SamplingParams:
    """How the engine samples.

    Attributes:
        temperature: Softmax temperature (> 0) of the sampling distribution; the
            reported log-probs are of that distribution.
        max_new_tokens: Most tokens a completion gets.
        stop_token: A sample ends once it draws this token (it is kept).
        seed: Base seed of the sampling generators.
    """

    temperature: float
    max_new_tokens: int
    stop_token: int
    seed: int

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"--rollout-temperature must be > 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


class RolloutEngine:
    """Samples completions with lagging bf16 weights and records their routes and log-probs.

    Args:
        make_chunks: Builds model chunks of the engine's kind (bf16 config with
            ``moe_enable_routing_replay``): the engine's own, and one set per weight
            snapshot of the lag.
        policy: The trainer's model chunks, same layout; the engine trails their weights.
        spec: The model's MoE layers, experts and top-k.
        rows: How this rank packs rows.
        sampling: Temperature, length limit, stop token, seed.
        staleness: Optimizer steps the engine's weights trail the policy's by.
        cuda_graphs: Replay the generation passes as CUDA graphs where they apply.
    """

    def __init__(
        self,
        make_chunks: Callable[[], Sequence[torch.nn.Module]],
        policy: Sequence[torch.nn.Module],
        spec: RoutingSpec,
        rows: RowLayout,
        sampling: SamplingParams,
        staleness: int,
        cuda_graphs: bool = True,
    ):
        self.chunks = list(make_chunks())
        self.spec = spec
        self.rows = rows
        self.pipeline = MicrobatchPipeline(rows, spec)
        self._generation_pipelines: dict[int, MicrobatchPipeline] = {}
        self.sampling = sampling
        self.weights = LaggedWeights(policy, self.chunks, staleness, make_chunks)
        for chunk in self.chunks:
            chunk.eval()
        self.graphs = ForwardGraphs(self.chunks) if cuda_graphs else None

    @torch.no_grad()
    def generate(self, prompts: Sequence[np.ndarray], iteration: int) -> list[RolloutSample]:
        """Completes this replica's ``prompts`` (every rank of the replica passes the same ones).

        Call :meth:`LaggedWeights.advance` on :attr:`weights` once per iteration first.

        Returns:
            One sample per prompt, in order: prompt and completion tokens, the loss mask on
            the completion, the engine's log-prob of every token after the first, and the
            routes of every token but the final one.
        """
        count, steps = len(prompts), self.sampling.max_new_tokens
        device = self.rows.device
        rows = GenerationRows(self._generation_pipeline(count), prompts, steps)
        uniforms = sampling_uniforms(self.sampling.seed, iteration, parallel_state.get_data_parallel_rank(),
                                     steps, count).to(device)
        drawn = torch.zeros((steps, count), dtype=torch.int64, device=device)
        active = torch.ones(count, dtype=torch.bool, device=device)
        any_active = _AnyActiveOnAnyRank(steps, device)
        taken = 0
        while taken < steps and any_active.before_step(taken):
            drawn[taken] = self._next_tokens(rows, taken, uniforms[taken])
            # A sample stops at the stop token; every sample stops once one has logits it cannot sample.
            active &= (drawn[taken] != self.sampling.stop_token) & (drawn[taken] >= 0).all()
            if taken + 1 < steps:  # after the last step no flag is read
                any_active.after_step(taken, active)
                rows.write(taken + 1, drawn[taken].clamp(min=0))
            taken += 1
        drawn = drawn[:taken].cpu().numpy()
        broken = drawn < 0
        if broken.any():
            step = int(np.argmax(broken.any(axis=1)))
            raise RolloutEngineError(
                f"rollout engine, iteration {iteration}, step {step}: the logits of sample "
                f"{int(np.argmax(broken[step]))} are not finite ({int(broken[step].sum())} of {count} samples): "
                f"the engine's weights hold NaN or inf, or its activations overflowed"
            )
        tokens = [list(map(int, prompt)) + _completion(drawn[:, i], self.sampling.stop_token).tolist()
                  for i, prompt in enumerate(prompts)]
        return self._record(tokens, [len(p) for p in prompts])

    def _next_tokens(self, rows: GenerationRows, step: int, uniforms: torch.Tensor) -> torch.Tensor:
        """One forward pass; int64 ``[samples]`` on every rank: the token each sample draws at ``step``,
        -1 where its logits are not finite. Nothing waits for the device."""
        def last_position_logits(index, batch, logits):
            return no_loss({"rows": rows.last_position_rows(index, logits, step)}, logits)

        outputs = run_pass(self.chunks, rows.microbatches(), last_position_logits, graphs=self.graphs).outputs
        drawn = torch.zeros(rows.num_samples, dtype=torch.int64, device=self.rows.device)
        if parallel_state.is_pipeline_last_stage():
            vocab_shard = torch.cat([out["rows"] for out in outputs])
            logits = gather_vocab_parallel(sum_over_context_parallel(vocab_shard)).double()
            broken = ~torch.isfinite(logits).all(dim=-1)
            drawn.copy_(torch.where(broken, -1, sample_tokens(logits.nan_to_num(), uniforms,
                                                              self.sampling.temperature)))
        return broadcast_from_last_stage(drawn)

    def _generation_pipeline(self, count: int) -> MicrobatchPipeline:
        """``count`` samples in as few rows as the schedule allows (one per pipeline stage).

        Generation runs a pass per sampled token; packing the samples into fewer, longer rows
        (the trainer's rows side by side) spares the host the per-microbatch work of each of
        those passes. The recording pass packs like the trainer, so each recorded route sits
        where the trainer replays it.
        """
        if count not in self._generation_pipelines:
            rows = self.rows
            trainer_rows = count // rows.micro_batch_size
            stages = parallel_state.get_pipeline_model_parallel_world_size()
            if trainer_rows % stages == 0:  # interleaved 1F1B needs a microbatch per stage
                per_row = trainer_rows // stages
                rows = replace(rows, micro_batch_size=rows.micro_batch_size * per_row,
                               seq_length=rows.seq_length * per_row)
            self._generation_pipelines[count] = MicrobatchPipeline(rows, self.spec)
        return self._generation_pipelines[count]

    def _record(self, tokens: list[list[int]], prompt_lens: list[int]) -> list[RolloutSample]:
        """The recording pass: routes and log-probs of the finished samples."""
        seq_length = self.rows.seq_length

        def full_row_logprobs(index, batch, logits):
            logprobs = token_logprobs(logits, batch.labels, self.sampling.temperature)[0]
            row = torch.zeros(seq_length, dtype=torch.float32, device=logits.device)
            row[batch.row_index.to(logits.device)] = logprobs
            return no_loss({"row": row}, logits)

        microbatches = self.pipeline.prepare([RolloutSample.unscored(t) for t in tokens])
        result = run_pass(self.chunks, microbatches, full_row_logprobs, record=True, graphs=self.graphs)
        outputs, routings = result.outputs, result.routings
        batches = [per_chunk[0].batch for per_chunk in result.items]
        rows = torch.zeros((len(batches), seq_length), dtype=torch.float32, device=self.rows.device)
        if parallel_state.is_pipeline_last_stage():
            rows.copy_(sum_over_context_parallel(torch.stack([out["row"] for out in outputs])))
        rows = broadcast_from_last_stage(rows).cpu().numpy()

        # This rank's recorded parts, then those of the replica's other ranks.
        local = [[(plan, routing.recorded_expert_ids().cpu())
                  for plan, routing in zip(self.rows.plans(batch, self.spec.model_moe_layers), per_chunk)]
                 for batch, per_chunk in zip(batches, routings)]
        parts = gather_objects_in_replica(local)

        samples = []
        for m, batch in enumerate(batches):
            routes = from_megatron_recorded([part for rank in parts for part in rank[m]], batch.sample_lens, self.spec)
            starts = np.cumsum(np.concatenate([[0], batch.padded_lens[:-1]]))
            for j, (start, length) in enumerate(zip(starts, batch.sample_lens)):
                i = m * self.rows.micro_batch_size + j
                logprobs = np.zeros(length, dtype=np.float32)
                logprobs[1:] = rows[m, start:start + length - 1]  # position t predicts token t + 1
                check_logprobs(logprobs, f"rollout engine sample {i}")
                samples.append(RolloutSample(
                    token_ids=np.asarray(tokens[i], dtype=np.int64),
                    loss_mask=np.arange(length) >= prompt_lens[i],
                    logprobs=logprobs,
                    routes=_without_final_route(routes[j]),
                ))
        return samples


def _without_final_route(routes: RolloutRoutes) -> RolloutRoutes:
    """The same routes with none for the final token, which an engine samples but never runs."""
    ids, valid = routes.ids.copy(), routes.valid.copy()
    ids[-1], valid[-1] = 0, False
    return RolloutRoutes(ids, valid, routes.num_experts, routes.layer_numbers)


def _completion(drawn: np.ndarray, stop_token: int) -> np.ndarray:
    """A sample's draws up to and with its first stop token (all of them without one)."""
    stops = np.flatnonzero(drawn == stop_token)
    return drawn[:stops[0] + 1] if len(stops) else drawn


class _AnyActiveOnAnyRank:
    """Whether a sample is still active on any rank after each generation step (every replica runs
    the same number of passes): the one wait for the device in a generation step.

    On a GPU the flag is read one step late: before step ``t`` is launched, the flag after step
    ``t - 2``, copied to pinned memory when it was computed. The wait then overlaps step ``t - 1``
    on the device, which would otherwise idle while the host checks and launches the next pass.
    The price is one pass past the step where the last sample stopped; its draws follow every
    sample's stop token, and the completions end there. On a CPU nothing runs meanwhile: no lag.
    """

    def __init__(self, steps: int, device: torch.device):
        on_gpu = device.type == "cuda"
        self.lag = 1 if on_gpu else 0
        self.flags = torch.zeros(steps, dtype=torch.int32, pin_memory=on_gpu)
        self.ready = [torch.cuda.Event() for _ in range(steps)] if on_gpu else None

    def after_step(self, step: int, active: torch.Tensor) -> None:
        flag = active.any().to(torch.int32).reshape(1)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.flags[step:step + 1].copy_(flag, non_blocking=self.ready is not None)
        if self.ready is not None:
            self.ready[step].record()

    def before_step(self, step: int) -> bool:
        """Whether to launch ``step``: False once no sample of any rank was active ``1 + lag`` steps before."""
        checked = step - 1 - self.lag
        if checked < 0:
            return True
        if self.ready is not None:
            self.ready[checked].synchronize()
        return bool(self.flags[checked])
