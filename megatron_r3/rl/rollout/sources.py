"""Where each iteration's samples come from: the built-in task and engine, or a rollout dump.

Both give a :class:`RolloutBatch` per iteration (this data-parallel rank's samples, their
advantages and rewards) and can resume at a checkpoint's data position.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from megatron.core import parallel_state

from megatron_r3.dataplane.formats.dump_checks import check_dump_fits
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.rollout_shards import DataParallelDumpShard
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl.arguments import moe_layers_of
from megatron_r3.rl.rollout.engine import RolloutEngine
from megatron_r3.rl.rollout.tasks import SymbolTask
from megatron_r3.rl.run_checks import RunCheckError, check_dump_records, microbatch_problem
from megatron_r3.rl.trainer.policy_loss import group_advantages


def check_dump(reader: RolloutDumpReader, args: argparse.Namespace) -> None:
    """Refuses, before training, a dump that does not fit the model (routes, vocab, sample lengths)."""
    check_dump_fits(reader, num_experts=args.num_experts, topk=args.moe_router_topk,
                    model_moe_layers=moe_layers_of(args), vocab_size=args.vocab_size,
                    seq_length=args.seq_length)


@dataclass
class RolloutBatch:
    """This data-parallel rank's samples of one iteration, with their advantages and rewards."""

    samples: list[RolloutSample]
    advantages: np.ndarray
    rewards: Optional[np.ndarray]


class EmbeddedRollouts:
    """Prompts from the built-in task, completions from the built-in engine, rewards from the task.

    Replica ``d`` completes prompts ``[d * P, (d + 1) * P)`` of each iteration, each
    ``--rollouts-per-prompt`` times; advantages are normalised within each prompt's group.
    The engine samples with the weights it holds; the run moves them on each iteration.
    """

    loss_field = "reward"  # advantages are rewards normalised within each prompt's group

    def __init__(self, args: argparse.Namespace, task: SymbolTask, engine: RolloutEngine, per_rank: int):
        self.task = task
        self.engine = engine
        self.seed = args.seed
        self.group = args.rollouts_per_prompt
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

    def __init__(self, args: argparse.Namespace, global_batch: int, log: Callable[[str], None]):
        self.path, self.global_batch = args.rollout_dump, global_batch
        self.group = args.rollouts_per_prompt
        # A cut last record is dropped by the reader and refused (or warned about) by _check_footer.
        self.reader = RolloutDumpReader(self.path, allow_truncated_tail=True)
        try:
            self._check_footer(args.allow_truncated_rollout_dump, log)
            check_dump(self.reader, args)
            self.loss_field = check_dump_records(self.reader, log)
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

    def resume(self, consumed_samples: int) -> None:
        """Continue after the first ``consumed_samples`` samples (a checkpoint's data position)."""
        self.shard = self._shard(consumed_samples)

    def check_microbatches(self, args: argparse.Namespace, iteration: int, alignment: int) -> None:
        """Every microbatch of the iterations after ``iteration`` fits one ``--seq-length`` row."""
        problem = microbatch_problem(self.reader.index.num_tokens, consumed_samples=self.shard.consumed_samples,
                                     iterations=args.train_iters - iteration, global_batch=self.global_batch,
                                     micro_batch_size=args.micro_batch_size, alignment=alignment,
                                     seq_length=args.seq_length, first_iteration=iteration + 1)
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
