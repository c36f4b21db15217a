"""megatron_r3.rl.trainer.update_graphs: the whole update pass as Megatron's full-iteration CUDA graph.

On a GPU, a replay must give the eager pass's loss, metrics and every gradient in DDP's
buffers bit for bit over all microbatches (on one rank, and on two data-parallel ranks after DDP's
reduction, which the graph holds, at EP=1 and at EP=2 with the static-shape allgather
dispatcher), for new batches of the captured shape (other samples, routes and advantages) and
with the weights as they are at the replay, with no device sync; R3 with filler routes, R2 with
its old log-probs, and live routing, for a bf16 trainer. On CPUs: which layouts graph (and why
the others do not), the start-up line, the shapes a graph is specific to, and the forward step
reading the wrapper's copies of its inputs.
"""

import dataclasses

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from megatron_r3.rl.model.passes import run_pass
from megatron_r3.rl.trainer import update_graphs
from megatron_r3.rl.trainer.update_graphs import (UpdatePassGraphs, graph_key, layout_reason,
                                                  routes_left_to_the_device, run_through)
from tests.support.launcher import run_workers
from tests.test_launch import EMBEDDED_FLAGS

# Two microbatches of two samples on one rank: the graph covers both.
TWO_MICROBATCHES = EMBEDDED_FLAGS + ["--global-batch-size", "4", "--micro-batch-size", "2"]
STATIC_ALLGATHER = ["--moe-grouped-gemm-impl", "torch", "--moe-token-dispatcher-type", "allgather",
                    "--moe-allgather-static-shapes"]


def _grads(chunk):
    return torch.cat([p.main_grad.flatten() for p in chunk.parameters()]).clone()


def _setup(argv, log=print, graph_safe_rng=None):
    """The launcher's run on this rank; ``graph_safe_rng`` overrides whether Megatron's RNG tracker is graph-safe."""
    from megatron.core import tensor_parallel

    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.run import setup

    settings = run_settings(parse_args(argv))
    device = initialize(settings)
    if graph_safe_rng is not None:
        tensor_parallel.get_cuda_rng_tracker().use_cudagraphable_rng = graph_safe_rng
    return setup(settings, device, log)


def _microbatches(trainer, samples, advantages, mode):
    """The update pass's microbatches of ``mode`` (R2: after its old-log-prob pass)."""
    batch = trainer.pipeline.plan(samples, advantages)
    old = recorded = None
    if mode == "r2":
        old, recorded = trainer._old_logprob_pass(batch)
    return trainer.pipeline.prepare(batch, rollout_routes=mode == "r3", recorded=recorded, fillers=True,
                                    old_logprobs=old)


def _update_worker(argv, mode):
    """Per batch: did the graph pass equal the eager one (outputs, gradients)."""
    from megatron_r3.rl.trainer.policy_trainer import PolicyLoss

    run = _setup(argv)
    try:
        trainer = run.trainer
        (chunk,) = trainer.chunks
        eager = UpdatePassGraphs(trainer.chunks, PolicyLoss(trainer.settings), cuda_graphs=False)
        checks = []
        for iteration in (1, 2, 3, 4):  # eager in the wrapper, capture and replay, replays
            batch = run.source.batch(iteration)
            # The task's rewards can tie within every group (all advantages 0, no gradient): draw them.
            advantages = np.random.default_rng(iteration).standard_normal(len(batch.samples))
            results = {}
            for name, update in (("eager", eager), ("graph", trainer.update)):
                trainer.stack.zero_grad()
                microbatches = _microbatches(trainer, batch.samples, advantages, mode)
                torch.cuda.synchronize()
                if name == "graph" and iteration > 2:  # a replay may not wait for the device
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    result = update.run(microbatches)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                results[name] = ([{k: v.clone() for k, v in out.items()} for out in result.outputs], _grads(chunk))
            (want, want_grads), (got, got_grads) = results["eager"], results["graph"]
            checks.append((len(want) == len(got) == 2,
                           all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w),
                           torch.equal(got_grads, want_grads), bool(want_grads.abs().sum() > 0)))
            with torch.no_grad():  # the optimizer changes the weights in place
                for param in chunk.parameters():
                    param.mul_(0.99)
        return {"enabled": trainer.update.enabled, "captures": trainer.update.captures, "checks": checks}
    finally:
        run.source.close()
        run.trainer.update.reset()  # before the process group goes (a graph holding NCCL's collectives keeps it)
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["r3", "r2", "live"])
def test_update_replays_give_the_eager_pass_bit_for_bit(mode):
    flags = {"r3": ["--moe-enable-routing-replay"], "r2": ["--moe-enable-routing-replay", "--routing-replay-mode", "r2"],
             "live": []}[mode]
    argv = TWO_MICROBATCHES + ["--bf16", "--moe-grouped-gemm-impl", "torch"] + flags
    (result,) = run_workers(_update_worker, 1, argv, mode, backend="nccl")
    assert result == {"enabled": True, "captures": 1, "checks": [(True, True, True, True)] * 4}


@pytest.mark.gpu
@pytest.mark.parametrize("mode, flags", [
    ("r3", ["--moe-grouped-gemm-impl", "torch"]),
    ("live", ["--moe-grouped-gemm-impl", "torch"]),
    ("r3", ["--expert-model-parallel-size", "2", *STATIC_ALLGATHER]),
    ("live", ["--expert-model-parallel-size", "2", *STATIC_ALLGATHER]),
], ids=["dp2-r3", "dp2-live", "ep2-static-allgather-r3", "ep2-static-allgather-live"])
def test_update_replays_with_ddps_reduction_give_the_eager_pass_bit_for_bit(mode, flags):
    """Two data-parallel ranks (at EP=2 also two expert ranks): DDP's reduction in the graph, each rank's reduced
    gradients against its eager pass's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    argv = EMBEDDED_FLAGS + ["--global-batch-size", "8", "--micro-batch-size", "2", "--bf16", *flags] + (
        ["--moe-enable-routing-replay"] if mode == "r3" else [])
    results = run_workers(_update_worker, 2, argv, mode, backend="nccl")
    assert results == [{"enabled": True, "captures": 1, "checks": [(True, True, True, True)] * 4}] * 2


def _summary_worker(argv, on_gpu):
    """The trainer's start-up line about its update pass, and why it runs eagerly (None: graphed)."""
    if on_gpu:  # what a GPU replica with a graph-safe RNG tracker would answer
        update_graphs.eager_reason = update_graphs.layout_reason
    lines = []
    run = _setup(argv, lines.append, graph_safe_rng=True if on_gpu else None)
    try:
        update = run.trainer.update
        return [line for line in lines if line.startswith(" update pass:")], update.why_eager
    finally:
        run.source.close()
        parallel_state.destroy_model_parallel()


def test_the_trainer_says_at_start_up_how_its_update_pass_runs():
    argv = TWO_MICROBATCHES + ["--moe-enable-routing-replay"]
    ((lines, why),) = run_workers(_summary_worker, 1, argv, False, backend="gloo")
    assert (lines, why) == ([" update pass: eager (a CPU)"], "a CPU")
    ((lines, why),) = run_workers(_summary_worker, 1, argv + ["--no-trainer-cuda-graphs"], False, backend="gloo")
    assert lines == [" update pass: eager (--no-trainer-cuda-graphs)"]
    ((lines, why),) = run_workers(_summary_worker, 1, argv + ["--moe-grouped-gemm-impl", "torch"], True,
                                  backend="gloo")
    assert why is None and lines == [" update pass: one CUDA graph of all its microbatches, forward and backward "
                                     "(Megatron's FullCudaGraphWrapper), captured on the second pass"]


def _layout_worker(argv, graph_safe_rng):
    """layout_reason on this rank's chunks: every check but the device's."""
    run = _setup(argv, lambda line: None, graph_safe_rng)
    try:
        return layout_reason(run.trainer.chunks)
    finally:
        run.source.close()
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ranks, flags, graph_safe_rng, reason", [
    (1, ["--moe-grouped-gemm-impl", "torch"], True, None),
    (1, ["--moe-grouped-gemm-impl", "torch"], False, "RNG tracker is not graph-safe"),
    (1, ["--no-moe-grouped-gemm"], True, "read their token counts on the host"),
    (2, ["--global-batch-size", "8", "--moe-grouped-gemm-impl", "torch"], True, None),
    (2, ["--global-batch-size", "8", "--moe-grouped-gemm-impl", "torch", "--overlap-grad-reduce"], True,
     "--overlap-grad-reduce over several data-parallel ranks"),
    (2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm-impl", "torch"], True,
     "several expert ranks: the dispatcher reads its token counts on the host"),
    (2, ["--expert-model-parallel-size", "2", *STATIC_ALLGATHER], True, None),
    (2, ["--tensor-model-parallel-size", "2"], True, "pipeline, tensor or context parallelism"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], True,
     "pipeline, tensor or context parallelism"),
], ids=["one-rank-grouped", "rng-not-graph-safe", "sequential-experts", "dp2", "dp2-overlap", "ep2",
        "ep2-static-allgather", "tp2", "pp2-vp2"])
def test_which_layouts_graph_their_update_pass(ranks, flags, graph_safe_rng, reason):
    argv = TWO_MICROBATCHES + ["--moe-enable-routing-replay", *flags]
    for got in run_workers(_layout_worker, ranks, argv, graph_safe_rng, backend="gloo"):
        assert (got is None) if reason is None else (reason in got), got


class CopyingSchedule:
    """Megatron's FullCudaGraphWrapper's part a CPU can run: read every microbatch first, hand the schedule
    copies of their tensors; then overwrite the originals, as the next batch's data would."""

    def __init__(self, schedule):
        self.schedule = schedule

    def __call__(self, **kwargs):
        iterator = kwargs["data_iterator"]
        originals = [next(iterator) for _ in range(kwargs["num_microbatches"])]
        copies = [{k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()} for inputs in originals]
        for inputs in originals:
            for name, value in inputs.items():
                if torch.is_tensor(value) and name not in ("cu_seqlens", "expert_ids", "index"):
                    value.zero_()  # an original a graph would not read again
        kwargs["data_iterator"] = [iter(copies)]
        return self.schedule(**kwargs)


def _copies_worker(argv, mode):
    """The update pass through the copying schedule against the plain pass: outputs and gradients."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_r3.rl.trainer.policy_trainer import PolicyLoss

    run = _setup(argv, lambda line: None)
    try:
        trainer = run.trainer
        (chunk,) = trainer.chunks
        batch = run.source.batch(1)
        advantages = np.random.default_rng(1).standard_normal(len(batch.samples))
        loss = PolicyLoss(trainer.settings)
        results = []
        for through_copies in (False, True):
            trainer.stack.zero_grad()
            microbatches = _microbatches(trainer, batch.samples, advantages, mode)
            if through_copies:
                items = microbatches.all_items()
                result = run_through(CopyingSchedule(get_forward_backward_func()), trainer.chunks, items, loss,
                                     microbatches.seq_length)
            else:
                result = run_pass(trainer.chunks, microbatches, loss, forward_only=False)
            results.append(([{k: v.clone() for k, v in out.items()} for out in result.outputs], _grads(chunk)))
        (want, want_grads), (got, got_grads) = results
        return (len(got) == 2 and all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w),
                torch.equal(got_grads, want_grads), bool(want_grads.abs().sum() > 0))
    finally:
        run.source.close()
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("mode", ["r3", "r2", "live"])
def test_the_forward_step_reads_the_wrappers_copies_of_every_input(mode):
    """Tokens, masks, log-probs, advantages, routes and R2's old log-probs all come from the copies: with the
    originals zeroed the pass still equals the plain one (RoPE's table of row length + 1 changes nothing)."""
    flags = {"r3": ["--moe-enable-routing-replay"], "r2": ["--moe-enable-routing-replay", "--routing-replay-mode", "r2"],
             "live": []}[mode]
    assert run_workers(_copies_worker, 1, TWO_MICROBATCHES + flags, mode, backend="gloo") == [(True, True, True)]


@pytest.mark.parametrize("flags", [["--moe-grouped-gemm-impl", "torch"],
                                   ["--expert-model-parallel-size", "2", *STATIC_ALLGATHER]], ids=["dp2", "ep2-static"])
def test_two_ranks_read_the_wrappers_copies_with_ddps_reduction_in_the_schedule(flags):
    """The layouts whose graph holds other ranks' collectives: through the copies each rank's reduced gradients
    equal the plain pass's."""
    argv = EMBEDDED_FLAGS + ["--global-batch-size", "8", "--micro-batch-size", "2", "--moe-enable-routing-replay",
                             *flags]
    assert run_workers(_copies_worker, 2, argv, "r3", backend="gloo") == [(True, True, True)] * 2


def _keys_worker(argv):
    run = _setup(argv, lambda line: None)
    try:
        trainer = run.trainer
        samples = run.source.batch(1).samples
        batch = trainer.pipeline.plan(samples)
        live = trainer.pipeline.prepare(batch).all_items()
        replay = trainer.pipeline.prepare(batch, rollout_routes=True).all_items()
        gaps = trainer.pipeline.prepare(batch, rollout_routes=True, fillers=False).all_items()
        old = [torch.zeros_like(per_chunk[0].batch.loss_mask) for per_chunk in live]
        with_old = trainer.pipeline.prepare(batch, old_logprobs=old).all_items()
        other = trainer.pipeline.prepare(trainer.pipeline.plan(run.source.batch(2).samples),
                                         rollout_routes=True).all_items()
        keys = [graph_key(items) for items in (live, replay, gaps, with_old, other, live[:1])]
        split = replay[0][0]
        split.batch.packed_seq_params.cu_seqlens_kv = split.batch.packed_seq_params.cu_seqlens_kv.clone()
        return keys, graph_key(replay)
    finally:
        run.source.close()
        parallel_state.destroy_model_parallel()


def test_a_graph_is_specific_to_its_shapes_and_routes():
    ((keys, split),) = run_workers(_keys_worker, 1, TWO_MICROBATCHES + ["--moe-enable-routing-replay"],
                                   backend="gloo")
    live, replay, gaps, with_old, other, first = keys
    assert len({live, replay, gaps, with_old, first}) == 5  # routes, live tails, old log-probs, microbatches
    assert other == replay  # another batch of the same shape replays the same graph
    assert split is None  # separate cu_seqlens tensors: the pass runs eagerly


def _shared_keys_worker(argv):
    """Graph keys of one batch's replayed items marked as covering every token and not, before and after
    routes_left_to_the_device; and the live items through it."""
    run = _setup(argv, lambda line: None)
    try:
        trainer = run.trainer
        batch = trainer.pipeline.plan(run.source.batch(1).samples)
        replay = trainer.pipeline.prepare(batch, rollout_routes=True).all_items()
        live = trainer.pipeline.prepare(batch).all_items()

        def marked(items, complete):
            return [[dataclasses.replace(item, routes=dataclasses.replace(item.routes, every_token_routed=complete))
                     for item in per_chunk] for per_chunk in items]

        def left(items):
            return [[routes_left_to_the_device(item) for item in per_chunk] for per_chunk in items]

        complete, partial = marked(replay, True), marked(replay, False)
        return (graph_key(complete) != graph_key(partial), graph_key(left(complete)) == graph_key(left(partial)),
                all(item.routes.expert_ids is original.routes.expert_ids and not item.routes.every_token_routed
                    for per_chunk, originals in zip(left(complete), complete)
                    for item, original in zip(per_chunk, originals)),
                all(a is b for per_chunk, originals in zip(left(live), live) for a, b in zip(per_chunk, originals)))
    finally:
        run.source.close()
        parallel_state.destroy_model_parallel()


def test_a_graph_shared_by_several_ranks_holds_no_key_one_ranks_data_decides():
    """Whether a rank's routes cover every token is its data's: across ranks the graph leaves it to the device
    (a live top-k where a token has no route), so every rank captures in the same pass."""
    ((differ, agree, same_ids, live_unchanged),) = run_workers(
        _shared_keys_worker, 1, TWO_MICROBATCHES + ["--moe-enable-routing-replay"], backend="gloo")
    assert differ and agree and same_ids and live_unchanged
