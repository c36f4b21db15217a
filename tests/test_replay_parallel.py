"""Routing replay across ranks (2 gloo processes): EP2 with the alltoall and allgather
dispatchers, and the pipeline schedules (1F1B even/uneven, interleaved, forward-only),
each compared with a single-rank run of the same weights and the same forced routes."""

import pytest
import torch

from tests.support.replay import init_single_rank, make_batch, random_routes
from tests.support.replay_dist import reference_run, run_layout, spawn

pytestmark = pytest.mark.slow

BASE = dict(moe_token_dispatcher_type="alltoall")


def microbatches(count, seed, batch_size=2, seq=8, layer_numbers=(2, 3, 4), no_route_every=5):
    out = []
    for i in range(count):
        tokens, position_ids, labels = make_batch(batch_size, seq, seed=seed + i)
        ids = random_routes(len(layer_numbers), batch_size * seq, seed=seed * 100 + i)
        ids[:, ::no_route_every] = -1  # some tokens routed live, on every layer
        out.append(
            dict(
                tokens=tokens,
                position_ids=position_ids,
                labels=labels,
                expert_ids=ids,
                layer_numbers=list(layer_numbers),
            )
        )
    return out


def _forced(mbs, seed):
    """Replace -1 rows by forced routes (for cases that check every route exactly)."""
    for i, mb in enumerate(mbs):
        mb["expert_ids"] = random_routes(*mb["expert_ids"].shape[:2], seed=seed + i)
    return mbs


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_rank()


def _run(tmp_path, case, mbs, ranks_data=False):
    if ranks_data:
        refs = [reference_run(case["config"], m, case.get("forward_only", False)) for m in mbs]
        ref = dict(
            state=refs[0]["state"],
            microbatches=mbs,
            per_token=[r["per_token"] for r in refs],
            grads=[r["grads"] for r in refs],
        )
    else:
        ref = reference_run(case["config"], mbs, case.get("forward_only", False))
        ref["microbatches"] = mbs
    path = tmp_path / "reference.pt"
    torch.save(ref, path)
    spawn(run_layout, 2, case, str(path))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_replays_forced_routes_and_matches_single_rank(tmp_path, dispatcher):
    case = dict(ep=2, config=dict(moe_token_dispatcher_type=dispatcher))
    # Each rank (data parallel) takes different microbatches; every 5th token has no route.
    mbs = [microbatches(1, seed=10 + r) for r in range(2)]
    _run(tmp_path, case, mbs, ranks_data=True)


def test_ep2_alltoall_all_tokens_to_one_rank(tmp_path):
    """Skewed replay (every token to rank 1's experts): split sizes follow the replayed map."""
    case = dict(ep=2, config=BASE)
    mbs = [microbatches(1, seed=20 + r) for r in range(2)]
    for per_rank in mbs:
        for mb in per_rank:
            mb["expert_ids"][:] = torch.tensor([6, 7])
    _run(tmp_path, case, mbs, ranks_data=True)


PIPELINES = {
    "pp2_1f1b": dict(pp=2),
    "pp2_uneven_1f1b": dict(
        pp=2, config=dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)
    ),
    "pp2_vp2_interleaved": dict(pp=2, vp=2),
    "pp2_1f1b_forward_only": dict(pp=2, forward_only=True),
    "pp2_vp2_forward_only": dict(pp=2, vp=2, forward_only=True),
    "pp2_full_recompute": dict(
        pp=2,
        config=dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
    ),
}


@pytest.mark.parametrize("layout", sorted(PIPELINES))
def test_pipeline_schedules_deliver_each_microbatch_routes(tmp_path, layout):
    case = dict(PIPELINES[layout])
    case["config"] = dict(BASE, **case.get("config", {}))
    mbs = _forced(microbatches(4, seed=30), seed=70)
    # The reference is a single rank: drop the stage-split options.
    ref_config = {
        k: v for k, v in case["config"].items() if not k.startswith("num_layers_in_")
    }
    ref = reference_run(ref_config, mbs, case.get("forward_only", False))
    ref["microbatches"] = mbs
    path = tmp_path / "reference.pt"
    torch.save(ref, path)
    spawn(run_layout, 2, case, str(path))
