#!/usr/bin/env python3
"""Split the single patch series into the upstream series and the CPU series.

Run once, from the checkout whose patches/ holds one series (no patches/cpu/):

    tools/split_series.py build/megatron_core-0.19.2.tar.gz /tmp/ws-split

It makes WORKDIR a workspace of the series (tools/patch_series.py workspace),
then rebuilds its history from 'base': the upstream commits first, in their
order, then the CPU commits (CPU_SUBJECTS), in theirs. Every commit gets the
project's one author (its author date kept), the trailers naming the upstream
issues or PRs it answers (LINKS), and, in the CPU series, 'Series: cpu'. The
rebuilt history must end in the same tree as the series did, so the installed
Megatron does not change; then patches/ and patches/cpu/ are exported.

Where a commit does not apply in its new place, the script stops in WORKDIR
with the conflict: resolve it there (`git add` the files), then run the same
command with --continue. In an upstream commit, a conflict means its context
holds a CPU patch's lines: keep the commit's change without them. In a CPU
commit, make the file what the single series made it, unless a later CPU
commit changes it too (the final tree check refuses a wrong resolution).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import patch_series
from patch_series import AUTHOR_EMAIL, AUTHOR_NAME, CPU_SERIES, SERIES_TRAILER, SeriesError

# The patches only running Megatron on CPUs and gloo process groups needs, by subject.
CPU_SUBJECTS = (
    "moe: the alltoall dispatcher builds without CUDA",
    "moe_utils: maybe_move_tensor_to_cpu returns numpy for CPU tensors too",
    "utils: add get_current_device and use it for the global memory buffer",
    "moe router: keep the gate and its buffers on the input's device",
    "transformer: build default causal and sliding-window masks on the input's device",
    "tensor_parallel: allocate collective outputs on the input's device",
    "tensor_parallel: allocate the sequence-parallel input gradient on its device",
    "rope: pick the context-parallel chunks of the rotary embedding on its device",
    "tensor_parallel: a CPU RNG tracker for processes without CUDA",
    "tensor_parallel: all-gather uneven splits through padding on gloo",
    "pipeline_parallel: schedule token counters and p2p buffers on get_current_device",
    "rope: keep inv_freq on the CPU when there is no CUDA",
    "dist_checkpointing: the torch_dist save runs without CUDA",
    "moe: import the paged-stash Triton kernels where they are used",
    "distributed: DDP's param and grad buffers on get_current_device",
    "optimizer: run on CPU parameters",
    "optimizer: gather the distributed optimizer's state without CUDA",
    "utils: the local multi-tensor l2 norm and scale run as multi-tensor kernels",
    "jit: torch.compile fused functions on first call, not at import",
)

TRAINING_REPLAY = "https://github.com/NVIDIA/Megatron-LM/issues/4168"
ALLTOALL_HOST_SYNC = "https://github.com/NVIDIA/Megatron-LM/issues/6152"
# The upstream issues and PRs an upstream patch answers, by subject: 'Link:' trailers.
LINKS = {
    "gpt: every pipeline stage scatters the MoE padding mask under sequence parallelism": (
        "https://github.com/NVIDIA/Megatron-LM/pull/5088",
        "https://github.com/NVIDIA/Megatron-LM/pull/5563",
    ),
    "moe: per-microbatch routes (MoERouting) replayed through the RouterReplay hook": (
        TRAINING_REPLAY,
    ),
    "transformer, gpt: hand MoERouting from the decoder and MTP blocks to the MoE layers": (
        TRAINING_REPLAY,
    ),
    "moe: replay under moe_router_fusion; refuse routers without a replay hook": (TRAINING_REPLAY,),
    "moe: MoERouting records the routes taken (R2)": (TRAINING_REPLAY,),
    "moe: MoERouting keeps the live top-k on request, for routing agreement": (TRAINING_REPLAY,),
    "moe: optional device-side value check of MoERouting expert ids": (TRAINING_REPLAY,),
    "moe: the alltoall dispatcher takes split sizes from host token counts under replay": (
        TRAINING_REPLAY,
        ALLTOALL_HOST_SYNC,
    ),
    "pipeline_parallel: schedules call config.microbatch_prefetch_func after each forward": (
        TRAINING_REPLAY,
    ),
    "moe: the alltoall dispatcher leaves token counts on the device for experts that take them": (
        ALLTOALL_HOST_SYNC,
    ),
    "hybrid: hand MoERouting from HybridModel to the MoE layers of its stack": (TRAINING_REPLAY,),
}

PLAN = "split-plan.json"  # in WORKDIR/.git: what is left to do, for --continue


def git(repo, *args, stdin=None, check=True):
    ident = ["-c", f"user.name={AUTHOR_NAME}", "-c", f"user.email={AUTHOR_EMAIL}"]
    proc = subprocess.run(["git", *ident, *args], cwd=repo, input=stdin, capture_output=True,
                          text=True)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} failed in {repo}:\n{proc.stdout}{proc.stderr}")
    return proc


def plan_split(repo):
    """The commits base..HEAD in their new order, each with its series and new message."""
    commits = git(repo, "rev-list", "--reverse", "base..HEAD").stdout.split()
    subjects = [git(repo, "log", "-1", "--format=%s", c).stdout.strip() for c in commits]
    unknown = [s for s in (*CPU_SUBJECTS, *LINKS) if subjects.count(s) != 1]
    if unknown:
        raise SeriesError(
            "split_series.py names subjects the series does not have exactly once (a patch "
            f"was renamed, dropped or added twice): {unknown}; update CPU_SUBJECTS or LINKS"
        )
    steps = []
    for commit, subject in zip(commits, subjects):
        cpu = subject in CPU_SUBJECTS
        trailers = [f"Link: {link}" for link in LINKS.get(subject, ())]
        if cpu:
            trailers.append(f"{SERIES_TRAILER}: {CPU_SERIES}")
        message = git(repo, "log", "-1", "--format=%B", commit).stdout.rstrip()
        if trailers:
            message += "\n\n" + "\n".join(trailers)
        date = git(repo, "log", "-1", "--format=%aD", commit).stdout.strip()
        steps.append({"commit": commit, "subject": subject, "cpu": cpu,
                      "message": message + "\n", "date": date})
    return {
        "original": git(repo, "rev-parse", "HEAD").stdout.strip(),
        "steps": [s for s in steps if not s["cpu"]] + [s for s in steps if s["cpu"]],
    }


def commit_step(repo, step):
    """Commit what the index holds as `step`: its new message, the project's author."""
    git(repo, "commit", "-q", "--no-verify", "-F", "-", f"--date={step['date']}",
        f"--author={AUTHOR_NAME} <{AUTHOR_EMAIL}>", stdin=step["message"])


def save(repo, plan):
    (Path(repo) / ".git" / PLAN).write_text(json.dumps(plan, indent=1))


def run_steps(repo, plan):
    """Pick the remaining steps in order; stop at a conflict, leaving the plan for --continue."""
    while plan["steps"]:
        step = plan["steps"][0]
        picked = git(repo, "cherry-pick", "--no-commit", step["commit"], check=False)
        if picked.returncode != 0:
            save(repo, plan)
            conflicted = git(repo, "diff", "--name-only", "--diff-filter=U").stdout.split()
            series = "CPU" if step["cpu"] else "upstream"
            raise SeriesError(
                f"'{step['subject']}' ({series} series) does not apply in its new place; "
                f"conflicts in {conflicted}. Resolve them in {repo} (git add), then run "
                "this command again with --continue"
            )
        commit_step(repo, step)
        plan["steps"].pop(0)
    save(repo, plan)


def continue_step(repo, plan):
    """Commit the step a conflict stopped at, once it is resolved."""
    if git(repo, "diff", "--name-only", "--diff-filter=U").stdout.strip():
        raise SeriesError(f"{repo} still has unresolved conflicts (git status)")
    commit_step(repo, plan["steps"].pop(0))
    git(repo, "cherry-pick", "--quit", check=False)


def finish(repo, plan):
    """Check the split changes nothing the series installs, then export both series."""
    changed = git(repo, "diff", "--stat", plan["original"], "HEAD").stdout
    if changed:
        raise SeriesError(
            "the split series does not end in the tree the single series did (a conflict "
            f"was resolved differently for the CPU series):\n{changed}"
        )
    patch_series.export_series(repo, "base")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sdist", help="the pristine megatron-core sdist")
    parser.add_argument("workdir", help="the workspace to build (replaced unless --continue)")
    parser.add_argument("--continue", dest="resume", action="store_true",
                        help="go on after resolving a conflict in WORKDIR")
    args = parser.parse_args(argv)
    repo = Path(args.workdir).resolve()
    try:
        if args.resume:
            plan_file = repo / ".git" / PLAN
            if not plan_file.is_file():
                raise SeriesError(f"{repo} has no split under way ({PLAN} not found)")
            plan = json.loads(plan_file.read_text())
            continue_step(repo, plan)
        else:
            if patch_series.cpu_files():
                raise SeriesError("patches/ already holds two series (patches/cpu/series)")
            patch_series.make_workspace(args.sdist, repo)
            plan = plan_split(repo)
            git(repo, "checkout", "-q", "-b", "split", "base")
        run_steps(repo, plan)
        finish(repo, plan)
    except SeriesError as err:
        print(f"split_series: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
