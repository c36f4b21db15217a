"""The update pass and the optimizer step on Megatron's training stack and on the loop's old one.

    python -m bench.training_stack --out build/bench/training-stack.md              # 1 GPU
    torchrun --nproc-per-node 2 -m bench.training_stack --out build/bench/training-stack-dp2.md

The launcher trains in dump mode (a synthetic dump written first, so no rollout engine runs)
on its default model (8 MoE layers, hidden 128, 8 experts top-2), ``--iters`` iterations per
run, once per variant in each of ``--rounds`` interleaved rounds:

* ``old-loop``: the stack before Megatron's: the chunks unwrapped, ``torch.optim.AdamW``,
  each gradient all-reduced on its own (``tests/support/reference_stack.py``), no clipping;
* ``megatron``: DDP, ``finalize_model_grads`` and Megatron's optimizer, the defaults
  (``--clip-grad 1.0``);
* ``megatron-no-clip``: the same with ``--clip-grad 0`` (what the old loop did);
* ``megatron-overlap``: ``--overlap-grad-reduce`` (bucketed reduction during the backward);
* ``megatron-distopt``: ``--use-distributed-optimizer``.

It reports, per variant, the medians over every run's iterations after the first two of the
loop's own timers: ``time/pass/update_s`` (forward, backward and the gradient reduction,
which Megatron's schedule runs at the pass's end) and ``time/optimizer_s`` (the step, with
the learning-rate schedule), with the min and max.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from bench import publish_report
from megatron_r3.rl import run as rl_run
from megatron_r3.rl.arguments import parse_args, run_settings
from megatron_r3.rl.initialize import initialize
from megatron_r3.rl.run_settings import RunSettings
from tests.support.reference_stack import OldLoopStack
from tools.synthetic_rollout_dump import write_synthetic_dump

VARIANTS = {
    "old-loop": ["--clip-grad", "0"],
    "megatron": [],
    "megatron-no-clip": ["--clip-grad", "0"],
    "megatron-overlap": ["--overlap-grad-reduce"],
    "megatron-distopt": ["--use-distributed-optimizer"],
}
TIMERS = ("time/pass/update_s", "time/optimizer_s")
VOCAB, SEQ_LENGTH = 64, 320  # 8 samples of up to 40 tokens per row


def bench_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.training_stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8, help="iterations per run (the first two are not counted)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="markdown report path (the last rank)")
    return parser.parse_args(argv)


def launcher_settings(dump: str, iters: int, variant: str) -> RunSettings:
    return run_settings(parse_args([
        "--rollout-dump", dump, "--vocab-size", str(VOCAB), "--seq-length", str(SEQ_LENGTH),
        "--global-batch-size", str(32 * int(os.environ["WORLD_SIZE"])), "--micro-batch-size", "8",
        "--moe-enable-routing-replay", "--train-iters", str(iters), *VARIANTS[variant]]))


def train_once(dump: str, iters: int, variant: str, device: torch.device) -> list[dict]:
    """One launcher run of ``variant`` from the same seeds, in the parallel state every run shares."""
    settings = launcher_settings(dump, iters, variant)
    torch.manual_seed(settings.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(settings.seed)
    build = rl_run.build_training_stack
    rl_run.build_training_stack = OldLoopStack if variant == "old-loop" else build
    try:
        return rl_run.train(settings, device, log=lambda line: None)
    finally:
        rl_run.build_training_stack = build


def main(argv=None) -> None:
    args = bench_args(argv)
    if "RANK" not in os.environ:  # a plain `python -m bench.training_stack`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    with tempfile.TemporaryDirectory() as folder:
        dump = os.path.join(folder, "rollouts.r3dump")
        write_synthetic_dump(dump, num_samples=256, num_layers=8, moe_layer_freq=1, num_experts=8, topk=2,
                             vocab_size=VOCAB)
        # One parallel state for every run, as in one launcher process.
        device = initialize(launcher_settings(dump, args.iters, "megatron"))
        seconds = {variant: {timer: [] for timer in TIMERS} for variant in VARIANTS}
        for round_ in range(args.rounds):
            for variant in VARIANTS:
                history = train_once(dump, args.iters, variant, device)
                for timer in TIMERS:
                    seconds[variant][timer] += [h[timer] for h in history[2:]]
                if dist.get_rank() == dist.get_world_size() - 1:
                    print(f"round {round_ + 1}/{args.rounds} {variant}: " + ", ".join(
                        f"{timer} {statistics.median(h[timer] for h in history[2:]):.4f}" for timer in TIMERS),
                        flush=True)
    if dist.get_rank() == dist.get_world_size() - 1:
        report = render(args, seconds)
        publish_report(report, args.out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def render(args: argparse.Namespace, seconds: dict) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [f"# Training stack: update pass and optimizer step ({datetime.date.today()})", "",
             f"`{shlex.join(['python', '-m', 'bench.training_stack', *sys.argv[1:]])}` on "
             f"{dist.get_world_size()} x {device}, {args.rounds} rounds of {args.iters} iterations per variant, "
             f"medians (min-max) in ms over iterations 3 onwards:", "",
             "| variant | pass/update | optimizer | update + optimizer |", "| --- | ---: | ---: | ---: |"]

    def cell(values):
        return f"{1e3 * statistics.median(values):.1f} ({1e3 * min(values):.1f}-{1e3 * max(values):.1f})"

    for variant, timers in seconds.items():
        update, step = timers["time/pass/update_s"], timers["time/optimizer_s"]
        total = [u + s for u, s in zip(update, step)]
        lines.append(f"| {variant} | {cell(update)} | {cell(step)} | {cell(total)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
