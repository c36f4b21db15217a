"""Schedules call config.microbatch_prefetch_func after each forward (patch "pipeline_parallel:
schedules call config.microbatch_prefetch_func after each forward") and PreparedMicrobatches
prepares each microbatch once, one ahead, for every model chunk: no pipelining, 1F1B,
interleaved 1F1B, training and forward-only, with plain iterators and with Megatron-LM's
RerunDataIterator around them."""

import contextlib
from functools import partial

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import RerunDataIterator

from megatron_r3.dataplane.device.prefetch import PreparedMicrobatches
from tests.support.batches import layout_microbatches, make_sequences
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.schedule import forward_step
from tests.support.tiny_moe import TinyMoE, build_gpt

MODEL = TinyMoE()
DATA = make_sequences([16] * 8, MODEL.vocab_size, seed=3)


def logged_forward_step(data_iterator, model, log):
    output, loss_func = forward_step(data_iterator, model)
    log.append(("forward", model.vp_stage or 0))
    return output, loss_func


def schedule_worker(layout, forward_only, prefetching, rerun_wrapped=False):
    init_parallel(layout)
    try:
        config, chunks = build_gpt(layout, MODEL, seed=0, device=torch.device("cpu"))
        microbatches = layout_microbatches(layout, DATA, 1)
        log = []

        def prepare(index):
            log.append(("prepare", index))
            return [microbatches[index]] * len(chunks)

        prepared = PreparedMicrobatches(len(microbatches), prepare, len(chunks))
        if prefetching:
            iterators = prepared.iterators()
        else:
            iterators = [iter(microbatches) for _ in chunks]
        if rerun_wrapped:  # as Megatron-LM's training loop hands them to the schedule
            iterators = [RerunDataIterator(it) for it in iterators]
        data_iterator = iterators if len(chunks) > 1 else iterators[0]
        installed = prepared.installed(config) if prefetching else contextlib.nullcontext()
        with installed:
            results = get_forward_backward_func()(
                forward_step_func=partial(logged_forward_step, log=log),
                data_iterator=data_iterator,
                model=chunks,
                num_microbatches=len(microbatches),
                seq_length=microbatches[0].seq_length,
                micro_batch_size=1,
                forward_only=forward_only,
            )
        assert config.microbatch_prefetch_func is None  # uninstalled after the step
        return {
            "log": log,
            "losses": [r["per_token_loss"] for r in results],
            "on_demand": prepared.prepared_on_demand if prefetching else None,
            "num_microbatches": len(microbatches),
            "num_chunks": len(chunks),
        }
    finally:
        parallel_state.destroy_model_parallel()


SCHEDULES = {
    "no-pipelining": Layout(dp=2),
    "1f1b": Layout(pp=2),
    "interleaved-1f1b": Layout(pp=2, vp=2),
}


@pytest.mark.parametrize("rerun_wrapped", [False, True], ids=["plain", "rerun-data-iterator"])
@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward-only"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_microbatch_is_prepared_once_one_ahead(schedule, forward_only, rerun_wrapped):
    layout = SCHEDULES[schedule]
    plain = run_workers(schedule_worker, layout.world_size, layout, forward_only, False, backend="gloo")
    prefetched = run_workers(schedule_worker, layout.world_size, layout, forward_only, True,
                             rerun_wrapped, backend="gloo")
    for result, reference in zip(prefetched, plain):
        log, count = result["log"], result["num_microbatches"]
        prepares = [index for what, index in log if what == "prepare"]
        assert prepares == list(range(count))  # each once, in order
        assert result["on_demand"] == 1  # only the first: the schedule asked for every other one
        # Microbatch i is prepared right after a forward, before the forward that uses it,
        # and never more than one microbatch ahead of the forwards issued so far.
        forwards_before = [sum(what == "forward" for what, _ in log[:log.index(("prepare", i))])
                           for i in range(count)]
        chunks = result["num_chunks"]
        for i in range(1, count):
            assert forwards_before[i] >= 1
            assert forwards_before[i] <= i * chunks
        # Prefetching changes nothing in what is computed.
        assert len(result["losses"]) == len(reference["losses"])
        for a, b in zip(result["losses"], reference["losses"]):
            assert torch.equal(a, b)


def test_prepared_microbatches_hands_each_chunk_each_microbatch_once():
    prepared = PreparedMicrobatches(3, lambda i: [(i, "chunk0"), (i, "chunk1")], num_chunks=2)
    first, second = prepared.iterators()
    prepared.prefetch()
    assert next(first) == (0, "chunk0") and next(second) == (0, "chunk1")
    assert prepared.prepared_on_demand == 0
    prepared.prefetch(vp_stage=1)  # the next one no chunk has taken: 1
    assert [next(first), next(first)] == [(1, "chunk0"), (2, "chunk0")]
    assert prepared.prepared_on_demand == 1
    prepared.prefetch()  # past the end: nothing to prepare
    with pytest.raises(StopIteration):
        next(first)
    assert [next(second), next(second)] == [(1, "chunk1"), (2, "chunk1")]
