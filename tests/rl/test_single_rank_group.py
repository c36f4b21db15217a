"""The ``single_rank`` process group backend: every collective gives what gloo (CPU) or NCCL (GPU) gives
in a world of one rank, and the launcher trains the same on it as on gloo or NCCL."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_r3.rl import single_rank_group
from megatron_r3.rl.initialize import process_group_backend
from megatron_r3.rl.run_checks import RunCheckError
from tests.support.launcher import run_workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _collectives(group, device, seed):
    """Every collective the training stack, the data plane and checkpointing use, on fresh random
    inputs, into outputs that start as NaN (a collective that writes nothing leaves them NaN)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def nans(*shape):
        return torch.full(shape, float("nan"), device=device)

    out = {}
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        tensor = rand(5)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
        out[f"all_reduce_{op}"] = tensor
    tensor = rand(3)
    dist.all_reduce(tensor, group=group, async_op=True).wait()
    out["all_reduce_async"] = tensor
    tensors = [rand(4), rand(2)]
    with dist._coalescing_manager(group=group, async_ops=True) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor, group=group)
    manager.wait()
    out["all_reduce_coalesced"] = torch.cat(tensors)
    gathered = [nans(6)]
    dist.all_gather(gathered, rand(6), group=group)
    out["all_gather"] = gathered[0]
    out["all_gather_into_tensor"] = nans(7)
    dist.all_gather_into_tensor(out["all_gather_into_tensor"], rand(7), group=group)
    out["reduce_scatter_tensor"] = nans(4)
    dist.reduce_scatter_tensor(out["reduce_scatter_tensor"], rand(4), group=group)
    out["reduce_scatter"] = nans(3)
    dist.reduce_scatter(out["reduce_scatter"], [rand(3)], group=group)
    out["broadcast"] = rand(2)
    dist.broadcast(out["broadcast"], src=0, group=group)
    out["all_to_all_single"] = nans(5)
    dist.all_to_all_single(out["all_to_all_single"], rand(5), [5], [5], group=group)
    dist.barrier(group=group)
    objects = [None]
    dist.all_gather_object(objects, {"seed": seed, "values": [1, 2]}, group=group)
    out["all_gather_object"] = objects[0]
    objects = [{"broadcast": seed}]
    dist.broadcast_object_list(objects, src=0, group=group)
    out["broadcast_object_list"] = objects[0]
    return out


def compare_with_reference_worker(reference_backend):
    """The collectives in a ``single_rank`` world, as the launcher makes it, and on a group of
    ``reference_backend`` in it."""
    dist.destroy_process_group()  # the harness's world, replaced by the launcher's kind
    single_rank_group.register()
    dist.init_process_group(single_rank_group.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device()) if reference_backend == "nccl" else torch.device("cpu")
    reference = dist.new_group([0], backend=reference_backend)
    group = dist.group.WORLD
    assert dist.get_backend(group) == single_rank_group.BACKEND
    results = {}
    for seed in range(3):
        results[seed] = (_collectives(reference, device, seed), _collectives(group, device, seed))
    refused = []
    tensor = torch.ones(2, device=device)
    for call in (lambda: dist.all_reduce(tensor, op=dist.ReduceOp.PREMUL_SUM, group=group),
                 lambda: group.send([tensor], 1, 0)):
        try:
            call()
        except (RuntimeError, TypeError, ValueError) as error:
            refused.append(str(error))
    return {"results": results, "refused": refused}


def check_same_as_reference(reference_backend):
    (result,) = run_workers(compare_with_reference_worker, 1, reference_backend, backend=reference_backend)
    for seed, (reference, single) in result["results"].items():
        assert reference.keys() == single.keys()
        for name, value in reference.items():
            if isinstance(value, torch.Tensor):
                assert not value.isnan().any(), name
                assert torch.equal(value, single[name]), (seed, name)
            else:
                assert value == single[name], (seed, name)
    assert len(result["refused"]) == 2, result["refused"]


def test_collectives_match_gloo_in_a_world_of_one():
    check_same_as_reference("gloo")


@pytest.mark.gpu
def test_collectives_match_nccl_in_a_world_of_one():
    check_same_as_reference("nccl")


def test_the_default_backend_is_single_rank_only_in_a_world_of_one():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert process_group_backend(None, cpu, 1) == single_rank_group.BACKEND
    assert process_group_backend(None, cuda, 1) == single_rank_group.BACKEND
    assert process_group_backend(None, cpu, 2) == "gloo"
    assert process_group_backend(None, cuda, 2) == "nccl"
    assert process_group_backend("nccl", cuda, 1) == "nccl"
    assert process_group_backend("gloo", cpu, 1) == "gloo"
    with pytest.raises(RunCheckError, match="--distributed-backend single_rank runs a world of one rank, not 2"):
        process_group_backend("single_rank", cpu, 2)
    with pytest.raises(ValueError, match="one rank, not 2"):
        single_rank_group.SingleRankGroup(0, 2)


def launcher_metrics(tmp_path, name, backend_flags, env):
    """Two iterations of the launcher's default run in a world of one rank; its metrics rows."""
    metrics = tmp_path / f"{name}.jsonl"
    command = [sys.executable, "launch/pretrain_gpt_r3.py", "--moe-enable-routing-replay", "--train-iters", "2",
               "--metrics-file", str(metrics), *backend_flags]
    env = {**os.environ, **env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    return command, env, metrics


def run_launchers(tmp_path, runs):
    """Runs the launchers side by side, each on its own port; their metrics rows, by name."""
    procs = {}
    for port, (name, flags, env) in enumerate(runs, start=29611 + os.getpid() % 1000 * 4):
        command, env, metrics = launcher_metrics(tmp_path, name, flags, {**env, "MASTER_PORT": str(port)})
        procs[name] = (subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True), metrics)
    rows = {}
    for name, (proc, metrics) in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-3000:]
        rows[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rows


def _trained_values(row):
    """What the run computed (not how long it took)."""
    return {key: value for key, value in row.items()
            if not key.startswith("time/") and key not in ("tokens_per_s", "elapsed_s", "eta_s")}


def test_the_launcher_trains_the_same_on_single_rank_as_on_gloo(tmp_path):
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    rows = run_launchers(tmp_path, [("single_rank", [], cpu), ("gloo", ["--distributed-backend", "gloo"], cpu)])
    assert len(rows["gloo"]) == 2
    assert [_trained_values(r) for r in rows["single_rank"]] == [_trained_values(r) for r in rows["gloo"]]


@pytest.mark.gpu
def test_the_launcher_trains_the_same_on_single_rank_as_on_nccl(tmp_path):
    rows = run_launchers(tmp_path, [("single_rank", [], {}), ("nccl", ["--distributed-backend", "nccl"], {})])
    assert len(rows["nccl"]) == 2
    assert [_trained_values(r) for r in rows["single_rank"]] == [_trained_values(r) for r in rows["nccl"]]
