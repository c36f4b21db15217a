"""megatron_r3.rl.trainer.training_stack: the RL loop on Megatron's DDP, optimizer, finalize_model_grads and LR
schedule.

The embedded default run (the launcher with no flags but replay), 10 iterations under DP2 and
EP2, on Megatron's stack (plain, and with the distributed optimizer and overlapped, bucketed
gradient reduction) gives the same numbers as the loop before it: a plain ``torch.optim.AdamW``
over the chunks, gradients all-reduced parameter by parameter over the data-parallel group
(expert parameters over the expert data-parallel group) and scaled by the iteration's token
count. Both are Adam (without TransformerEngine or Apex Megatron's Adam is ``torch.optim.AdamW``)
with the same hyper-parameters (no weight decay, the default: Megatron exempts biases and norms
from it), on the same float32 gradients: the sum of two ranks' gradients is exact in either
order, so the tolerance is zero: every metric of every iteration is equal. Anything else would
show at once: the engine samples from the policy's weights, so a last-bit difference in a weight
flips a sampled token within a few iterations and the runs part.

Two choices make "the same" exact: the reference scales the gradients by the float32 reciprocal
of the token count, as ``finalize_model_grads`` does (the old loop divided, which differs in the
last bit), and neither run clips (``--clip-grad 0``): Megatron's global norm sums in another
order than any reference would, and clipping multiplies every gradient by it.
"""

import math

import pytest
from megatron.core import parallel_state

from tests.support.launcher import run_workers
from tests.support.reference_stack import OldLoopStack
from tests.test_launch import DUMP_FLAGS, write_dump
from tests.test_launch import LAYOUTS as DUMP_LAYOUTS

UNCOMPARED = ("tokens_per_s", "elapsed_s", "eta_s", "grad_norm")  # timing; the reference computes no norm


def compared(key):
    return key not in UNCOMPARED and not key.startswith("time/")
LAYOUTS = {"dp2": [], "ep2": ["--expert-model-parallel-size", "2"]}
STACKS = {
    "megatron": [],
    # Several buckets per chunk, reduce-scattered while the backward runs; Adam on shards.
    "megatron-distopt-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"],
}


def loops_worker(argv, stacks):
    """The launcher's loop once per entry of ``stacks`` (``"reference"``: on the old loop's stack), in this process."""
    from megatron_r3.rl import run as rl_run
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize

    build = rl_run.build_training_stack
    histories = {}
    for name, flags in stacks.items():
        rl_run.build_training_stack = OldLoopStack if name == "reference" else build
        settings = run_settings(parse_args(argv + flags))
        device = initialize(settings)
        try:
            histories[name] = rl_run.train(settings, device, log=lambda line: None)
        finally:
            parallel_state.destroy_model_parallel()
            rl_run.build_training_stack = build
    return histories


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_loop_on_megatrons_stack_matches_the_loop_before_it(layout):
    argv = ["--moe-enable-routing-replay", "--train-iters", "10", "--clip-grad", "0", *LAYOUTS[layout]]
    histories = run_workers(loops_worker, 2, argv, {"reference": [], **STACKS}, backend="gloo", timeout=600)[-1]
    reference = histories.pop("reference")
    assert [h["iteration"] for h in reference] == list(range(1, 11))
    assert len({h["reward/mean"] for h in reference}) > 1  # the samples change from iteration to iteration
    for name, history in histories.items():
        assert len(history) == len(reference)
        for ours, old in zip(history, reference):
            assert ours.keys() == old.keys()
            differing = {key: (ours[key], old[key]) for key in ours if compared(key) and ours[key] != old[key]}
            assert not differing, f"{name}, iteration {ours['iteration']}: {differing}"
            assert math.isfinite(ours["grad_norm"]) and ours["grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "cp2", "pp2-vp2"])
def test_the_distributed_optimizer_and_overlapped_reduction_change_no_number(tmp_path, layout):
    """Under the layouts whose gradients need more than the data-parallel reduction (SP's norms, CP's
    data-parallel-and-context group, two chunks per rank of which only the first is bucketed)."""
    argv = DUMP_FLAGS + ["--rollout-dump", write_dump(tmp_path / "rollouts.r3dump"), "--train-iters", "3",
                         "--moe-enable-routing-replay", *DUMP_LAYOUTS[layout]]
    stacks = {"plain": [], "distopt-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                               "--ddp-bucket-size", "5000"]}
    histories = run_workers(loops_worker, 2, argv, stacks, backend="gloo")[-1]
    assert [h["loss"] for h in histories["distopt-overlap"]] == [h["loss"] for h in histories["plain"]]
    assert [h["grad_norm"] for h in histories["distopt-overlap"]] == pytest.approx(
        [h["grad_norm"] for h in histories["plain"]], rel=1e-5)  # a norm of shards sums in another order


def schedule_worker(argv):
    from megatron_r3.rl import run as rl_run
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize

    settings = run_settings(parse_args(argv))
    device = initialize(settings)
    try:
        run = rl_run.setup(settings, device, lambda line: None)
        stack = run.trainer.stack
        config = stack.optimizer.config
        wiring = {
            "ddp": [type(m).__name__ for m in stack.model],
            "finalize": run.trainer.config.finalize_model_grads_func.__name__,
            "optimizer": (config.clip_grad, config.adam_beta1, config.adam_beta2, config.adam_eps,
                          config.weight_decay, config.use_distributed_optimizer, config.bf16),
            "main_weights": sorted({str(p.dtype) for p in stack.optimizer.get_parameters()}),
            "model_weights": sorted({str(p.dtype) for c in stack.chunks for p in c.parameters()}),
        }
        try:
            return wiring, rl_run.run_iterations(run, lambda line: None)
        finally:
            run.source.close()
    finally:
        parallel_state.destroy_model_parallel()


def test_the_flags_set_up_megatrons_optimizer_and_learning_rate_schedule(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    argv = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "4", "--bf16", "--use-distributed-optimizer",
                         "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", "1", "--lr-decay-style", "linear",
                         "--lr-decay-iters", "3", "--clip-grad", "0.5", "--adam-beta1", "0.8", "--adam-beta2", "0.99",
                         "--adam-eps", "1e-6", "--weight-decay", "0.1"]
    (wiring, history), = run_workers(schedule_worker, 1, argv, backend="gloo")
    assert wiring == {"ddp": ["DistributedDataParallel"], "finalize": "finalize_model_grads",
                      "optimizer": (0.5, 0.8, 0.99, 1e-6, 0.1, True, True),
                      "main_weights": ["torch.float32"], "model_weights": ["torch.bfloat16"]}
    # Megatron's schedule, one step per iteration: linear warmup from 0, then linear decay to --min-lr.
    assert [h["lr"] for h in history] == pytest.approx([0.0, 1e-3, 1e-5 + 0.5 * (1e-3 - 1e-5), 1e-5])
    assert all(h["grad_norm"] > 0 and math.isfinite(h["loss"]) for h in history)
