"""RL training of a Megatron GPT MoE with rollout routing replay (R3).

    torchrun --nproc-per-node 2 launch/pretrain_gpt_r3.py --moe-enable-routing-replay

With no other flag this is a complete small R3 loop, with no data and no
download, on CPUs (gloo) or GPUs (NCCL): each iteration the built-in rollout
engine (``megatron_r3.rl.rollout.engine``: the policy's weights in bf16, lagging
``--rollout-staleness`` optimizer steps) completes ``--global-batch-size /
--rollouts-per-prompt`` prompts of a built-in task (``megatron_r3.rl.rollout.tasks``) and
records the routes it took and the log-probs of its tokens; the task scores the
completions; the trainer (``megatron_r3.rl.trainer.policy_trainer``) replays the
engine's routes on every MoE layer and takes a step on the clipped
policy-gradient loss with group-normalised advantages (GRPO). ``--r3-compare``
(on by default here) runs one more forward-only pass without replay, so every
logged iteration shows the train/rollout mismatch with and without R3.

With ``--rollout-dump`` the samples come from a rollout dump instead
(``megatron_r3.dataplane.formats.rollout_dump``, read again from the start when it runs out; each
sample's metadata holds its ``reward`` or ``advantage``), trained with the same
loss and metrics. The policy trains through Megatron's stack
(``megatron_r3.rl.trainer.training_stack``: DDP, ``finalize_model_grads``, Megatron's Adam, the
learning-rate schedule), with Megatron-LM's flags for it (``--use-distributed-optimizer``,
``--overlap-grad-reduce``, ``--clip-grad``, ``--lr-decay-style``, ...).

``--routing-replay-mode r2`` replays the routes of the trainer's own
old-log-prob pass instead of the engine's; without ``--moe-enable-routing-replay``
the trainer routes live. Every ``--log-interval`` iterations the last rank
prints a progress line and appends the metrics (``megatron_r3.rl.trainer.metrics``)
to ``--metrics-file``. Flags follow Megatron's names; every model and layout
flag has a small default (all parallel sizes 1, so ``--nproc-per-node 2`` is
data-parallel size 2). Layers are Megatron's TransformerEngine specs on GPUs where TE is
installed (bf16), the local ``megatron_r3.layers.specs`` elsewhere (``--transformer-impl``). ``--save``/``--save-interval`` write checkpoints
(``megatron_r3.rl.checkpoint.checkpointing``: weights, optimizer, learning-rate schedule, the engine's
lagging weights, data position, RNG) and ``--load`` resumes from the latest one, under
any layout.

Bad input stops the run before its first iteration, with one line naming the
flags, files or records (``megatron_r3.rl.run_checks``): the flags' arithmetic, an
unwritable ``--save``, a ``--load`` without a checkpoint (unless
``--load-optional``), a ``--metrics-file`` of another run (unless
``--append-metrics-file`` or ``--overwrite-metrics-file``), a dump without its
footer (unless ``--allow-truncated-rollout-dump``), with bytes after it, or with
a record that is corrupt or holds a value the loss cannot take. A loss or
gradients that are not finite stop the step before the optimizer applies it,
with nothing saved and the iteration named. The process then exits with status
1 (2 for flags). Under torchrun every rank stops, and rank 0 says why (another
rank only where its reason differs); torchrun then reports the failed workers
itself (docs/launcher.md, "What torchrun shows"). SIGTERM and SIGINT stop the run
between two iterations (a save in progress finishes), saved to ``--save`` if it
has one, with one line saying what was saved and the exit status 128 + the
signal's number (``megatron_r3.rl.stop_signals``).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports below (torch, Megatron), which take seconds

import sys  # noqa: E402
from typing import Optional  # noqa: E402

from megatron_r3.known_warnings import filter_known_warnings  # noqa: E402

filter_known_warnings()  # before Megatron's imports, which print most of them

import os  # noqa: E402

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_r3.rl.arguments import parse_args, run_settings  # noqa: E402
from megatron_r3.rl.checkpoint.checkpointing import (  # noqa: E402
    CheckpointReadError,
    CheckpointSaveError,
    NonFiniteCheckpointError,
)
from megatron_r3.rl.initialize import initialize  # noqa: E402
from megatron_r3.rl.rollout.engine import RolloutEngineError  # noqa: E402
from megatron_r3.rl.run_checks import RunCheckError  # noqa: E402
from megatron_r3.rl.stop_signals import StopRequested  # noqa: E402
from megatron_r3.rl.trainer.policy_trainer import NonFiniteStepError  # noqa: E402
from megatron_r3.rl.run import train  # noqa: E402

# Errors every rank raises with the same message (after an exchange, or from what all ranks read alike):
# rank 0 says them. Any other error is said by each rank that has it.
RAISED_ON_EVERY_RANK = (RunCheckError, NonFiniteStepError, NonFiniteCheckpointError, CheckpointReadError,
                        CheckpointSaveError)


def main(argv: Optional[list[str]] = None) -> None:
    """Runs the launcher; bad input ends the process with one line on stderr (rank 0's) and exit status 1."""
    settings = run_settings(parse_args(argv))
    try:
        imported = time.perf_counter()
        device = initialize(settings)
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f" time to initialize (seconds): imports {imported - STARTED:.1f} | distributed and devices "
                  f"{time.perf_counter() - imported:.1f}", flush=True)
        train(settings, device)
    except StopRequested as stopped:  # the logging rank said what was saved
        raise SystemExit(stopped.status) from None
    except (ValueError, OSError, NonFiniteStepError, RolloutEngineError) as error:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank == 0 or not isinstance(error, RAISED_ON_EVERY_RANK):
            for line in str(error).splitlines():  # one line per problem
                print(f"pretrain_gpt_r3.py: error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
