"""One policy-gradient iteration on rollout samples, with routing replay (R3 or R2) or live routing.

Per iteration the trainer packs this data-parallel rank's samples into
microbatches and runs, through Megatron's schedule (:mod:`megatron_r3.model_pass`):

1. R2 only: an old-log-prob pass (forward only) that records the routes its
   routers take; the update pass replays exactly those (``recorded_expert_ids()``,
   already in router order) and uses that pass's log-probs as ``logp_old``.
2. With ``compare``: one more forward-only pass in the other mode (live when
   training replays, R3 replay when training routes live), for the side-by-side
   mismatch metrics, and routing agreement with the engine's routes where they
   exist. It runs on the same weights as the update pass.
3. The update pass (forward and backward) on the clipped policy-gradient loss
   (:mod:`megatron_r3.policy_loss`), with the rollout engine's routes (R3), the
   recorded ones (R2) or live routing. ``logp_old`` is the rollout engine's
   log-prob under R3 and live routing.

The model chunks train through Megatron's stack (:mod:`megatron_r3.training_stack`):
the schedule ends the update pass with ``finalize_model_grads``, which reduces the
gradients over the ranks and divides them by the iteration's completion tokens;
then Megatron's optimizer steps and the learning-rate schedule advances, unless the
loss or the gradient norm is not finite: then every rank raises
:class:`NonFiniteStepError`, with the weights and the optimizer state as they were
before the step (the optimizer skips an update whose gradient norm is not finite).
Samples are checked where they enter :meth:`PolicyTrainer.step` (log-probs finite
and ``<= 0``, advantages finite). Every metric leaves as a sum (reduced across all ranks in
one all-reduce; ranks holding a duplicate contribute zeros), to be divided by
:mod:`megatron_r3.train_metrics`.
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

from megatron_r3.adapters import RoutingSpec
from megatron_r3.model_pass import no_loss, run_pass, token_logprobs
from megatron_r3.policy_loss import clipped_policy_loss_sums
from megatron_r3.replica_comm import is_replica_lead
from megatron_r3.rollout_batch import RolloutMicrobatch, RowLayout, logprob_mismatch_sums
from megatron_r3.rollout_dump import RolloutSample
from megatron_r3.routes import RolloutRoutes
from megatron_r3.routing_agreement import routing_agreement_counts
from megatron_r3.sample_checks import SampleValueError, check_sample_values
from megatron_r3.train_metrics import zero_sums
from megatron_r3.training_stack import TrainingStack
from megatron_r3.transport import PackedRoutes, RouteUploader

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
    """

    replay_mode: Optional[str]
    compare: bool
    clip_ratio: float
    temperature: float

    def __post_init__(self):
        if self.replay_mode not in (None, *REPLAY_MODES):
            raise ValueError(f"--routing-replay-mode must be one of {REPLAY_MODES}, got {self.replay_mode!r}")
        if self.clip_ratio <= 0:
            raise ValueError(f"--clip-ratio must be > 0, got {self.clip_ratio}")

    @property
    def trains_with_replay(self) -> bool:
        return self.replay_mode is not None


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
                 settings: PolicyUpdateSettings):
        if (settings.trains_with_replay or settings.compare) and not config.moe_enable_routing_replay:
            raise ValueError("routing replay and --r3-compare need a model built with moe_enable_routing_replay")
        self.stack = stack
        self.chunks = list(stack.model)
        self.config = config
        self.spec = spec
        self.rows = rows
        self.settings = settings
        self.uploader = RouteUploader(rows.device)
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()

    def step(self, samples: Sequence[RolloutSample], advantages: Sequence[float],
             rewards: Optional[Sequence[float]] = None) -> dict[str, np.ndarray]:
        """One iteration on this data-parallel rank's share of the global batch.

        Args:
            samples: This rank's samples, with rollout log-probs (and routes for R3).
            advantages: One per sample.
            rewards: One per sample, for the reward metric (None: not known).

        Returns:
            The iteration's sums over all ranks (:func:`megatron_r3.train_metrics.zero_sums`), and the
            step's ``lr`` and ``grad_norm``.

        Raises:
            SampleValueError: a sample without rollout log-probs, or with values the loss cannot take.
            NonFiniteStepError: on every rank, when the loss or the gradients are not finite; the
                optimizer has not stepped (the weights and its state are those before the call).
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
        batches = self.rows.microbatches(samples, advantages)
        groups = [samples[i:i + self.rows.micro_batch_size] for i in range(0, len(samples), self.rows.micro_batch_size)]
        rollout_routes = None
        if settings.replay_mode == "r3" or (settings.compare and not settings.trains_with_replay):
            rollout_routes = [self.uploader.upload([self._routes_of(s) for s in group],
                                                   self.rows.plans(batch, self.spec.moe_layer_numbers))
                              for group, batch in zip(groups, batches)]
        sums = zero_sums(len(self.spec.moe_layer_numbers), self.rows.device)

        old_logprobs = [batch.rollout_logprobs for batch in batches]
        train_routes = rollout_routes if settings.replay_mode == "r3" else None
        if settings.replay_mode == "r2":
            old_logprobs, train_routes = self._old_logprob_pass(batches)

        if settings.compare:
            # The comparison pass also measures routing agreement: routing live it records what the
            # trainer chose; replaying it keeps its live top-k. The update pass pays for neither.
            compare_routes = None if settings.trains_with_replay else rollout_routes
            outputs, routings = run_pass(self.chunks, batches, self._mismatch_loss, routes=compare_routes,
                                         record=compare_routes is None and rollout_routes is not None,
                                         keep_live_routes=compare_routes is not None)
            self._add_mismatch(sums, "mismatch/live" if settings.trains_with_replay else "mismatch/replay", outputs)
            if rollout_routes is not None:
                self._add_agreement(sums, rollout_routes, routings)

        self.stack.zero_grad()
        loss_fn = _PolicyLoss(old_logprobs, settings)
        # The schedule ends with finalize_model_grads: gradients reduced and divided by the tokens.
        outputs, routings = run_pass(self.chunks, batches, loss_fn, routes=train_routes, forward_only=False)
        self._add_mismatch(sums, "mismatch/replay" if settings.trains_with_replay else "mismatch/live", outputs)
        if self._tp_rank == 0:
            for out in outputs:
                sums["loss"] += out["loss"].to(sums["loss"].device)
        if is_replica_lead():
            self._add_replica_counts(sums, samples, rewards)

        totals = _all_reduce(sums)
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
        if not stepped:  # a norm that is not finite: the optimizer skipped the update
            raise NonFiniteStepError(f"the loss is {loss} and the gradient norm over all ranks is {grad_norm}: not "
                                     f"finite, so the optimizer did not step and nothing was saved (a weight or an "
                                     f"activation overflowed?)")
        self.stack.scheduler.step(increment=1)
        return lr, float(grad_norm)

    def _old_logprob_pass(self, batches: Sequence[RolloutMicrobatch]):
        """R2: record the routes and log-probs of the current weights; the update replays them."""
        temperature = self.settings.temperature

        def logprobs(index, batch, logits):
            return no_loss({"logprobs": token_logprobs(logits, batch.labels, temperature)}, logits)

        outputs, routings = run_pass(self.chunks, batches, logprobs, record=True)
        recorded = [[PackedRoutes(r.recorded_expert_ids(), tuple(r.layer_numbers), every_token_routed=True)
                     for r in per_chunk]
                    for per_chunk in routings]
        old = [out["logprobs"] for out in outputs] or [None] * len(batches)  # only the last stage has them
        return old, recorded

    def _mismatch_loss(self, index, batch, logits):
        logprobs = token_logprobs(logits, batch.labels, self.settings.temperature)
        return no_loss({"mismatch": logprob_mismatch_sums(logprobs, batch.rollout_logprobs, batch.loss_mask)}, logits)

    def _routes_of(self, sample: RolloutSample) -> RolloutRoutes:
        """A sample's routes; a sample without any is routed live."""
        if sample.routes is not None:
            return sample.routes
        return RolloutRoutes.empty(len(sample.token_ids), num_experts=self.spec.num_experts, topk=self.spec.topk,
                                   layer_numbers=self.spec.moe_layer_numbers)

    def _add_mismatch(self, sums, key: str, outputs) -> None:
        # Every TP rank of the last stage holds the same values; CP ranks hold their own tokens.
        if self._tp_rank == 0:
            for out in outputs:
                sums[key] += out["mismatch"].to(sums[key].device)

    def _add_agreement(self, sums, rollout_routes, routings) -> None:
        # Without SP every TP rank routes the same tokens; with SP each routes its own slice.
        if self._tp_rank != 0 and not self.config.sequence_parallel:
            return
        for per_chunk_routes, per_chunk in zip(rollout_routes, routings):
            for routes, routing in zip(per_chunk_routes, per_chunk):
                trainer = routing.live_expert_ids() if routing.keep_live_routes else routing.recorded_expert_ids()
                sums["agreement"] += routing_agreement_counts(
                    routes.expert_ids, trainer, routing.layer_numbers, self.spec.moe_layer_numbers
                ).to(sums["agreement"].device)

    def _add_replica_counts(self, sums, samples: Sequence[RolloutSample], rewards) -> None:
        tokens = sum(len(s.token_ids) for s in samples)
        if self.settings.replay_mode == "r3":
            replayed = sum(int(self._routes_of(s).valid.sum()) for s in samples)
        else:
            replayed = tokens if self.settings.replay_mode == "r2" else 0
        sums["tokens"] += tokens
        sums["routing/replayed_tokens"] += replayed
        sums["routing/live_tokens"] += tokens - replayed
        sums["samples"] += len(samples)
        if rewards is not None:
            sums["reward"] += torch.tensor([float(np.sum(rewards)), len(rewards)], dtype=torch.float64,
                                           device=sums["reward"].device)


class _PolicyLoss:
    """The update pass's loss function: clipped policy-gradient loss sum, and mismatch sums."""

    def __init__(self, old_logprobs, settings: PolicyUpdateSettings):
        self.old_logprobs = old_logprobs
        self.settings = settings

    def __call__(self, index: int, batch: RolloutMicrobatch, logits: torch.Tensor):
        logprobs = token_logprobs(logits, batch.labels, self.settings.temperature)
        mask = batch.loss_mask
        loss = clipped_policy_loss_sums(logprobs, self.old_logprobs[index], batch.advantages, mask,
                                        self.settings.clip_ratio)
        mismatch = logprob_mismatch_sums(logprobs.detach(), batch.rollout_logprobs, mask)
        tokens = mask.sum()
        return loss, tokens.to(torch.int), {"loss": torch.stack([loss.detach(), tokens]).double(), "mismatch": mismatch}


def _all_reduce(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every entry summed over all ranks, in one all-reduce."""
    flat = torch.cat([value.reshape(-1) for value in sums.values()])
    dist.all_reduce(flat)
    out, start = {}, 0
    for name, value in sums.items():
        out[name] = flat[start:start + value.numel()].reshape(value.shape)
        start += value.numel()
    return out
