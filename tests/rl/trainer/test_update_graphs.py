"""megatron_r3.rl.trainer.update_graphs: the trainer's update pass as a CUDA graph replay.

A replay must give the eager pass's loss, metrics and every gradient in DDP's buffers bit
for bit, for new batches of the captured shape (other samples, routes and advantages) and
with the weights as they are at the replay, with no device sync; R3 with filler routes, R2
with its old log-probs, and live routing, for a bf16 trainer. Where graphs do not apply (a
CPU, several microbatches, experts that need host token counts) the pass runs eagerly.
"""

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from megatron_r3.rl.trainer.update_graphs import UpdatePassGraphs
from tests.support.launcher import run_workers
from tests.test_launch import EMBEDDED_FLAGS

ONE_MICROBATCH = EMBEDDED_FLAGS + ["--micro-batch-size", "4"]


def _grads(chunk):
    return torch.cat([p.main_grad.flatten() for p in chunk.parameters()]).clone()


def _update_worker(argv, mode):
    """Per batch: did the graph pass equal the eager one (outputs, gradients), and did it replay."""
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.run import setup
    from megatron_r3.rl.trainer.policy_trainer import PolicyLoss

    settings = run_settings(parse_args(argv))
    device = initialize(settings)
    try:
        run = setup(settings, device)
        trainer = run.trainer
        (chunk,) = trainer.chunks
        eager = UpdatePassGraphs(trainer.chunks, lambda old: PolicyLoss(old, trainer.settings), trainer.stack.zero_grad,
                                 cuda_graphs=False)
        checks = []
        for iteration in (1, 2, 3):
            batch = run.source.batch(iteration)
            # The task's rewards can tie within every group (all advantages 0, no gradient): draw them.
            advantages = np.random.default_rng(iteration).standard_normal(len(batch.samples))
            old = None
            if mode == "r2":
                old, recorded = trainer._old_logprob_pass(batch.samples)
            results = {}
            for name, update in (("eager", eager), ("graph", trainer.update)):
                trainer.stack.zero_grad()
                microbatches = trainer.pipeline.prepare(
                    batch.samples, advantages, rollout_routes=mode == "r3",
                    recorded=recorded if mode == "r2" else None, fillers=True)
                torch.cuda.synchronize()
                if name == "graph" and iteration > 1:  # captured by now: a replay may not wait for the device
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    result = update.run(microbatches, old)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                (out,) = result.outputs
                results[name] = ({k: v.clone() for k, v in out.items()}, _grads(chunk))
            (want, want_grads), (got, got_grads) = results["eager"], results["graph"]
            checks.append((all(torch.equal(got[k], want[k]) for k in want), torch.equal(got_grads, want_grads),
                           bool(want_grads.abs().sum() > 0)))
            with torch.no_grad():  # the optimizer changes the weights in place
                for param in chunk.parameters():
                    param.mul_(0.99)
        run.source.close()
        return {"enabled": trainer.update.enabled, "graphs": trainer.update.num_graphs, "checks": checks}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["r3", "r2", "live"])
def test_update_replays_give_the_eager_pass_bit_for_bit(mode):
    flags = {"r3": ["--moe-enable-routing-replay"], "r2": ["--moe-enable-routing-replay", "--routing-replay-mode", "r2"],
             "live": []}[mode]
    (result,) = run_workers(_update_worker, 1, ONE_MICROBATCH + ["--bf16"] + flags, mode, backend="nccl")
    assert result == {"enabled": True, "graphs": 1, "checks": [(True, True, True)] * 3}


def _disabled_worker(argv):
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.run import setup

    settings = run_settings(parse_args(argv))
    device = initialize(settings)
    try:
        run = setup(settings, device)
        run.source.close()
        return run.trainer.update.enabled
    finally:
        parallel_state.destroy_model_parallel()


def test_on_a_cpu_the_update_pass_runs_eagerly():
    assert run_workers(_disabled_worker, 1, ONE_MICROBATCH + ["--moe-enable-routing-replay"], backend="gloo") == [False]


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [["--bf16", "--no-trainer-cuda-graphs"], ["--bf16", "--no-moe-grouped-gemm"], []],
                         ids=["no-trainer-cuda-graphs", "sequential-experts", "fp32-grouped-experts"])
def test_without_graphs_or_with_sequential_experts_the_update_pass_runs_eagerly(flags):
    argv = ONE_MICROBATCH + ["--moe-enable-routing-replay", *flags]
    assert run_workers(_disabled_worker, 1, argv, backend="nccl") == [False]


def _enabled_where_graphs_apply_worker(argv):
    """Whether the trainer would capture its update pass, were its chunks on one GPU each."""
    from megatron_r3.rl.trainer import update_graphs

    update_graphs.graphs_apply = lambda chunks: True  # what a GPU replica of one rank would answer
    return _disabled_worker(argv)


@pytest.mark.parametrize("ranks, enabled", [(1, True), (2, False)], ids=["one-rank", "two-data-parallel-ranks"])
def test_several_data_parallel_ranks_run_the_update_pass_eagerly(ranks, enabled):
    """DDP's reduction over several ranks is not captured; one rank (the negative control) is."""
    argv = ONE_MICROBATCH + ["--moe-enable-routing-replay", "--global-batch-size", str(4 * ranks)]
    assert run_workers(_enabled_where_graphs_apply_worker, ranks, argv, backend="gloo") == [enabled] * ranks
