"""What the checkpoint's finite check costs: the launcher's default model, and a larger synthetic state.

    python -m tools.finite_check_cost

The check (:mod:`megatron_r3.rl.checkpoint.finite`) runs over every tensor a save writes: the
default model's weights, Adam's two moments (stand-ins of their size) and the rollout engine's
bf16 copy; then over 1 GiB of fp32 tensors. For comparison it also times a stacked
``isfinite().all()`` per tensor (one host read too, but a bool temporary of each tensor's size).
Prints one markdown row per state: tensors, elements, bytes, the check's time and throughput,
the stacked isfinite's time. One thread (as a launcher rank on a shared CPU runs).
"""

import time

import torch
from megatron_r3.rl.checkpoint.finite import non_finite_tensors
from tests.support.launcher import run_workers


def default_model():
    """The default launcher run's checkpoint tensors, timed in a worker (Megatron needs a process group)."""
    from megatron.core import parallel_state
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.checkpoint.checkpointing import models_sharded_state_dict
    from megatron_r3.rl.checkpoint.finite import sharded_tensors
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.run import checkpoint_models, setup
    settings = run_settings(parse_args(["--train-iters", "1"]))
    run = setup(settings, initialize(settings), lambda line: None)
    named = list(sharded_tensors(models_sharded_state_dict(checkpoint_models(run))))
    # Adam's state as a save holds it: two fp32 moments per trained tensor.
    named += [(f"optimizer.{m}.{key}", torch.randn_like(t.float())) for key, t in list(named)
              if not key.startswith("rollout") for m in ("exp_avg", "exp_avg_sq")]
    out = timed(named)
    parallel_state.destroy_model_parallel()
    return out


def timed(named, repeats=20):
    """(tensors, elements, bytes, seconds of the check, seconds of a stacked isfinite) over ``named``."""
    non_finite_tensors(named)
    start = time.perf_counter()
    for _ in range(repeats):
        assert non_finite_tensors(named) == []
    check = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        torch.stack([t.isfinite().all() for _, t in named]).tolist()
    stacked = (time.perf_counter() - start) / repeats
    elements = sum(t.numel() for _, t in named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    return len(named), elements, nbytes, check, stacked


def main() -> None:
    torch.set_num_threads(1)
    rows = [("default model (launcher defaults)", *run_workers(default_model, 1, backend="gloo")[0])]
    torch.manual_seed(0)
    big = [(f"t{i}", torch.randn(1024, 1024)) for i in range(256)]  # 256 M fp32 elements, 1 GiB
    rows.append(("synthetic: 256 x [1024, 1024] fp32", *timed(big, repeats=3)))
    for name, n, elements, nbytes, check, stacked in rows:
        print(f"| {name} | {n} | {elements / 1e6:.2f} M | {nbytes / 2**20:.1f} MiB | {check * 1e3:.2f} ms "
              f"| {nbytes / check / 1e9:.2f} GB/s | {stacked * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
