"""One policy-gradient iteration on rollout samples, with routing replay (R3 or R2) or live routing.

Per iteration the trainer packs this data-parallel rank's samples into
microbatches, once for all passes (the host's work: rows, routing plans, filler routes,
host token counts; :mod:`megatron_r3.dataplane.device.batch_plan`), and runs, through
Megatron's schedule (:mod:`megatron_r3.rl.model.passes`):

1. R2 only: an old-log-prob pass (forward only) that records the routes its
   routers take; the update pass replays exactly those (``recorded_expert_ids()``,
   already in router order) and uses that pass's log-probs as ``logp_old``.
2. With ``compare``: one more forward-only pass in the other mode (live when
   training replays, R3 replay when training routes live), for the side-by-side
   mismatch metrics, and routing agreement with the engine's routes where they
   exist. It runs on the same weights as the update pass.
3. The update pass (forward and backward) on the clipped policy-gradient loss
   (:mod:`megatron_r3.rl.trainer.policy_loss`), with the rollout engine's routes (R3), the
   recorded ones (R2) or live routing. ``logp_old`` is the rollout engine's
   log-prob under R3 and live routing.

The model chunks train through Megatron's stack (:mod:`megatron_r3.rl.trainer.training_stack`):
the schedule ends the update pass with ``finalize_model_grads``, which reduces the
gradients over the ranks and divides them by the iteration's completion tokens;
then Megatron's optimizer steps and the learning-rate schedule advances, unless the
loss or the gradient norm is not finite: then every rank raises
:class:`NonFiniteStepError`, with the weights and the optimizer state as they were
before the step (the optimizer skips an update whose gradient norm is not finite).
Samples are checked where they enter :meth:`PolicyTrainer.step` (log-probs finite
and ``<= 0``, advantages finite). Every metric leaves as a sum (reduced across all ranks in
one all-reduce; ranks holding a duplicate contribute zeros), to be divided by
:mod:`megatron_r3.rl.trainer.metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
from megatron.core.transformer.moe.moe_routing import host_counts_unsupported

from megatron_r3.dataplane.device.batch_plan import PlannedBatch
from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange
from megatron_r3.dataplane.device.filler_routes import first_dead_position
from megatron_r3.dataplane.device.microbatch_pipeline import MicrobatchPipeline
from megatron_r3.dataplane.device.microbatches import RolloutMicrobatch, RowLayout
from megatron_r3.dataplane.device.transport import PackedRoutes
from megatron_r3.dataplane.sample_checks import SampleValueError, check_sample_values
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl.model.forward_graphs import ForwardGraphs
from megatron_r3.rl.model.passes import PassResult, no_loss, run_pass, token_logprobs
from megatron_r3.rl.model.replica_comm import is_replica_lead
from megatron_r3.rl.profiling.phase_timer import PhaseTimer
from megatron_r3.rl.trainer.logprob_mismatch import logprob_mismatch_sums
from megatron_r3.rl.trainer.metrics import zero_sums
from megatron_r3.rl.trainer.policy_loss import clipped_policy_loss_sums
from megatron_r3.rl.trainer.routing_agreement import routing_agreement_counts
from megatron_r3.rl.trainer.training_stack import TrainingStack
from megatron_r3.rl.trainer.update_graphs import UpdatePassGraphs

REPLAY_MODES = ("r3", "r2")


class NonFiniteStepError(RuntimeError):
    """The loss or the gradients of a step are not finite; the optimizer did not step."""


@dataclass(frozen=True)
class PolicyUpdateSettings:
    """How the trainer routes and what it optimises.

    Attributes:
        replay_mode: ``"r3"`` (replay the rollout's routes), ``"r2"`` (replay the routes of the
            trainer's own old-log-prob pass) or None (route live).
        compare: Also run a forward-only pass in the other mode and report both.
        clip_ratio: PPO clip epsilon.
        temperature: The sampling temperature the log-probs refer to.
        filler_routes: Replaying the rollout's routes, give the positions no loss can see filler
            routes (the sync-free path); False routes them live.
        cuda_graphs: Run the update pass and the forward-only passes that route live (the
            comparison pass when training replays, R2's old-log-prob pass) as CUDA graph replays
            where they apply (:mod:`megatron_r3.rl.trainer.update_graphs`, :mod:`megatron_r3.rl.model.forward_graphs`).
    """

    replay_mode: Optional[str]
    compare: bool
    clip_ratio: float
    temperature: float
    filler_routes: bool = True
    cuda_graphs: bool = True

    def __post_init__(self):
        if self.replay_mode not in (None, *REPLAY_MODES):
            raise ValueError(f"--routing-replay-mode must be one of {REPLAY_MODES}, got {self.replay_mode!r}")
        if self.clip_ratio <= 0:
            raise ValueError(f"--clip-ratio must be > 0, got {self.clip_ratio}")

    @property
    def trains_with_replay(self) -> bool:
        return self.replay_mode is not None

    @property
    def routers_take_moe_routing(self) -> bool:
        """Some pass gives the routers a ``MoERouting``: the update pass replays, or the comparison
        pass replays (training live) or records (training with replay). The model must be built
        for it (:func:`megatron_r3.rl.arguments.routers_take_moe_routing`)."""
        return self.trains_with_replay or self.compare


class PolicyTrainer:
    """Takes optimizer steps on the clipped policy-gradient loss over rollout samples.

    Args:
        stack: This rank's model chunks in DDP (with ``moe_enable_routing_replay`` when any pass
            replays), their optimizer and learning-rate schedule.
        config: The chunks' ``TransformerConfig`` (its ``finalize_model_grads_func`` set by the stack).
        spec: The model's MoE layers, experts and top-k.
        rows: How this rank packs rows (the same as the rollout engine's).
        settings: Routing mode, comparison pass, clip ratio, temperature.
    """

    def __init__(self, stack: TrainingStack, config, spec: RoutingSpec, rows: RowLayout,
                 settings: PolicyUpdateSettings, timer: Optional[PhaseTimer] = None):
        if settings.routers_take_moe_routing and not config.moe_enable_routing_replay:
            raise ValueError("routing replay and --r3-compare need routers that take a MoERouting: a model built "
                             "with moe_enable_routing_replay")
        self.stack = stack
        self.chunks = list(stack.model)
        self.config = config
        self.spec = spec
        self.rows = rows
        self.settings = settings
        exchange = None
        replays_rollout_routes = settings.replay_mode == "r3" or (settings.compare and not settings.trains_with_replay)
        if replays_rollout_routes and host_counts_unsupported(config) is None:
            # Host token counts for the sync-free dispatch (a collective to build: every rank builds it).
            exchange = ExpertCountExchange(parallel_state.get_expert_tensor_and_model_parallel_group(),
                                           spec.num_experts)
        self.pipeline = MicrobatchPipeline(rows, spec, exchange)
        self.graphs = ForwardGraphs(self.chunks) if settings.cuda_graphs else None
        self.update = UpdatePassGraphs(self.chunks, PolicyLoss(settings), settings.cuda_graphs)
        self.timer = timer or PhaseTimer(rows.device)
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()

    def step(self, samples: Sequence[RolloutSample], advantages: Sequence[float],
             rewards: Optional[Sequence[float]] = None) -> dict[str, np.ndarray]:
        """One iteration on this data-parallel rank's share of the global batch.

        Args:
            samples: This rank's samples, with rollout log-probs (and routes for R3).
            advantages: One per sample.
            rewards: One per sample, for the reward metric (None: not known).

        Returns:
            The iteration's sums over all ranks (:func:`megatron_r3.rl.trainer.metrics.zero_sums`), and the
            step's ``lr`` and ``grad_norm``.

        Raises:
            SampleValueError: a sample without rollout log-probs, or with values the loss cannot take.
            NonFiniteStepError: on every rank, when the loss or the gradients are not finite; the
                optimizer has not stepped (the weights and its state are those before the call).
            ValueError: where a forward found its routes wrong on the device (a row only partly without
                a route, a host token count that differs from the routes: ``MoERouting.verify``), and
                RuntimeError on the other ranks; the optimizer has not stepped, the process can save or exit.
        """
        for i, sample in enumerate(samples):
            if sample.logprobs is None:
                raise SampleValueError(f"sample {i} has no rollout log-probs: the policy-gradient loss needs them")
            check_sample_values(sample, f"sample {i}")
        advantages = np.asarray(advantages, dtype=np.float64)
        if not np.isfinite(advantages).all():
            bad = int(np.argmax(~np.isfinite(advantages)))
            raise SampleValueError(f"sample {bad}: advantage {advantages[bad]} is not finite")
        settings = self.settings
        sums = zero_sums(len(self.spec.model_moe_layers), self.rows.device)
        old_logprobs = recorded = None
        checked_passes = []  # passes whose routes the forwards checked on the device
        has_routes = settings.replay_mode != "r2"  # the samples carry the engine's routes
        with self.timer.phase("prepare"):
            # Every pass runs these rows: the host prepares them once, before the first pass.
            batch = self.pipeline.plan(samples, advantages, fillers=settings.filler_routes,
                                       rollout_routes=settings.replay_mode == "r3" or (settings.compare and has_routes))
        if settings.replay_mode == "r2":
            with self.timer.phase("pass/old_logprob"):
                old_logprobs, recorded = self._old_logprob_pass(batch)

        if settings.compare:
            # The comparison pass runs in the other mode and measures routing agreement with the
            # engine's routes: routing live it records what the trainer chose, replaying it keeps
            # its live top-k. The update pass pays for neither.
            replays = not settings.trains_with_replay
            with self.timer.phase("pass/compare"):
                result = run_pass(self.chunks, self.pipeline.prepare(batch, rollout_routes=has_routes,
                                                                     fillers=settings.filler_routes),
                                  self._mismatch_loss, replay=replays, record=has_routes and not replays,
                                  keep_live_routes=has_routes and replays, graphs=self.graphs)
            self._add_mismatch(sums, "mismatch/replay" if replays else "mismatch/live", result.outputs)
            if has_routes:
                self._add_agreement(sums, result)
            checked_passes.append(result)

        self.stack.zero_grad()
        microbatches = self.pipeline.prepare(batch, rollout_routes=settings.replay_mode == "r3", recorded=recorded,
                                             fillers=settings.filler_routes, old_logprobs=old_logprobs)
        # The schedule ends with finalize_model_grads: gradients reduced and divided by the tokens.
        with self.timer.phase("pass/update"):
            result = self.update.run(microbatches)
        checked_passes.append(result)
        self._add_mismatch(sums, "mismatch/replay" if settings.trains_with_replay else "mismatch/live", result.outputs)
        if self._tp_rank == 0:
            for out in result.outputs:
                sums["loss"] += out["loss"].to(sums["loss"].device)
        sums["routing/host_split_microbatches"] += torch.tensor(
            [result.host_split_microbatches, microbatches.num_microbatches], dtype=torch.float64,
            device=self.rows.device)
        if is_replica_lead():
            self._add_replica_counts(sums, samples, rewards)

        with self.timer.phase("optimizer"):
            route_error = _route_error(checked_passes)
            totals = _all_reduce({**sums, "route_errors": torch.tensor(
                [float(route_error is not None)], dtype=sums["loss"].dtype, device=sums["loss"].device)})
            if float(totals.pop("route_errors")) > 0:  # on every rank, before the optimizer steps
                raise route_error or RuntimeError("another rank found wrong routes in this step (its error names "
                                                  "the layer, the expert and the rank); the optimizer did not step")
            lr, grad_norm = self._optimizer_step(float(totals["loss"][0]) / max(float(totals["loss"][1]), 1.0))
        out = {name: value.cpu().numpy() for name, value in totals.items()}
        out["lr"], out["grad_norm"] = np.array([lr]), np.array([grad_norm])
        return out

    def _optimizer_step(self, loss: float) -> tuple[float, float]:
        """Megatron's optimizer step and one scheduler step; on every rank, nothing is applied when
        the (all-reduced) loss or the gradient norm is not finite. Returns the step's learning rate
        and gradient norm."""
        if not math.isfinite(loss):
            raise NonFiniteStepError(f"the loss is {loss}: not finite, so the optimizer did not step and nothing "
                                     f"was saved (a weight or an activation overflowed?)")
        lr = get_canonical_lr_for_logging(self.stack.optimizer.param_groups)
        stepped, grad_norm, _ = self.stack.optimizer.step()
        grad_norm = float(grad_norm)  # a one-element tensor where Megatron has a tensor scale kernel (TE)
        if not stepped:  # a norm that is not finite: the optimizer skipped the update
            raise NonFiniteStepError(f"the loss is {loss} and the gradient norm over all ranks is {grad_norm}: not "
                                     f"finite, so the optimizer did not step and nothing was saved (a weight or an "
                                     f"activation overflowed?)")
        self.stack.scheduler.step(increment=1)
        return lr, grad_norm

    def _old_logprob_pass(self, batch: PlannedBatch):
        """R2: record the routes and log-probs of the current weights; the update replays them."""
        temperature = self.settings.temperature

        def logprobs(index, batch, logits):
            return no_loss({"logprobs": token_logprobs(logits, batch.labels, temperature)}, logits)

        result = run_pass(self.chunks, self.pipeline.prepare(batch), logprobs, record=True, graphs=self.graphs)
        recorded = [[PackedRoutes(r.recorded_expert_ids(), tuple(r.layer_numbers), every_token_routed=True)
                     for r in per_chunk]
                    for per_chunk in result.routings]
        old = [out["logprobs"] for out in result.outputs] or None  # only the last stage has them
        return old, recorded

    def _mismatch_loss(self, index, batch, logits):
        logprobs = token_logprobs(logits, batch.labels, self.settings.temperature)
        return no_loss({"mismatch": logprob_mismatch_sums(logprobs, batch.rollout_logprobs, batch.loss_mask)}, logits)

    def _add_mismatch(self, sums, key: str, outputs) -> None:
        # Every TP rank of the last stage holds the same values; CP ranks hold their own tokens.
        if self._tp_rank == 0:
            for out in outputs:
                sums[key] += out["mismatch"].to(sums[key].device)

    def _add_agreement(self, sums, result: PassResult) -> None:
        # Without SP every TP rank routes the same tokens; with SP each routes its own slice.
        if self._tp_rank != 0 and not self.config.sequence_parallel:
            return
        for per_chunk_items, per_chunk in zip(result.items, result.routings):
            for item, routing in zip(per_chunk_items, per_chunk):
                trainer = routing.live_expert_ids() if routing.keep_live_routes else routing.recorded_expert_ids()
                engine = item.routes.expert_ids.clone()
                engine[:, torch.from_numpy(item.filler_rows).to(engine.device)] = -1  # fillers are no engine routes
                sums["agreement"] += routing_agreement_counts(
                    engine, trainer, routing.layer_numbers, self.spec.model_moe_layers
                ).to(sums["agreement"].device)

    def _add_replica_counts(self, sums, samples: Sequence[RolloutSample], rewards) -> None:
        tokens = sum(len(s.token_ids) for s in samples)
        replayed = filler = 0
        if self.settings.replay_mode == "r3":
            for s in samples:
                valid = s.routes.valid if s.routes is not None else np.zeros(len(s.token_ids), bool)
                dead_from = first_dead_position(s.loss_mask)
                replayed += int(valid.sum())
                if self.settings.filler_routes:
                    filler += int((~valid[dead_from:]).sum())
        elif self.settings.replay_mode == "r2":
            replayed = tokens
        sums["tokens"] += tokens
        sums["routing/replayed_tokens"] += replayed
        sums["routing/filler_tokens"] += filler
        sums["routing/live_tokens"] += tokens - replayed - filler
        sums["samples"] += len(samples)
        if rewards is not None:
            sums["reward"] += torch.tensor([float(np.sum(rewards)), len(rewards)], dtype=torch.float64,
                                           device=sums["reward"].device)


class PolicyLoss:
    """The update pass's loss function: clipped policy-gradient loss sum, and mismatch sums."""

    def __init__(self, settings: PolicyUpdateSettings):
        self.settings = settings

    def __call__(self, index: int, batch: RolloutMicrobatch, logits: torch.Tensor):
        logprobs = token_logprobs(logits, batch.labels, self.settings.temperature)
        mask = batch.loss_mask
        old = batch.rollout_logprobs if batch.old_logprobs is None else batch.old_logprobs  # R2's, or the rollout's
        loss = clipped_policy_loss_sums(logprobs, old, batch.advantages, mask, self.settings.clip_ratio)
        mismatch = logprob_mismatch_sums(logprobs.detach(), batch.rollout_logprobs, mask)
        tokens = mask.sum()
        return loss, tokens.to(torch.int), {"loss": torch.stack([loss.detach(), tokens]).double(), "mismatch": mismatch}


def _route_error(passes: Sequence[PassResult]) -> Optional[ValueError]:
    """What the passes' forwards found wrong in their routes on the device, or None. Reads the device
    flags back (``PassResult.verify_routes``): the step's end, where the host waits anyway."""
    try:
        for result in passes:
            result.verify_routes()
    except ValueError as error:
        return error
    return None


def _all_reduce(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every entry summed over all ranks, in one all-reduce."""
    flat = torch.cat([value.reshape(-1) for value in sums.values()])
    dist.all_reduce(flat)
    out, start = {}, 0
    for name, value in sums.items():
        out[name] = flat[start:start + value.numel()].reshape(value.shape)
        start += value.numel()
    return out
