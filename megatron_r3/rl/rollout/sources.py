"""Where each iteration's samples come from: the built-in task and engine, or a rollout dump.

Both give a :class:`RolloutBatch` per iteration (this data-parallel rank's samples, their
advantages and rewards) and can resume at a checkpoint's data position. :class:`RolloutSettings`
says which, and how.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from megatron.core import parallel_state

from megatron_r3.dataplane.formats.dump_checks import check_dump_fits
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.rollout_dump import RolloutDumpError
from megatron_r3.dataplane.formats.rollout_shards import DataParallelDumpShard
from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl.model.factory import ModelSettings
from megatron_r3.rl.rollout.engine import RolloutEngine
from megatron_r3.rl.rollout.engine_choice import RolloutEngineSettings
from megatron_r3.rl.rollout.tasks import SymbolTask
from megatron_r3.rl.run_checks import RunCheckError, check_dump_records, microbatch_problem
from megatron_r3.rl.trainer.policy_loss import group_advantages


@dataclass(frozen=True)
class RolloutSettings:
    """Where a run's samples come from: the built-in task and engine, or a rollout dump.

    Attributes:
        group_size: Samples per prompt (``--rollouts-per-prompt``); advantages are normalised within
            these groups.
        seed: Seeds the task's prompts.
        task: The built-in task (its prompts and rewards); None with a dump.
        engine: The built-in engine's settings; None with a dump.
        dump: The rollout dump to train on instead (``--rollout-dump``), or None.
        allow_truncated_dump: Train on a dump without its footer, with a warning.
    """

    group_size: int
    seed: int
    task: Optional[SymbolTask] = None
    engine: Optional[RolloutEngineSettings] = None
    dump: Optional[str] = None
    allow_truncated_dump: bool = False

    def __post_init__(self):
        if (self.dump is None) != (self.task is not None and self.engine is not None):
            raise ValueError(f"rollouts come from a task and an engine or from a dump: got task {self.task}, "
                             f"engine {self.engine}, dump {self.dump!r}")


def check_dump(reader: RolloutDumpReader, model: ModelSettings, seq_length: int) -> None:
    """Refuses, before training, a dump that does not fit ``model`` (routes, vocab) or rows of ``seq_length``."""
    check_dump_fits(reader, num_experts=model.num_moe_experts, topk=model.moe_router_topk,
                    model_moe_layers=model.moe_layers, vocab_size=model.vocab_size, seq_length=seq_length)


@dataclass
class RolloutBatch:
    """This data-parallel rank's samples of one iteration, with their advantages and rewards."""

    samples: list[RolloutSample]
    advantages: np.ndarray
    rewards: Optional[np.ndarray]


class EmbeddedRollouts:
    """Prompts from the built-in task, completions from the built-in engine, rewards from the task.

    Replica ``d`` completes prompts ``[d * P, (d + 1) * P)`` of each iteration, each
    ``settings.group_size`` times; advantages are normalised within each prompt's group.
    The engine samples with the weights it holds; the run moves them on each iteration.
    """

    loss_field = "reward"  # advantages are rewards normalised within each prompt's group

    def __init__(self, settings: RolloutSettings, engine: RolloutEngine, per_rank: int):
        self.task = settings.task
        self.engine = engine
        self.seed = settings.seed
        self.group = settings.group_size
        self.prompts_per_rank = per_rank // self.group
        self.dp_rank = parallel_state.get_data_parallel_rank()

    def batch(self, iteration: int) -> RolloutBatch:
        first = self.dp_rank * self.prompts_per_rank
        prompts = self.task.prompts(self.seed, iteration, range(first, first + self.prompts_per_rank))
        repeated = [p for p in prompts for _ in range(self.group)]
        samples = self.engine.generate([p.token_ids for p in repeated], iteration)
        rewards = np.asarray([self.task.reward(p, s.token_ids[len(p.token_ids):]) for p, s in zip(repeated, samples)])
        for sample, reward in zip(samples, rewards):
            sample.meta["reward"] = float(reward)
        return RolloutBatch(samples, group_advantages(rewards, self.group), rewards)

    def resume(self, consumed_samples: int) -> None:
        """Nothing to do: prompts and sampling follow from (seed, iteration, data-parallel rank)."""

    def close(self) -> None:
        """Nothing to release: the engine lives as long as the run."""


class DumpRollouts:
    """This rank's share of the next ``--global-batch-size`` samples of the dump (``DataParallelDumpShard``).

    Advantages come from each sample's metadata: ``advantage`` as given when every
    sample of the dump has one, else ``reward`` normalised within groups of
    ``--rollouts-per-prompt`` consecutive samples (a rank's share is whole groups).

    Before training the dump is checked whole: its footer (a dump without one is
    refused unless ``--allow-truncated-rollout-dump``), its fit to the model, and every
    record (CRC, routes, values, a reward or an advantage), in one streaming pass the
    ranks split between them (``megatron_r3.rl.run_checks.check_dump_records``).
    """

    def __init__(self, settings: RolloutSettings, model: ModelSettings, seq_length: int, global_batch: int,
                 log: Callable[[str], None]):
        self.path, self.global_batch = settings.dump, global_batch
        self.group = settings.group_size
        # A cut last record is dropped by the reader and refused (or warned about) by _check_footer.
        try:
            self.reader = RolloutDumpReader(self.path, allow_truncated_tail=True)
        except OSError as error:
            raise RunCheckError(f"--rollout-dump {self.path}: cannot read it: {error.strerror or error}") from None
        except RolloutDumpError as error:  # not a dump, or a damaged header
            raise RunCheckError(f"--rollout-dump: {error}") from None
        try:
            self._check_footer(settings.allow_truncated_dump, log)
            check_dump(self.reader, model, seq_length)
            self.loss_field, self._records_digest = check_dump_records(self.reader, log)
        except RolloutDumpError as error:  # the dump does not fit the model
            self.reader.close()
            raise RunCheckError(f"--rollout-dump: {error}") from None
        except BaseException:
            self.reader.close()
            raise
        self.shard = self._shard(consumed_samples=0)

    def _check_footer(self, allow_truncated: bool, log: Callable[[str], None]) -> None:
        if self.reader.finished:
            return
        why = "format version 2 has none" if self.reader.version < 3 else \
            "its writer did not finish, or the file was cut"
        recovered = len(self.reader)  # a scan of the record heads; bytes after a footer raise here
        dropped = os.path.getsize(self.path) - self.reader.index.end
        found = f"{recovered} whole samples" + (f" and {dropped} bytes of a cut record" if dropped else "")
        if not allow_truncated:
            raise RunCheckError(f"--rollout-dump {self.path} has no footer ({why}), so samples may be missing at "
                                f"its end ({found} are there): pass --allow-truncated-rollout-dump to train on the "
                                f"whole samples")
        log(f" warning: --rollout-dump {self.path} has no footer ({why}): training on the {recovered} whole "
            f"samples recovered" + (f", {dropped} bytes of a cut record dropped" if dropped else ""))

    def _shard(self, consumed_samples: int) -> DataParallelDumpShard:
        return DataParallelDumpShard(self.reader, parallel_state.get_data_parallel_rank(),
                                     parallel_state.get_data_parallel_world_size(), self.global_batch,
                                     consumed_samples=consumed_samples)

    def identity(self) -> dict:
        """What tells this dump's content from another's, wherever it lies: its record count and a digest of
        its records (a checkpoint keeps it, and a run that resumes must train on the same dump)."""
        return {"records": len(self.reader), "digest": self._records_digest}

    def resume(self, consumed_samples: int) -> None:
        """Continue after the first ``consumed_samples`` samples (a checkpoint's data position)."""
        self.shard = self._shard(consumed_samples)

    def check_microbatches(self, rows: RowLayout, iteration: int, train_iters: int) -> None:
        """Every microbatch of iterations ``iteration + 1`` to ``train_iters`` fits one of ``rows``' rows."""
        problem = microbatch_problem(self.reader.index.num_tokens, consumed_samples=self.shard.consumed_samples,
                                     iterations=train_iters - iteration, global_batch=self.global_batch,
                                     micro_batch_size=rows.micro_batch_size, alignment=rows.rank.alignment,
                                     seq_length=rows.seq_length, first_iteration=iteration + 1)
        if problem is not None:
            raise RunCheckError(problem)

    def batch(self, iteration: int) -> RolloutBatch:
        samples = self.shard.next_batch()
        rewards = None
        if all("reward" in s.meta for s in samples):
            rewards = np.asarray([s.meta["reward"] for s in samples], dtype=np.float64)
        if self.loss_field == "advantage":
            advantages = np.asarray([s.meta["advantage"] for s in samples], dtype=np.float64)
        else:
            advantages = group_advantages(rewards, self.group)
        return RolloutBatch(samples, advantages, rewards)

    def close(self) -> None:
        self.reader.close()
