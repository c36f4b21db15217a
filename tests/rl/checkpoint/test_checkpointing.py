"""megatron_r3.rl.checkpoint.checkpointing: resume, checkpoints across parallel layouts, interrupted saves, errors.

Workers train the tiny MoE GPT through the launcher's stack (``megatron_r3.rl.trainer.training_stack``:
Megatron's DDP and schedule, ``finalize_model_grads`` dividing by the batch's token count,
Megatron's Adam with the distributed optimizer unless a test says otherwise, the LR
schedule). They run on gloo here, where training is deterministic and a resumed run must be
bit-identical; NCCL workers (a GPU node) compare within float tolerance.
"""

import argparse
import os
import random
import warnings

import numpy as np
import pytest
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

from megatron_r3.rl.arguments import training_stack_settings
from megatron_r3.rl.checkpoint.checkpointing import load_checkpoint, save_checkpoint
from megatron_r3.rl.checkpoint.dirs import TRACKER_FILENAME, iteration_dir, latest_iteration
from megatron_r3.rl.checkpoint.rng import RNGStateNotRestoredWarning
from megatron_r3.rl.trainer.training_stack import add_training_stack_args, build_training_stack
from tests.support.batches import layout_microbatches, make_sequences
from tests.support.harness import full_token_losses
from tests.support.launcher import default_backend, run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.schedule import forward_backward
from tests.support.tiny_moe import TinyMoE, build_gpt
from tests.support.weights import assemble, param_values

MODEL = TinyMoE()
SEQ_LEN, NUM_SEQS, MICRO_BATCH = 16, 4, 2
EP2 = Layout(ep=2, dp=2)
DISTRIBUTED = ("--use-distributed-optimizer",)


def _stack_settings(flags=DISTRIBUTED):
    """The launcher's optimizer settings: its flags' defaults (Adam, --clip-grad 1), plus ``flags``."""
    parser = argparse.ArgumentParser()
    add_training_stack_args(parser)
    return training_stack_settings(
        parser.parse_args(["--lr", "1e-2", "--weight-decay", "0.01", "--lr-decay-iters", "100", *flags]))


def _setup(layout: Layout, model: TinyMoE = MODEL, flags=DISTRIBUTED):
    """Parallel state, Megatron's seeded RNG (CPU generators on CPU), and the model chunks in the training stack."""
    device = init_parallel(layout)
    config, chunks = build_gpt(layout, model, seed=0, device=device)
    stack = build_training_stack(chunks, config, _stack_settings(flags))
    return device, stack


def _train_step(layout, stack, data, device):
    """One optimizer and scheduler step on ``data``; returns this rank's per-token losses before the update."""
    stack.zero_grad()
    results = forward_backward(stack.model, layout_microbatches(layout, data, MICRO_BATCH, device))
    stepped, _, _ = stack.optimizer.step()
    assert stepped
    stack.scheduler.step(increment=1)
    if not results:
        return torch.empty(0, dtype=torch.long), torch.empty(0)
    index = torch.cat([r["token_index"].reshape(-1) for r in results]).cpu()
    loss = torch.cat([r["per_token_loss"].reshape(-1) for r in results]).float().cpu()
    return index, loss


def _random_batch():
    """A batch drawn from the RNG states a checkpoint restores (Python, NumPy, torch)."""
    seed = random.randrange(1 << 20) + int(np.random.randint(1 << 20)) + int(torch.randint(1 << 20, ()))
    return make_sequences([SEQ_LEN] * NUM_SEQS, MODEL.vocab_size, seed=seed)


def _rng_snapshot():
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {"torch": torch.get_rng_state(), **{name: state.clone() for name, state in tracker.items()}}


class _Killed(BaseException):
    """Stands for the run dying (no Exception: a save cleans up after one, a dead process does not)."""


def _save_and_die(*args, **kwargs):
    """save_checkpoint, killed after every rank wrote its shards but before the tracker moved."""
    real_save = dist_checkpointing.save

    def save_then_die(*save_args, **save_kwargs):
        real_save(*save_args, **save_kwargs)
        raise _Killed

    dist_checkpointing.save = save_then_die
    try:
        save_checkpoint(*args, **kwargs)
    except _Killed:
        pass
    finally:
        dist_checkpointing.save = real_save


def resume_worker(layout, directory, steps, save_at=None, crash_at=None, resume=False):
    """Trains to ``steps`` on random batches (from a checkpoint with ``resume``), saving at
    ``save_at`` and dying during the save at ``crash_at``."""
    device, stack = _setup(layout)
    models = {"model": stack.chunks}
    out = {"losses": {}}
    try:
        start = 0
        if resume:
            try:
                load_checkpoint(directory, models, stack.optimizer, iteration=steps, scheduler=stack.scheduler)
            except FileNotFoundError as error:
                out["interrupted_iteration"] = str(error)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start, out["state"] = load_checkpoint(directory, models, stack.optimizer, scheduler=stack.scheduler)
            out["warnings"] = [w.category.__name__ for w in caught if w.category is RNGStateNotRestoredWarning]
            out["rng_at_start"] = _rng_snapshot()
        for step in range(start, steps):
            out["losses"][step] = _train_step(layout, stack, _random_batch(), device)
            args = (directory, step + 1, models, stack.optimizer, {"consumed_samples": (step + 1) * NUM_SEQS},
                    stack.scheduler)
            if step + 1 == save_at:
                out["rng_at_save"] = _rng_snapshot()
                save_checkpoint(*args)
            if step + 1 == crash_at:
                _save_and_die(*args)
        out["params"] = _weights(stack.chunks)
        out["lr"] = [group["lr"] for group in stack.optimizer.param_groups]
        return out
    finally:
        parallel_state.destroy_model_parallel()


# PP2 x VP2: two model chunks per rank (model0, model1); EP2 x DP2: the dense optimizer state sharded over 2 ranks.
@pytest.mark.slow
@pytest.mark.parametrize("layout", [Layout(pp=2, vp=2), EP2], ids=lambda layout: layout.name)
def test_resume_after_a_crash_during_a_save_is_identical_to_uninterrupted_training(tmp_path, layout):
    directory = str(tmp_path)
    whole = run_workers(resume_worker, 2, layout, directory, 4, save_at=2, crash_at=4)
    # Every rank wrote iteration 4, but the run died before the tracker moved: 2 is the last complete one.
    assert latest_iteration(directory) == 2
    assert sorted(os.listdir(directory)) == ["iter_0000002", "iter_0000004.saving", TRACKER_FILENAME]

    resumed = run_workers(resume_worker, 2, layout, directory, 4, resume=True)
    exact = default_backend(2) == "gloo"
    for rank in range(2):
        a, b = whole[rank], resumed[rank]
        assert b["interrupted_iteration"] == (f"no checkpoint of iteration 4 in {directory}; complete checkpoints: "
                                              "iterations [2]")
        assert b["state"] == {"consumed_samples": 8} and b["warnings"] == []
        assert sorted(b["losses"]) == [2, 3]
        for name, state in a["rng_at_save"].items():
            assert torch.equal(state, b["rng_at_start"][name]), f"RNG state {name} not restored"
        for step in (2, 3):
            assert torch.equal(a["losses"][step][0], b["losses"][step][0])
            _assert_same(a["losses"][step][1], b["losses"][step][1], exact)
        for (shard, value), (shard_b, value_b) in zip(a["params"], b["params"]):
            assert shard == shard_b
            _assert_same(value, value_b, exact, shard.name)
        assert a["lr"] == b["lr"]


def _assert_same(a, b, exact, what=""):
    if exact:
        assert torch.equal(a, b), f"{what}: differs by {(a - b).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def _weights(chunks):
    """This rank's weights as ``(Shard, tensor)``, copied (training goes on in place)."""
    return [(shard, value.clone()) for shard, value in param_values(chunks)]


def _fixed_batch(index):
    return make_sequences([SEQ_LEN] * NUM_SEQS, MODEL.vocab_size, seed=100 + index)


def _lagging_copy(layout, device):
    """A second model (other weights), saved beside the trained one like a rollout engine's lagging copy."""
    return build_gpt(layout, MODEL, seed=1, device=device)[1]


def save_across_layouts_worker(layout, directory):
    """Two steps, save (model, lagging copy, optimizer, schedule), then a third step: what any layout
    must reproduce.

    The first attempt to save dies before the tracker is written; the second replaces its leftover.
    """
    device, stack = _setup(layout)
    try:
        for index in range(2):
            _train_step(layout, stack, _fixed_batch(index), device)
        args = (directory, 2, {"model": stack.chunks, "rollout0": _lagging_copy(layout, device)}, stack.optimizer,
                {"consumed_samples": 8}, stack.scheduler)
        _save_and_die(*args)
        out = {"after_crash": (latest_iteration(directory), sorted(os.listdir(directory)))}
        save_checkpoint(*args)
        out["after_save"] = (latest_iteration(directory), sorted(os.listdir(directory)))
        out["params"] = _weights(stack.chunks)
        out["losses"] = _train_step(layout, stack, _fixed_batch(2), device)
        out["params_after_step"] = _weights(stack.chunks)
        return out
    finally:
        parallel_state.destroy_model_parallel()


def load_across_layouts_worker(layout, directory, flags=DISTRIBUTED):
    device, stack = _setup(layout, flags=flags)
    try:
        lagging = build_gpt(layout, MODEL, seed=2, device=device)[1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            iteration, state = load_checkpoint(directory, {"model": stack.chunks, "rollout0": lagging},
                                               stack.optimizer, scheduler=stack.scheduler)
        out = {"iteration": iteration, "state": state, "params": _weights(stack.chunks),
               "lagging": param_values(lagging), "lagging_expected": param_values(_lagging_copy(layout, device)),
               "warnings": [str(w.message) for w in caught if w.category is RNGStateNotRestoredWarning],
               "scheduler_steps": stack.scheduler.num_steps}
        out["losses"] = _train_step(layout, stack, _fixed_batch(2), device)
        out["params_after_step"] = _weights(stack.chunks)
        return out
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module", params=[EP2, Layout(dp=2)], ids=lambda layout: f"saved-{layout.name}")
def saved_checkpoint(request, tmp_path_factory):
    """A checkpoint of the distributed optimizer saved under EP2 x DP2 or DP2 after two steps, and what
    that run did next."""
    directory = str(tmp_path_factory.mktemp(f"checkpoint-{request.param.name}"))
    return directory, run_workers(save_across_layouts_worker, 2, request.param, directory)


# EP2 splits Megatron's optimizer in two (dense, experts), the other layouts do not; DP1 has one shard.
@pytest.mark.slow
@pytest.mark.parametrize("layout, flags", [
    (Layout(tp=2, sp=True), DISTRIBUTED),
    (Layout(), DISTRIBUTED),
    (Layout(pp=2), ()),  # the plain optimizer takes the distributed one's moments
], ids=lambda x: x.name if isinstance(x, Layout) else ("distopt" if x else "plain"))
def test_checkpoint_loads_under_another_layout(saved_checkpoint, layout, flags):
    directory, saved = saved_checkpoint
    loaded = run_workers(load_across_layouts_worker, layout.world_size, layout, directory, flags)
    num_tokens = SEQ_LEN * NUM_SEQS
    for result in loaded:
        assert result["iteration"] == 2 and result["state"] == {"consumed_samples": 8}
        assert result["scheduler_steps"] == 2
        assert len(result["warnings"]) == 1 and "RNG states not restored" in result["warnings"][0]
        assert result["lagging"] and all(torch.equal(a[1], b[1]) for a, b in
                                         zip(result["lagging"], result["lagging_expected"]))

    def full(runs, key):
        return assemble(r[key] for r in runs)

    # The same full weights, bit for bit.
    at_save, after_load = full(saved, "params"), full(loaded, "params")
    assert at_save.keys() == after_load.keys()
    for name in at_save:
        assert torch.equal(at_save[name], after_load[name]), name
    # The same loss on the next batch (another layout sums in another order: float tolerance).
    torch.testing.assert_close(full_token_losses([{"losses": r["losses"]} for r in loaded], num_tokens),
                               full_token_losses([{"losses": r["losses"]} for r in saved], num_tokens),
                               rtol=0, atol=1e-5)
    # The same Adam step: moments and step count followed the layout change. A step from a fresh
    # optimizer state would move the weights by about the learning rate (1e-2) elsewhere.
    stepped, stepped_here = full(saved, "params_after_step"), full(loaded, "params_after_step")
    for name in stepped:
        err = (stepped[name] - stepped_here[name]).abs().max().item()
        assert err < 1e-5, f"{name}: {err:.3g} away from the step under EP2"
        assert not torch.equal(stepped[name], at_save[name]), f"{name} did not move"


def test_saving_again_replaces_the_leftover_of_an_interrupted_save(saved_checkpoint):
    _, saved = saved_checkpoint
    for result in saved:
        assert result["after_crash"] == (None, ["iter_0000002.saving"])
        assert result["after_save"] == (2, ["iter_0000002", TRACKER_FILENAME])


def refused_worker(directory, elsewhere):
    """Loads the EP2 checkpoint into a model with more experts, with a model it does not hold, under
    another learning-rate schedule; a checkpoint of the plain optimizer into the distributed one."""
    out = {}
    _, stack = _setup(Layout(), TinyMoE(num_experts=8))
    try:
        load_checkpoint(directory, {"model": stack.chunks}, stack.optimizer)
    except ValueError as error:
        out["other_shape"] = str(error)
    parallel_state.destroy_model_parallel()
    device, stack = _setup(Layout(), flags=DISTRIBUTED + ("--lr", "2e-2", "--lr-decay-style", "linear"))
    _, reference = build_gpt(Layout(), MODEL, seed=3, device=device)
    for name, models, scheduler in (
            ("not_saved", {"model": stack.chunks, "reference": reference}, None),
            ("other_schedule", {"model": stack.chunks}, stack.scheduler)):
        try:
            load_checkpoint(directory, models, stack.optimizer, scheduler=scheduler)
        except ValueError as error:
            out[name] = str(error)
    parallel_state.destroy_model_parallel()
    device, plain = _setup(Layout(), flags=())
    _train_step(Layout(), plain, _fixed_batch(0), device)
    save_checkpoint(elsewhere, 1, {"model": plain.chunks}, plain.optimizer, None, plain.scheduler)
    parallel_state.destroy_model_parallel()
    _, stack = _setup(Layout())
    try:
        load_checkpoint(elsewhere, {"model": stack.chunks}, stack.optimizer, scheduler=stack.scheduler)
    except ValueError as error:
        out["other_optimizer"] = str(error)
    finally:
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("saved_checkpoint", [EP2], indirect=True, ids=lambda layout: f"saved-{layout.name}")
def test_checkpoint_that_does_not_fit_is_refused(saved_checkpoint, tmp_path):
    directory, _ = saved_checkpoint
    elsewhere = str(tmp_path / "elsewhere")
    (out,) = run_workers(refused_worker, 1, directory, elsewhere)
    path = iteration_dir(directory, 2)
    assert out["other_shape"] == (f"{path} does not fit: tensor decoder.layers.1.mlp.router.weight has shape "
                                  "(4, 32) in the checkpoint, (8, 32) in the model")
    assert out["not_saved"] == f"{path} does not fit: the checkpoint has no tensor reference.embedding.word_embeddings.weight"
    assert out["other_schedule"] == (
        f"{path} does not fit: its learning-rate schedule is not this run's (--lr 0.02 here, 0.01 there; "
        "--lr-decay-style linear here, constant there): pass --override-opt-param-scheduler to take the flags', "
        "--use-checkpoint-opt-param-scheduler the checkpoint's")
    # The distributed optimizer keeps fp32 main weights, which the plain optimizer's checkpoint does not hold.
    assert out["other_optimizer"] == (f"{iteration_dir(elsewhere, 1)} does not fit: the checkpoint has no tensor "
                                      "optimizer.state.param.output_layer.weight (the optimizer that saved it kept "
                                      "other state: distributed or not, fp32 or bf16 parameters)")


def test_loading_without_a_checkpoint_is_refused(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"^no checkpoint in {nowhere}: {TRACKER_FILENAME} is missing "
                                                r"\(the directory does not exist\)$"):
        load_checkpoint(nowhere, {"model": []}, None)
    empty = str(tmp_path)
    assert latest_iteration(empty) is None
    with pytest.raises(FileNotFoundError, match=f"^no checkpoint in {empty}: {TRACKER_FILENAME} is missing$"):
        load_checkpoint(empty, {"model": []}, None)
    (tmp_path / TRACKER_FILENAME).write_text("7\n")
    assert latest_iteration(empty) == 7
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint of iteration 7 in .*; complete checkpoints: "
                                                r"iterations \[\]$"):
        load_checkpoint(empty, {"model": []}, None)
    (tmp_path / TRACKER_FILENAME).write_text("release\n")
    with pytest.raises(ValueError, match="should hold an iteration number, not 'release'"):
        latest_iteration(empty)
