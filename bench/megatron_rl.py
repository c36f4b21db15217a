"""Megatron-LM's train_rl.py with and without routing replay: k3 and step time (GPU).

    MEGATRON=build/megatron-lm python -m bench.megatron_rl --nproc 1 --out build/bench/megatron-rl-np1.md

Runs ``launch/train_rl_r3.sh`` (the offline example: countdown, a small MoE, random-init or from
``--init``, a checkpoint of ``launch/countdown_sft_r3.sh``), each run in a fresh folder under ``--runs``:

* once (``--k3``, the default) with ``--moe-enable-routing-replay --rl-routing-replay-metrics`` for ``--iters``
  iterations: every rollout collection logs the train/inference mismatch of the same rollouts
  with replay and routing live (``routing replay | iteration N | k3_replay ... | k3_live ...``),
  so the two k3 means come from one run, side by side; where it logs Megatron's timers
  (``EXTRA_ARGS=--timing-log-level 1``), its two forward-only passes over the same bins each iteration, with
  replay and routing live, paired by iteration (replay's cost in the trainer's forward within one run);
* then ``--rounds`` pairs of runs alternating replay on and off (without the metrics pass; 0: none; replay first
  in the first round, or live with ``--live-first``, and the other way in the next), with a row per round where
  there are several,
  ``--iters`` iterations each: the step time is Megatron's "elapsed time per iteration" of
  iterations after ``--skip`` (start-up, graph capture), replay's mean over live's; where the runs log
  Megatron's timers (``EXTRA_ARGS=--timing-log-level 1``), each phase's too (forward-backward, the
  RL loop's rollout collection, data preparation, ...), and where they log the engine's steps
  (``--inference-logging-step-interval 1``), the steps per rollout collection (the generation lengths,
  which sampling sets) and the time of a decode step at equal active requests (replay's cost in the engine).
  ``--frozen-policy`` trains those runs at learning rate 0: the replay run and the live run then sample from the
  same policy at every iteration, so their rollouts do not drift apart, and where the engine's steps are logged
  the report counts the iterations whose collections ran the same steps in both (the same generation lengths;
  the engine admits requests as they arrive, so the two runs' draws can still differ). The two main step rows
  give the ratio's 95% interval: whether the iterations resolve a difference of a few percent.
  ``--concurrent`` runs each round's two sides at once, each on ``--nproc`` GPUs of its own (the first
  2 x nproc visible, swapped every round) and its own rollout-server port (``MEGATRON_RL_INFERENCE_SERVER_PORT``,
  the Megatron-LM series' 0004): the host's drift falls on both sides alike, and an hour gives each side twice
  the iterations. With ``--share-gpus`` both runs use the same first ``--nproc`` GPUs: a layout that takes every
  GPU of the node still runs both sides at once, each slowed by the other, though not measurably alike (replay's
  training passes read 1.00 to 1.09 of live over four shared 1-GPU rounds of the same code, 0.996 with GPUs of
  its own: docs/benchmarks.md).

Targets (issue 44): mean k3 with replay <= 1/10 of without; step time with replay within 3% of
without. Writes a Markdown report with the device, the commands (each with its wall time) and
the numbers, and beside it (``OUT`` with ``.jsonl``) the metrics run's collections in the keys of
``tools/plot_metrics.py``. One device call runs at most 10 minutes: ``--no-k3`` and ``--rounds 0``
split the work across calls (docs/megatron_rl.md, "On a GPU node").

``--from-log LOG`` runs nothing: it writes the k3 part of the report and the JSONL from the log of a
metrics run made earlier (one cut short included: every collection it logged counts), on any machine;
``--from-step-logs REPLAY_LOG LIVE_LOG [...]`` the step-time part from a replay run's and a live run's logs, one
pair per round. An interrupt (Ctrl-C, ``timeout -s INT``) ends the runs under way and writes the report with
what they logged by then: a round's iterations where both sides logged some after ``--skip``, the metrics run's
collections.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_r3.dataplane.formats.output_files import OutputFileError, atomic_output, check_output

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launch" / "train_rl_r3.sh"
METRICS_LINE = re.compile(r"routing replay \| iteration (\d+) \| (.*)$")
STEP_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
# One line of Megatron's timer report (megatron/core/timers.py): "    name .....: (min, max)" across ranks, in ms.
TIMER = re.compile(r"^\s+(\S+) \.*: \(([\d.]+), ([\d.]+)\)\s*$")
ROLLOUTS = "rl/rollout-collection"  # the RL loop's timer around a step's generation (megatron/rl/rl_utils.py)
# The metrics run's two forward-only passes over the same bins (megatron/rl/rl_utils.py with the Megatron-LM series):
# the old log-probs, replayed, and the pass routing live that gives k3 without replay; both inside
# rl/compute-logprobs, which also times the reference model's pass.
REPLAY_FORWARD, LIVE_FORWARD = "rl/compute-old-logprobs", "rl/compute-live-logprobs"
# One step of Megatron's dynamic engine (``--inference-logging-step-interval 1``: dynamic_engine.py's console
# line, colored where the step is decode-only): the rank, the step's time in ms, its kind, the active requests.
ENGINE_STEP = re.compile(r"\* rank (\d+) \| step \d+ \| \S+ \.\.\. time: ([\d.]+) ms "
                         r"\[(decode|non-decode)\b.*? reqs: a (\d+)/")


def replay_metrics(log: str) -> list[dict]:
    """Every ``routing replay | iteration N | name value | ...`` line of a train_rl.py log."""
    out = []
    for line in log.splitlines():
        match = METRICS_LINE.search(line)
        if match:
            fields = dict(part.rsplit(" ", 1) for part in match.group(2).split(" | "))
            out.append({"iteration": int(match.group(1)), **{k: float(v) for k, v in fields.items()}})
    return out


# The series' metric -> the key tools/plot_metrics.py reads (the launcher's --metrics-file names).
PLOT_KEYS = {f"{name}_{mode}": f"mismatch/{mode}/{key}" for mode in ("replay", "live")
             for name, key in (("k3", "k3_kl"), ("abs_log_ratio", "logp_abs_diff"),
                               ("outside_2x", "frac_abs_gt_ln2"), ("outside_5x", "frac_abs_gt_ln5"))}
PLOT_KEYS["agreement"] = "routing/agreement"


def plot_rows(rows: list[dict]) -> list[dict]:
    """The metrics lines as tools/plot_metrics.py's records (|d| > ln 2 is the ratio outside [1/2, 2])."""
    return [{"iteration": row["iteration"], **{PLOT_KEYS[k]: v for k, v in row.items() if k in PLOT_KEYS}}
            for row in rows]


def step_times(log: str, skip: int) -> list[float]:
    """Megatron's elapsed time per iteration (ms) of the iterations after ``skip``."""
    return [float(ms) for it, ms in STEP_TIME.findall(log) if int(it) > skip]


def lines_after_iterations(log: str):
    """Each line of a log but the iterations' own, with the last iteration logged before it (0 before any)."""
    iteration = 0
    for line in log.splitlines():
        step = STEP_TIME.search(line)
        if step:
            iteration = int(step.group(1))
        else:
            yield iteration, line


def phase_times_by_iteration(log: str, skip: int) -> dict[str, dict[int, float]]:
    """Megatron's timers (``--timing-log-level 1``: forward-backward, the RL loop's phases) of the iterations
    after ``skip``: the slowest rank's ms per phase and iteration, from the report that follows each iteration's
    line (one report an iteration; were a timer in two, its last value would count)."""
    phases = {}
    for iteration, line in lines_after_iterations(log):
        timer = TIMER.match(line)
        if timer and iteration > skip:
            phases.setdefault(timer.group(1), {})[iteration] = float(timer.group(3))
    return phases


def phase_times(log: str, skip: int) -> dict[str, list[float]]:
    """:func:`phase_times_by_iteration`'s times per phase, in iteration order."""
    return {name: list(times.values()) for name, times in phase_times_by_iteration(log, skip).items()}


def paired_forward_rows(log: str, skip: int) -> tuple[list[str], list[str]]:
    """Where a metrics run logged Megatron's timers: its two forward-only passes over the same packed bins in each
    iteration, the old log-probs with replay (``rl/compute-old-logprobs``, which also gathers the route metrics) and
    the metrics pass routing live (``rl/compute-live-logprobs``), paired by iteration: replay's cost in the
    trainer's forward within one run, whatever the rollouts. The table row and a note."""
    phases = phase_times_by_iteration(log, skip)
    replay, live = phases.get(REPLAY_FORWARD, {}), phases.get(LIVE_FORWARD, {})
    iterations = sorted(set(replay) & set(live))
    if not iterations:
        return [], []
    replay_ms = statistics.fmean(replay[i] for i in iterations)
    live_ms = statistics.fmean(live[i] for i in iterations)
    ratios = [replay[i] / live[i] for i in iterations if live[i] > 0]
    row = (f"| forward-only pass over the same bins, ms (`{REPLAY_FORWARD}` with replay and `{LIVE_FORWARD}` routing "
           f"live, {len(iterations)} iterations) | {replay_ms:.1f} | {live_ms:.1f} | {replay_ms / live_ms:.3f} | |")
    note = (f"Per iteration, the forward-only pass with replay over the same pass routing live (same bins, same "
            f"weights, each first every other collection; the replayed pass also gathers the route metrics, so the "
            f"ratio counts more than replay's cost): median {statistics.median(ratios):.3f}, "
            f"{min(ratios):.3f}-{max(ratios):.3f}, replay slower in {sum(r > 1 for r in ratios)} of {len(ratios)}.")
    return [row], [note]


def engine_steps_by_rank(log: str, skip: int) -> dict[int, list[tuple[int, float, bool, int]]]:
    """The engine steps of the rollout collections of the iterations after ``skip``, per rank that logs them, one
    tuple per step (iteration, ms, decode-only, active requests): a collection runs before its iteration's line,
    so the steps between the lines of iterations N - 1 and N are iteration N's."""
    # a collection whose iteration never ended (a run cut short) has no step time to stand beside
    last = max((int(it) for it, _ in STEP_TIME.findall(log)), default=0)
    steps = {}
    for iteration, line in lines_after_iterations(log):
        engine = ENGINE_STEP.search(line)
        if engine and skip < iteration + 1 <= last:
            steps.setdefault(int(engine.group(1)), []).append(
                (iteration + 1, float(engine.group(2)), engine.group(3) == "decode", int(engine.group(4))))
    return steps


def engine_steps(log: str, skip: int) -> list[tuple[int, float, bool, int]]:
    """:func:`engine_steps_by_rank`'s steps of the lowest rank that logs them."""
    steps = engine_steps_by_rank(log, skip)
    return steps[min(steps)] if steps else []


def slowest_rank_steps(log: str, skip: int) -> dict[int, int]:
    """Per iteration after ``skip``, the most engine steps any rank's collection ran: each rank generates its own
    share of the requests and the step goes on when the last one is done, so the longest sets the wait."""
    most = {}
    for steps in engine_steps_by_rank(log, skip).values():
        counts = {}
        for iteration, *_ in steps:
            counts[iteration] = counts.get(iteration, 0) + 1
        for iteration, count in counts.items():
            most[iteration] = max(most.get(iteration, 0), count)
    return most


# Learning rate 0 (Adam, its weight decay scaled by it, moves no weight): every iteration samples from the same policy.
FROZEN_POLICY_ARGS = "--lr 0.0 --min-lr 0.0"


def collection_steps(log: str, skip: int) -> dict[int, tuple[tuple[bool, int], ...]]:
    """Per iteration after ``skip``, its rollout collection's engine steps as (decode-only, active requests)."""
    steps = {}
    for iteration, _, decode_only, active in engine_steps(log, skip):
        steps.setdefault(iteration, []).append((decode_only, active))
    return {iteration: tuple(kinds) for iteration, kinds in steps.items()}


def same_rollout_notes(logs: dict[bool, list[str]], skip: int) -> list[str]:
    """Where the runs logged the engine's steps: in how many iterations the replay run's and the live run's rollout
    collections (round by round) ran the same engine steps with the same active requests, i.e. generated the same
    lengths. Where all did, the two runs' step times compare the same work but for replay."""
    same = compared = 0
    for replay_log, live_log in zip(logs[True], logs[False]):
        replay, live = collection_steps(replay_log, skip), collection_steps(live_log, skip)
        common = set(replay) & set(live)
        compared += len(common)
        same += sum(replay[i] == live[i] for i in common)
    if not compared:
        return []
    return [f"Rollout collections of the replay and the live runs, iteration by iteration: the same engine steps "
            f"(active requests at each) in {same} of {compared}"
            + (": the two sides generated the same lengths." if same == compared else
               "; where they differ, sampling set part of the step-time difference.")]


def engine_rows(logs: dict[bool, list[str]], skip: int, iterations: dict[bool, int]) -> list[str]:
    """Where the runs logged the engine's steps: the steps per rollout collection (the generation lengths, which
    sampling sets) and the time of a decode step at the same number of active requests on both sides (live's
    mix of them): replay's cost in the engine, whatever the lengths."""
    steps = {replay: [s for log in logs[replay] for s in engine_steps(log, skip)] for replay in (True, False)}
    if not steps[True] or not steps[False]:
        return []
    per_collection = {replay: sum(sum(slowest_rank_steps(log, skip).values()) for log in logs[replay])
                      / iterations[replay] for replay in (True, False)}
    rows = [f"| engine steps per rollout collection (the rank that ran the most) | {per_collection[True]:.1f} | "
            f"{per_collection[False]:.1f} | "
            f"{per_collection[True] / per_collection[False]:.3f} | |"]
    decode = {replay: {} for replay in (True, False)}
    for replay in (True, False):
        for _, ms, decode_only, active in steps[replay]:
            if decode_only:
                decode[replay].setdefault(active, []).append(ms)
    common = sorted(set(decode[True]) & set(decode[False]))
    if common:
        weight = {active: len(decode[False][active]) for active in common}
        replay_ms, live_ms = (sum(weight[a] * statistics.fmean(decode[side][a]) for a in common) / sum(weight.values())
                              for side in (True, False))
        rows.append(f"| engine decode step, ms ({sum(len(decode[True][a]) for a in common)} and "
                    f"{sum(weight.values())} steps at {common[0]}-{common[-1]} active requests, live's mix) | "
                    f"{replay_ms:.2f} | {live_ms:.2f} | {replay_ms / live_ms:.3f} | |")
    return rows


def equal_generation_rows(logs: dict[bool, list[str]], skip: int) -> list[str]:
    """The mean step time of both sides at the same generation work: a least-squares fit of each iteration's
    step time on replay (0 or 1), its rollout collection's engine steps (:func:`slowest_rank_steps`: on several
    ranks the longest generation sets the step) and one constant per round (a round's
    placement and order are its own), read at the mean engine steps of all counted iterations. Sampling sets how
    long a collection runs (a request left generating to the length limit takes hundreds of steps): this row
    compares the two sides at equal draws of it. None where the engine steps were not logged at every counted
    iteration or do not vary."""
    import numpy as np

    rows = []
    for round_index, pair in enumerate(zip(logs[True], logs[False])):
        for replay, log in zip((True, False), pair):
            steps = slowest_rank_steps(log, skip)
            times = {int(it): float(ms) for it, ms in STEP_TIME.findall(log) if int(it) > skip}
            if not times or set(times) - set(steps):
                return []
            rows += [(times[it], steps[it], replay, round_index) for it in sorted(times)]
    ms, engine, replay, round_of = (np.array(column, dtype=float) for column in zip(*rows))
    rounds = [(round_of == k).astype(float) for k in range(int(round_of.max()) + 1)]
    fit = np.column_stack([replay, engine, *rounds])
    if len(ms) <= fit.shape[1] or np.linalg.matrix_rank(fit) < fit.shape[1]:
        return []
    coef, *_ = np.linalg.lstsq(fit, ms, rcond=None)
    residual = ms - fit @ coef
    variance = residual @ residual / (len(ms) - fit.shape[1]) * np.linalg.inv(fit.T @ fit)
    # the fit leaves each side's mean residual 0: live at the pooled mean engine steps
    live = ms[replay == 0].mean() + coef[1] * (engine.mean() - engine[replay == 0].mean())
    difference, error = coef[0], math.sqrt(variance[0, 0])
    blocks = ", rounds as blocks" if len(rounds) > 1 else ""
    return [f"| mean step time at equal generation work, ms ({engine.mean():.1f} engine steps a collection; least "
            f"squares on each collection's engine steps, the slowest rank's{blocks}; ratio's 95% interval) | "
            f"{live + difference:.1f} | "
            f"{live:.1f} | {1 + difference / live:.3f} ({1 + (difference - 1.96 * error) / live:.3f}-"
            f"{1 + (difference + 1.96 * error) / live:.3f}) | <= 1.03 |"]


def ratio_with_interval(replay: list[float], live: list[float]) -> str:
    """Replay's mean over live's and, where each side has two values or more, its 95% interval (the delta
    method on the two means' standard errors, iterations taken as independent): whether a difference of a few
    percent is resolved at all."""
    ratio = statistics.fmean(replay) / statistics.fmean(live)
    if len(replay) < 2 or len(live) < 2:
        return f"{ratio:.3f}"
    relative = math.sqrt(sum(statistics.variance(side) / len(side) / statistics.fmean(side) ** 2
                             for side in (replay, live)))
    return f"{ratio:.3f} ({ratio * (1 - 1.96 * relative):.3f}-{ratio * (1 + 1.96 * relative):.3f})"


def step_rows(logs: dict[bool, list[str]], skip: int) -> list[str]:
    """The step-time row and, where the runs logged Megatron's timers, one row per phase timed at every
    counted iteration of both sides (the slowest eight by live time)."""
    times = {replay: [t for log in logs[replay] for t in step_times(log, skip)] for replay in (True, False)}
    if not times[True] or not times[False]:
        sys.exit(f"bench.megatron_rl: no iteration after --skip {skip} in the "
                 f"{'replay' if not times[True] else 'live'} runs' logs")
    replay_ms, live_ms = statistics.fmean(times[True]), statistics.fmean(times[False])
    replay_median, live_median = statistics.median(times[True]), statistics.median(times[False])
    rows = [f"| mean step time, ms ({len(times[True])} and {len(times[False])} iterations; ratio's 95% interval) | "
            f"{replay_ms:.1f} | {live_ms:.1f} | {ratio_with_interval(times[True], times[False])} | <= 1.03 |",
            f"| median step time, ms | {replay_median:.1f} | {live_median:.1f} | {replay_median / live_median:.3f} | |"]
    phases = {}
    for replay in (True, False):
        for log in logs[replay]:
            for name, values in phase_times(log, skip).items():
                phases.setdefault(name, {True: [], False: []})[replay] += values
    every = {name: sides for name, sides in phases.items()
             if len(sides[True]) == len(times[True]) and len(sides[False]) == len(times[False])}
    if ROLLOUTS in every:  # the step without its generation, whose length sampling sets
        rest = {replay: [step - rollouts for step, rollouts in zip(times[replay], every[ROLLOUTS][replay])]
                for replay in (True, False)}
        rows.append(f"| step time less `{ROLLOUTS}`, ms | {statistics.fmean(rest[True]):.1f} | "
                    f"{statistics.fmean(rest[False]):.1f} | {ratio_with_interval(rest[True], rest[False])} | |")
    for name, sides in sorted(every.items(), key=lambda item: -statistics.fmean(item[1][False]))[:8]:
        replay_phase, live_phase = statistics.fmean(sides[True]), statistics.fmean(sides[False])
        ratio = f"{replay_phase / live_phase:.3f}" if live_phase > 0 else "-"
        rows.append(f"| of which `{name}`, ms | {replay_phase:.1f} | {live_phase:.1f} | {ratio} | |")
    return (rows + engine_rows(logs, skip, {replay: len(times[replay]) for replay in (True, False)})
            + equal_generation_rows(logs, skip))


def iteration_times(log: str) -> list[str]:
    """The timestamps of a log's iteration lines (Megatron's ``[YYYY-MM-DD hh:mm:ss.ffffff]``), in order."""
    return re.findall(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+\d+/", log)


def order_of(replay_log: str, live_log: str) -> str:
    """Which of a round's two runs ran first, or that they ran together (their iterations overlap in time)."""
    replay, live = iteration_times(replay_log), iteration_times(live_log)
    if not replay or not live:
        return ""
    if replay[0] <= live[-1] and live[0] <= replay[-1]:
        return ", ran together"
    return f", {'replay' if replay[0] < live[0] else 'live'} ran first"


def round_rows(logs: dict[bool, list[str]], skip: int) -> list[str]:
    """Over two or more rounds, each round's ratio on its own (the step less its rollout collection where the
    timers give it, else the whole step) and which side ran first: the spread between rounds, and the order's
    effect, which alternating the order across rounds cancels in the pooled rows."""
    if len(logs[True]) < 2:
        return []
    rows = []
    for index, pair in enumerate(zip(logs[True], logs[False]), start=1):
        times = [step_times(log, skip) for log in pair]
        if not all(times):
            return []
        rollouts = [phase_times(log, skip).get(ROLLOUTS, []) for log in pair]
        less_rollouts = all(len(r) == len(t) for r, t in zip(rollouts, times))
        replay_ms, live_ms = (statistics.fmean(t) - (statistics.fmean(r) if less_rollouts else 0.0)
                              for t, r in zip(times, rollouts))
        what = f"step time less `{ROLLOUTS}`" if less_rollouts else "mean step time"
        rows.append(f"| round {index}{order_of(*pair)}: {what}, ms | {replay_ms:.1f} | {live_ms:.1f} | "
                    f"{replay_ms / live_ms:.3f} | |")
    return rows


@dataclasses.dataclass
class StartedRun:
    """A run of the example under way: its command as the report prints it, its process, its output file."""
    command: str
    proc: subprocess.Popen
    output: Path
    start: float


def start_run(out: Path, nproc: int, iters: int, seq_len: int, replay: bool, metrics: bool, tag: str,
              init: Path | None = None, extra_args: str = "", env_extra: dict[str, str] | None = None,
              graphs: bool = False) -> StartedRun:
    """Starts one run of the example (``extra_args`` after the caller's EXTRA_ARGS; ``env_extra``: more of its
    environment, e.g. its GPU and its rollout server's port, named in its command; ``graphs``: GRAPHS=1, the
    engine under its CUDA graphs)."""
    settings = dict(NPROC=nproc, ITERS=iters, SEQ_LEN=seq_len, REPLAY=int(replay), METRICS=int(metrics))
    if graphs:
        settings["GRAPHS"] = 1
    if init is not None:
        settings["INIT"] = init
    settings.update(env_extra or {})
    # The example resumes from its folder's checkpoints: a bench run starts from nothing of an earlier one.
    shutil.rmtree(out / tag, ignore_errors=True)
    env = dict(os.environ, **{k: str(v) for k, v in settings.items()})
    env["EXTRA_ARGS"] = " ".join(filter(None, [env.get("EXTRA_ARGS", ""), extra_args]))
    if env["EXTRA_ARGS"]:  # passed through to the example: the report names it
        settings["EXTRA_ARGS"] = f'"{env["EXTRA_ARGS"]}"'
    command = " ".join(f"{k}={v}" for k, v in settings.items()) + f" {SCRIPT.relative_to(ROOT)} {out / tag}"
    print(f"$ {command}", flush=True)
    (out / tag).mkdir(parents=True, exist_ok=True)
    # a file in the run's folder, not a pipe: two runs at once cannot block on each other's output
    output = out / tag / "bench-output.log"
    with open(output, "w") as sink:
        proc = subprocess.Popen(["bash", str(SCRIPT), str(out / tag)], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, text=True)
    return StartedRun(command, proc, output, time.perf_counter())


def finish_run(started: StartedRun) -> tuple[str, str, float]:
    """Waits for a started run: its command, its log and its wall time; exits where it failed."""
    returncode = started.proc.wait()
    wall = time.perf_counter() - started.start
    log = started.output.read_text()
    if returncode != 0:
        sys.exit(f"bench.megatron_rl: {started.command} failed (exit {returncode}):\n{log[-6000:]}")
    print(f"  {wall:.0f} s", flush=True)
    return started.command, log, wall


class RunsStopped(Exception):
    """An interrupt (Ctrl-C, ``timeout -s INT``) stopped the bench while runs were under way.

    Attributes:
        results: ``finish_run``'s triple of every run of the round started so far, each log as far as it got.
    """

    def __init__(self, results: list[tuple[str, str, float]]):
        super().__init__(f"{len(results)} run(s) stopped")
        self.results = results


def stop_run(started: StartedRun) -> tuple[str, str, float]:
    """Ends a run under way (SIGTERM, and waits for it): its command, its log so far and its wall time."""
    if started.proc.poll() is None:
        started.proc.terminate()
        started.proc.wait()
    return started.command, started.output.read_text(), time.perf_counter() - started.start


def finish_runs(started: list[StartedRun]) -> list[tuple[str, str, float]]:
    """Waits for runs under way; on an interrupt, ends them and raises ``RunsStopped`` with their logs so far."""
    try:
        return [finish_run(run) for run in started]
    except KeyboardInterrupt:
        raise RunsStopped([stop_run(run) for run in started]) from None


def run(out: Path, nproc: int, iters: int, seq_len: int, replay: bool, metrics: bool,
        tag: str, init: Path | None = None, extra_args: str = "", graphs: bool = False) -> tuple[str, str, float]:
    """One run of the example, to its end: its command as the report prints it, its log and its wall time."""
    started = start_run(out, nproc, iters, seq_len, replay, metrics, tag, init, extra_args, graphs=graphs)
    return finish_runs([started])[0]


def run_in_turn(starts: list) -> list[tuple[str, str, float]]:
    """Runs each run (``start_run``'s arguments each) after the one before; an interrupt raises ``RunsStopped``
    with the runs done and the one under way."""
    done = []
    for positional, kwargs in starts:
        try:
            done.append(run(*positional, **kwargs))
        except RunsStopped as stopped:
            raise RunsStopped(done + stopped.results) from None
    return done


def run_together(starts: list) -> list[tuple[str, str, float]]:
    """Starts every run (``start_run``'s arguments each), then waits for all; where one fails, the others are
    stopped before the bench exits; an interrupt raises ``RunsStopped`` with every run's log so far."""
    started = []
    try:
        for positional, kwargs in starts:
            started.append(start_run(*positional, **kwargs))
        return finish_runs(started)
    finally:
        for run in started:
            stop_run(run)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on this node now (each held open until all are chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


TABLE_HEAD = ["| metric | with replay | without | ratio | target |", "| --- | ---: | ---: | ---: | --- |"]


def outputs(out: Path, k3: bool) -> list[Path]:
    """The files a report writes: ``out``, and beside it the collections as JSONL where it has k3."""
    return [out, out.with_suffix(".jsonl")] if k3 else [out]


def check_outputs(out: Path, k3: bool, overwrite: bool, inputs=()) -> None:
    """Refuses, before anything runs, an output that exists (without --overwrite), is an input or has no folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for path in outputs(out, k3):
            check_output(str(path), [str(i) for i in inputs], overwrite)
    except OutputFileError as error:
        sys.exit(f"bench.megatron_rl: {error}")


def write_report(out: Path, report: list[str], overwrite: bool, records: list[dict] | None = None) -> None:
    """Writes the report (and the k3 records as JSONL beside it) under temporary names, renamed when complete."""
    texts = ["\n".join(report)] + ([] if records is None else ["".join(json.dumps(r) + "\n" for r in records)])
    for path, text in zip(outputs(out, records is not None), texts):
        with atomic_output(str(path), overwrite=overwrite) as partial:
            Path(partial).write_text(text)
    print("\n".join(report))


def k3_summary(rows: list[dict], table: list[str], notes: list[str]) -> list[dict]:
    """The k3 row and the routing notes; returns the collections as tools/plot_metrics.py's records."""
    if not rows:
        sys.exit("bench.megatron_rl: the replay run logged no 'routing replay | ...' line")
    k3_replay = statistics.fmean(r["k3_replay"] for r in rows)
    k3_live = statistics.fmean(r["k3_live"] for r in rows)
    table.append(f"| mean k3 over {len(rows)} collections (same rollouts) | {k3_replay:.3e} | {k3_live:.3e} | "
                 f"{k3_replay / k3_live:.3f} | <= 0.1 |")
    ratios = [r["k3_replay"] / r["k3_live"] for r in rows if r["k3_live"] > 0]
    notes.append(f"Per collection, k3 with replay over without: median {statistics.median(ratios):.3f}, "
                 f"lower in {sum(x < 1 for x in ratios)} of {len(ratios)}; tokens outside [1/2, 2] "
                 f"(mean fraction) {statistics.fmean(r['outside_2x_replay'] for r in rows):.2e} with replay, "
                 f"{statistics.fmean(r['outside_2x_live'] for r in rows):.2e} without, in "
                 f"{sum(r['outside_2x_replay'] > 0 for r in rows)} and {sum(r['outside_2x_live'] > 0 for r in rows)} "
                 "collections.")
    notes.append(f"Agreement of the trainer's router with the engine's routes: "
                 f"{statistics.fmean(r['agreement'] for r in rows):.3f} (routes moved one token: "
                 f"{statistics.fmean(r['agreement_moved_one_token'] for r in rows):.3f}); routes the forward "
                 f"did not take: {sum(r['routes_used_differ'] for r in rows):.0f}; routed fraction "
                 f"{min(r['routed_fraction'] for r in rows):.4f} at least.")
    return plot_rows(rows)


def k3_part(log: str, skip: int, table: list[str], notes: list[str]) -> list[dict]:
    """A metrics run's part of the report: the k3 row and notes, and where it logged Megatron's timers its paired
    forward passes; returns the collections as tools/plot_metrics.py's records."""
    records = k3_summary(replay_metrics(log), table, notes)
    rows, forward_notes = paired_forward_rows(log, skip)
    table += rows
    notes += forward_notes
    return records


def from_log(log_path: Path, out: Path, skip: int, overwrite: bool) -> None:
    """The k3 part of the report from a metrics run's log, made earlier."""
    check_outputs(out, True, overwrite, inputs=[log_path])
    log = log_path.read_text(errors="replace")
    table, notes = list(TABLE_HEAD), []
    records = k3_part(log, skip, table, notes)
    times = step_times(log, skip)
    if times:
        notes.append(f"Elapsed time per iteration of this metrics run (replay + the live metrics pass), "
                     f"iterations {skip + 1}+: mean {statistics.fmean(times) / 1e3:.1f} s over {len(times)}.")
    report = [f"## train_rl.py with and without routing replay: k3 from `{log_path.name}`", "",
              f"`python -m bench.megatron_rl --from-log {log_path} --skip {skip} --out {out}`", "", *table, "", *notes, ""]
    write_report(out, report, overwrite, records)


def replay_flag(log: str) -> "bool | None":
    """``moe_enable_routing_replay`` as train_rl.py's argument dump logs it, or None without a dump."""
    match = re.search(r"^\s*moe_enable_routing_replay \.+ (True|False)\s*$", log, re.MULTILINE)
    return None if match is None else match.group(1) == "True"


def from_step_logs(paths: list[Path], out: Path, skip: int, overwrite: bool) -> None:
    """The step-time part of the report from the logs of replay and live runs made earlier: ``paths`` is one
    replay log and one live log per round."""
    for path in paths:
        if not path.is_file():
            sys.exit(f"bench.megatron_rl: --from-step-logs {path}: no such file")
    check_outputs(out, False, overwrite, inputs=paths)
    logs = {True: [path.read_text(errors="replace") for path in paths[0::2]],
            False: [path.read_text(errors="replace") for path in paths[1::2]]}
    for replay, side_paths in ((True, paths[0::2]), (False, paths[1::2])):
        for path, log in zip(side_paths, logs[replay]):
            if replay_flag(log) is (not replay):
                sys.exit(f"bench.megatron_rl: --from-step-logs {path} is a {'live' if replay else 'replay'} run's log "
                         f"(its arguments say moe_enable_routing_replay {not replay}) in a "
                         f"{'replay' if replay else 'live'} place: give each round's replay log, then its live log")
    table = [*TABLE_HEAD, *step_rows(logs, skip), *round_rows(logs, skip)]
    names = " ".join(str(path) for path in paths)
    report = [f"## train_rl.py step time with and without routing replay, from {len(paths) // 2} pair(s) of logs", "",
              f"`python -m bench.megatron_rl --from-step-logs {names} --skip {skip} --out {out}`",
              "", *table, "", *same_rollout_notes(logs, skip), ""]
    write_report(out, report, overwrite)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (data-parallel ranks)")
    parser.add_argument("--iters", type=int, default=50, help="iterations per run (>= 50 for the targets)")
    parser.add_argument("--seq-length", type=int, default=512,
                        help="rollout context, prompt included (SEQ_LEN of the example); the random-init model "
                             "generates to its end, so it sets the generation length and the time per iteration")
    parser.add_argument("--k3", action=argparse.BooleanOptionalAction, default=True,
                        help="the run with --rl-routing-replay-metrics (k3 with and without replay)")
    parser.add_argument("--rounds", type=int, help="replay/live pairs of step-time runs (default 2; 0: none)")
    parser.add_argument("--skip", type=int, default=5, help="iterations left out of the step time")
    parser.add_argument("--live-first", action="store_true",
                        help="the first round runs live, then replay (later rounds alternate; with --concurrent, "
                             "starts live first): a round to pool, through --from-step-logs, with one run replay-first "
                             "in another call")
    parser.add_argument("--concurrent", action="store_true",
                        help="each round's replay run and live run at once, --nproc GPUs each (the first 2 x nproc "
                             "visible; which side has which swaps every round), each serving its rollouts on a port "
                             "of its own: both sides under the same host conditions, twice the iterations an hour")
    parser.add_argument("--share-gpus", action="store_true",
                        help="with --concurrent: both runs on the same first --nproc GPUs (a layout that takes "
                             "every GPU of the node), each slowed by the other; a GPU set per side measures better")
    parser.add_argument("--frozen-policy", action="store_true",
                        help=f"the step-time runs train at learning rate 0 ({FROZEN_POLICY_ARGS} after EXTRA_ARGS): "
                             "replay and live sample from the same policy throughout")
    parser.add_argument("--graphs", action="store_true",
                        help="every run with the engine under its CUDA graphs (GRAPHS=1 of the example)")
    parser.add_argument("--init", type=Path, help="a checkpoint to start every run from (INIT of the example)")
    parser.add_argument("--runs", type=Path, default=ROOT / "build" / "bench" / "megatron-rl-runs")
    parser.add_argument("--out", type=Path, required=True, help="the Markdown report (and OUT with .jsonl)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report (refused otherwise)")
    parser.add_argument("--from-log", type=Path, metavar="LOG",
                        help="run nothing: the k3 report from the log of an earlier metrics run")
    parser.add_argument("--from-step-logs", type=Path, nargs="+", metavar="REPLAY_LOG LIVE_LOG",
                        help="run nothing: the step-time report from the logs of earlier runs, a replay log and a "
                             "live log per round")
    args = parser.parse_args(argv)
    for flag, given in (("--frozen-policy", args.frozen_policy), ("--live-first", args.live_first),
                        ("--concurrent", args.concurrent), ("--graphs", args.graphs)):
        if given and (args.from_step_logs is not None or args.from_log is not None):
            parser.error(f"{flag} sets how the runs go: --from-log and --from-step-logs run nothing")
    if args.from_step_logs is not None:
        if args.from_log is not None or args.rounds:
            parser.error("--from-step-logs runs nothing: give it alone, without --from-log or --rounds")
        if len(args.from_step_logs) % 2:
            parser.error("--from-step-logs takes pairs: a replay run's log, then a live run's, per round")
        return from_step_logs(args.from_step_logs, args.out, args.skip, args.overwrite)
    if args.from_log is not None:
        if args.rounds:
            parser.error("--from-log runs nothing: --rounds needs runs")
        if not args.from_log.is_file():
            parser.error(f"--from-log {args.from_log}: no such file")
        return from_log(args.from_log, args.out, args.skip, args.overwrite)
    args.rounds = 2 if args.rounds is None else args.rounds
    if args.frozen_policy and not args.rounds:
        parser.error("--frozen-policy sets how the step-time runs train: --rounds 0 runs none")
    if args.concurrent and not args.rounds:
        parser.error("--concurrent runs each round's two sides at once: it takes --rounds 1 or more")
    if args.share_gpus and not args.concurrent:
        parser.error("--share-gpus places the two runs of --concurrent: give it with --concurrent")
    if "MEGATRON" not in os.environ:
        sys.exit("bench.megatron_rl: set MEGATRON to a Megatron-LM main checkout with both series")
    import torch

    gpus = (os.environ["CUDA_VISIBLE_DEVICES"].split(",") if os.environ.get("CUDA_VISIBLE_DEVICES")
            else [str(index) for index in range(torch.cuda.device_count())])
    apart = args.concurrent and not args.share_gpus
    needed = args.nproc * (2 if apart else 1)
    if torch.cuda.device_count() < needed:
        what = f"--concurrent{f' --nproc {args.nproc}' if args.nproc > 1 else ''}" if apart else f"--nproc {args.nproc}"
        sys.exit(f"bench.megatron_rl: {what} needs {needed} GPUs; {torch.cuda.device_count()} visible"
                 + (f" (--share-gpus runs both sides on the same {args.nproc})" if apart else ""))
    check_outputs(args.out, args.k3, args.overwrite)  # before runs of many minutes, not after
    device = torch.cuda.get_device_name()
    flags = f"--nproc {args.nproc} --iters {args.iters} --seq-length {args.seq_length} --{'' if args.k3 else 'no-'}k3 --rounds {args.rounds}"
    if args.graphs:
        flags += " --graphs"
    if args.init is not None:
        flags += f" --init {args.init}"
    if args.frozen_policy:
        flags += " --frozen-policy"
    if args.live_first:
        flags += " --live-first"
    if args.concurrent:
        flags += " --concurrent"
    if args.share_gpus:
        flags += " --share-gpus"
    report = [f"## train_rl.py with and without routing replay ({args.nproc} x {device})", "",
              f"`MEGATRON=<checkout> python -m bench.megatron_rl {flags} --skip {args.skip} --out {args.out}`; "
              "runs, in order:", ""]
    table, notes, records = list(TABLE_HEAD), [], None
    if args.k3:
        stopped = None
        try:
            command, log, wall = run(args.runs, args.nproc, args.iters, args.seq_length, replay=True, metrics=True,
                                     tag="metrics", init=args.init, graphs=args.graphs)
        except RunsStopped as interrupt:
            ((command, log, wall),), stopped = interrupt.results, interrupt
        report.append(f"    {command}    # {wall:.0f} s{', stopped by an interrupt' if stopped else ''}")
        records = k3_part(log, args.skip, table, notes)
        if stopped:  # its collections logged by then
            write_report(args.out, report + ["", *table, "", *notes, ""], args.overwrite, records)
            sys.exit(f"bench.megatron_rl: stopped by an interrupt in the metrics run; the report {args.out} holds "
                     "its collections logged by then")
    logs = {True: [], False: []}
    for round_index in range(args.rounds):
        # replay first in odd rounds, live first in even ones: over an even number of rounds the order's effect
        # (a warmer host, a fuller page cache) falls on both sides alike; together, each side has each GPU
        # in turn, and the side started first (allocating first on a shared GPU) alternates too
        sides = (True, False) if (round_index + args.live_first) % 2 == 0 else (False, True)
        starts = [((args.runs, args.nproc, args.iters, args.seq_length, replay, False),
                   dict(tag=f"time-{'replay' if replay else 'live'}-{round_index}", init=args.init, graphs=args.graphs,
                        extra_args=FROZEN_POLICY_ARGS if args.frozen_policy else "")) for replay in sides]
        if args.concurrent:
            n = args.nproc
            places = [gpus[:n], gpus[:n]] if args.share_gpus else [gpus[:n], gpus[n:2 * n]]
            for (_, kwargs), place, port in zip(starts, places, free_ports(2)):
                kwargs["env_extra"] = {"CUDA_VISIBLE_DEVICES": ",".join(place),
                                       "MEGATRON_RL_INFERENCE_SERVER_PORT": str(port)}
        stopped = None
        try:
            results = run_together(starts) if args.concurrent else run_in_turn(starts)
        except RunsStopped as interrupt:
            results, stopped = interrupt.results, interrupt
        # a stopped round counts where both sides logged iterations to count
        counted = not stopped or (len(results) == 2 and all(step_times(log, args.skip) for _, log, _ in results))
        for replay, (command, log, wall) in zip(sides, results):
            status = ", stopped by an interrupt" if stopped else ""
            report.append(f"    {command}    # {wall:.0f} s{', together' if args.concurrent else ''}{status}")
            if counted:
                logs[replay].append(log)
        if stopped:
            notes.append(f"Round {round_index + 1} was stopped by an interrupt: "
                         + ("its iterations logged by then count." if counted else
                            f"it is left out (a side logged no iteration after --skip {args.skip})."))
        # the report of the rounds so far after each one: a call stopped later keeps them
        step_part = [*step_rows(logs, args.skip), *round_rows(logs, args.skip)] if logs[True] else []
        if step_part or records is not None:  # a stopped first round leaves the metrics run's part to report
            write_report(args.out, report + ["", *table, *step_part, "", *notes, *same_rollout_notes(logs, args.skip),
                                             ""], args.overwrite or round_index > 0, records)
        if stopped:
            sys.exit(f"bench.megatron_rl: stopped by an interrupt in round {round_index + 1}; "
                     + (f"the report {args.out} holds {'the iterations' if step_part else 'the metrics run'} "
                        "logged by then" if step_part or records is not None else "no round to report"))
    if not args.rounds:
        write_report(args.out, report + ["", *table, "", *notes, ""], args.overwrite, records)


if __name__ == "__main__":
    main()
