"""Generation tokens/s of the loop's rollout engines: the built-in one against Megatron's.

    python -m bench.generation --out build/bench/generation.md     # 1 GPU, the launcher's default shape
    python -m bench.generation --small                             # a smoke check of this script (CPU too)
    python -m bench.generation --prompt-tokens 256 --new-tokens 1024 --requests 64   # a rollout-sized shape

Builds the launcher's policy and its rollout engine the way a run does
(:func:`megatron_r3.rl.rollout.engine_choice.build_rollout_engine`, ``--rollout-engine local`` and
``megatron``, each with its CUDA graphs where they apply: the report says which replayed them),
then, per engine, times ``generate`` on one iteration's prompts of the built-in task
(``--global-batch-size`` samples: the prompts, each ``--rollouts-per-prompt`` times) for
``--rounds`` rounds after ``--warmup`` ones (CUDA graph captures and lazy initialisation
happen there), the engines taking turns. It reports, per engine, the generated
tokens per second (completion tokens, the stop token included, over the wall time of
``generate``, which for both engines includes recording routes and log-probs), median and
range over the rounds, and the ratio to the built-in engine. An engine that cannot run here
is reported with the reason (:func:`megatron_r3.rl.rollout.megatron_engine.megatron_engine_problem`).

``--profile-host N`` adds, per engine, the N functions the host spends most time in during one more
``generate`` (cProfile), and who called the first five: where a host-bound engine's time goes.
``--profile-device N`` adds, per engine, one more ``generate`` under torch's profiler: the wall time, the sum
of its kernels' own device times, and its N largest kernels (on a CPU, operators by CPU time): whether the
device or the host sets the engine's rate.

``--prompt-tokens P --new-tokens N --requests R`` time a rollout-sized shape instead of the task's:
``R`` prompts of ``P`` random task symbols, each completed with exactly ``N`` tokens (no stop token:
Megatron's ``termination_id=-1``, its ``ignore_eos``), in one row of ``R * (P + N)`` tokens for the
built-in engine. Launcher flags after ``--`` replace the shape (e.g. ``-- --num-layers 16 --hidden-size 1024``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from bench import CALLERS, host_profile, kernel_table, kernel_times, publish_report
from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.device.plan import RankLayout
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.rl.arguments import parse_args, run_settings
from megatron_r3.rl.initialize import initialize
from megatron_r3.rl.rollout.megatron_engine import MegatronRolloutEngine, megatron_engine_problem
from megatron_r3.rl.model.factory import build_model, transformer_config
from megatron_r3.rl.rollout.engine_choice import ROLLOUT_ENGINES, build_rollout_engine
from megatron_r3.rl.rollout.tasks import EOS

NO_STOP_TOKEN = -1  # no sampled id equals it (Megatron's ignore_eos is termination_id=-1)
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32",
         "--num-experts", "4", "--global-batch-size", "8", "--rollouts-per-prompt", "2", "--task-max-symbols", "4"]


def bench_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m bench.generation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed generate calls per engine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed generate calls per engine first")
    parser.add_argument("--small", action="store_true", help="a small model and batch: a smoke check on a CPU")
    parser.add_argument("--out", default=None, help="markdown report path")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompts of this many random task symbols instead of the task's (with --new-tokens)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens each request generates, no early stop")
    parser.add_argument("--requests", type=int, default=64, help="requests with --prompt-tokens (default 64)")
    parser.add_argument("--profile-host", type=int, default=0, metavar="N",
                        help="after the timed rounds, one more generate per engine under cProfile: the report "
                             "lists the N functions the host spends most time in (their own time) and who called "
                             "the first five")
    parser.add_argument("--profile-device", type=int, default=0, metavar="N",
                        help="after the timed rounds, one more generate per engine under torch's profiler: the "
                             "report gives its wall and summed kernel time and its N largest kernels")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    if (args.prompt_tokens is None) != (args.new_tokens is None):
        parser.error("--prompt-tokens and --new-tokens go together")
    for flag, count in (("--profile-host", args.profile_host), ("--profile-device", args.profile_device)):
        if count < 0:
            parser.error(f"{flag} {count}: a count, 0 or more")
    return args, argv[split + 1:]


def rollout_shape_flags(args: argparse.Namespace) -> list[str]:
    """Launcher flags for ``--requests`` prompts of ``--prompt-tokens`` completed with ``--new-tokens`` each."""
    if args.prompt_tokens is None:
        return []
    row = args.requests * (args.prompt_tokens + args.new_tokens)
    return ["--global-batch-size", str(args.requests), "--micro-batch-size", str(args.requests),
            "--rollouts-per-prompt", "1", "--max-new-tokens", str(args.new_tokens), "--seq-length", str(row)]


def main(argv=None) -> None:
    args, launcher_flags = bench_args(argv)
    if "RANK" not in os.environ:  # one rank, as a plain `python -m bench.generation`
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29535")
    # Without --rollout-engine: where Megatron's engine runs, initialize seeds the graph-safe RNG tracker
    # its CUDA graphs need, as a launcher run that picks it does.
    run_args = parse_args([*(SMALL if args.small else []), *rollout_shape_flags(args), *launcher_flags])
    settings = run_settings(run_args)
    if args.prompt_tokens is not None:  # exactly --new-tokens each: no token stops a request
        sampling = dataclasses.replace(settings.rollouts.engine.sampling, stop_token=NO_STOP_TOKEN)
        settings = dataclasses.replace(settings, rollouts=dataclasses.replace(
            settings.rollouts, engine=dataclasses.replace(settings.rollouts.engine, sampling=sampling)))
    device = initialize(settings)
    model = settings.model
    config = transformer_config(model, device)
    policy = build_model(model, config, device)
    spec = RoutingSpec.from_config(config)
    rows = RowLayout(RankLayout.of_this_rank(config.sequence_parallel), config, run_args.seq_length,
                     run_args.micro_batch_size, device)
    samples = run_args.global_batch_size
    group = run_args.rollouts_per_prompt
    if args.prompt_tokens is None:
        prompts = [p.token_ids for p in settings.rollouts.task.prompts(run_args.seed, 1, range(samples // group))
                   for _ in range(group)]
    else:
        first, end = EOS + 1, settings.rollouts.task.vocab_size  # the task's symbols
        generator = np.random.default_rng(run_args.seed)
        prompts = [generator.integers(first, end, args.prompt_tokens) for _ in range(samples)]

    engines, skipped = {}, {}
    for name in ROLLOUT_ENGINES:
        problem = megatron_engine_problem(model, device) if name == "megatron" else None
        if problem is not None:
            skipped[name] = problem
            continue
        engine = dataclasses.replace(settings.rollouts.engine, requested=name)
        longest = (args.prompt_tokens + args.new_tokens if args.prompt_tokens is not None
                   else settings.rollouts.task.max_prompt_tokens + run_args.max_new_tokens)
        engines[name] = build_rollout_engine(engine, model, device, policy, spec, rows, samples, longest)
    graphed = {name: engine_replays_graphs(engine) for name, engine in engines.items()}
    rates = {name: [] for name in engines}
    for round_ in range(args.warmup + args.rounds):
        for name, engine in engines.items():
            tokens, seconds = generate_once(engine, prompts, iteration=round_ + 1, device=device)
            if round_ >= args.warmup:
                rates[name].append(tokens / seconds)
    report = render(args, launcher_flags, run_args, device, rates, graphed, skipped, len(prompts))
    iteration = args.warmup + args.rounds + 1
    for name, engine in engines.items() if args.profile_host else ():
        engine.weights.advance()  # outside the profile, as outside the timed rounds
        own, callers = host_profile(lambda: engine.generate(prompts, iteration), args.profile_host)
        report += (f"\nHost profile of one `{name}` generate (cProfile, by own time):\n\n```\n{own.strip()}\n```\n"
                   f"\nWho called its first {min(args.profile_host, CALLERS)}:\n\n```\n{callers.strip()}\n```\n")
    for name, engine in engines.items() if args.profile_device else ():
        engine.weights.advance()
        report += "\n" + device_profile(name, lambda: engine.generate(prompts, iteration), args.profile_device,
                                        device.type == "cuda")
    publish_report(report, args.out)
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device_profile(name: str, generate, top: int, on_gpu: bool) -> str:
    """One more ``generate`` under torch's profiler, as report lines: its wall time against the sum of its kernels'
    own times (a sum well below the wall time: the host sets the rate), then its ``top`` kernels."""
    start = time.perf_counter()
    kernels = kernel_times(generate, on_gpu)
    wall_ms = 1e3 * (time.perf_counter() - start)
    own = "kernels' device" if on_gpu else "operators' CPU"
    summary = (f"One more `{name}` generate under torch's profiler: {wall_ms:.2f} ms wall (the profiler's own "
               f"host cost included), {sum(ms for _, _, ms in kernels):.2f} ms summed over its {own} times.")
    return "\n".join([summary, "", *kernel_table(f"one `{name}` generate", kernels, top, on_gpu)])


def engine_replays_graphs(engine) -> bool:
    """Whether ``engine``'s steps replay CUDA graphs (the built-in engine's ForwardGraphs where they apply, or
    Megatron's graph managers)."""
    if isinstance(engine, MegatronRolloutEngine):
        return engine.chunks[0].config.cuda_graph_impl == "local"
    return engine.graphs is not None and engine.graphs.enabled


def generate_once(engine, prompts, iteration: int, device: torch.device) -> tuple[int, float]:
    """(completion tokens, wall seconds) of one ``generate`` on the policy's current weights."""
    engine.weights.advance()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    samples = engine.generate(prompts, iteration)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return sum(int(s.loss_mask.sum()) for s in samples), seconds


def render(args, launcher_flags, run_args, device, rates, graphed, skipped, num_prompts) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    shape = (f" (prompts of {args.prompt_tokens} random symbols, exactly {args.new_tokens} new tokens each)"
             if args.prompt_tokens is not None else "")
    command = ["python", "-m", "bench.generation", *sys.argv[1:]]
    lines = [f"# Rollout generation, tokens/s ({datetime.date.today()})", "",
             f"`{shlex.join(command)}` on 1 x {name}, torch {torch.__version__}: {num_prompts} samples of the "
             f"{run_args.task!r} task{shape}, up to {run_args.max_new_tokens} new tokens, {run_args.num_layers} layers, "
             f"hidden {run_args.hidden_size}, {run_args.num_experts} experts top-{run_args.moe_router_topk}, "
             f"--transformer-impl {run_args.transformer_impl or 'default'}; {args.rounds} timed rounds after "
             f"{args.warmup} warm-up ones.", "",
             "| engine | CUDA graphs | tokens/s, median (min-max) | vs local |", "| --- | --- | ---: | ---: |"]
    local = statistics.median(rates["local"]) if rates.get("local") else None
    for engine, values in rates.items():
        median = statistics.median(values)
        ratio = f"{median / local:.2f}x" if local else "-"
        graphs = "yes" if graphed[engine] else "no"
        lines.append(f"| {engine} | {graphs} | {median:.0f} ({min(values):.0f}-{max(values):.0f}) | {ratio} |")
    for engine, problem in skipped.items():
        lines.append(f"| {engine} | - | not run: {problem} | - |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
