"""The three packing paths (torch reference, C++ CPU, CUDA) agree on random plans.

Plans cover odd lengths, THD with many sequences, uneven PP, VP, CP up to 8,
TP up to 8, and tokens without routes; the reference itself is checked against a plain
Python loop that states the definition.
"""

import numpy as np
import pytest
import torch

import megatron_r3
from megatron_r3.dataplane.device.packing import (
    gather_routes,
    gather_routes_reference,
    scatter_routes,
    scatter_routes_reference,
)
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.routes import id_dtype
from tests.support.pipeline import pipeline_config

pytestmark = pytest.mark.skipif(not megatron_r3.kernel_info()["cpu"], reason="megatron_r3._C not built")


def random_case(seed):
    """A random microbatch of routes and a random rank's plan for it."""
    rng = np.random.default_rng(seed)
    num_experts = int(rng.choice([4, 64, 256, 257, 1000]))
    topk = int(rng.integers(1, min(num_experts, 9) + 1))
    num_layers = int(rng.integers(2, 13))
    moe = tuple(i + 1 for i in range(num_layers) if rng.random() < 0.7) or (num_layers,)
    pp = int(rng.choice([1, 2, 3, 4]))
    vp = int(rng.choice([1, 2])) if pp > 1 else 1
    stages = pp * vp
    per_chunk = int(rng.integers(1, 3))
    first = last = None
    if pp > 2 and rng.random() < 0.5 and vp == 1:
        first, last = int(rng.integers(1, 3)), int(rng.integers(1, 3))  # Megatron wants >= 1
        num_layers = first + last + per_chunk * (pp - 2)
    else:
        num_layers = per_chunk * stages
    moe = tuple(n for n in moe if n <= num_layers) or (num_layers,)
    config = pipeline_config(num_layers, pp, vp if vp > 1 else None, first, last)
    tp, cp = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 4, 8]))
    rank = RankLayout(tp_size=tp, tp_rank=int(rng.integers(tp)), sequence_parallel=bool(rng.random() < 0.7),
                      cp_size=cp, cp_rank=int(rng.integers(cp)), pp_rank=int(rng.integers(pp)),
                      vp_stage=int(rng.integers(vp)) if vp > 1 else None)
    thd = bool(rng.random() < 0.5)
    lens = rng.integers(0 if not thd else 1, 70, size=int(rng.integers(1, 40 if thd else 6)))
    n_src = int(lens.sum())
    experts = np.argsort(rng.random((n_src, len(moe), num_experts)), axis=2)[:, :, :topk]
    ids = torch.from_numpy(experts.astype(id_dtype(num_experts)))
    valid = torch.from_numpy(rng.random(n_src) < 0.8)
    plan = RoutingPlan.build(rank, lens, source_layer_numbers=moe, config=config, qkv_format="thd" if thd else "bshd")
    return ids, valid, plan


def definition_gather(ids, valid, plan):
    out = np.full((plan.num_local_layers, plan.num_local_tokens, ids.shape[2]), -1, np.int64)
    for i, layer in enumerate(plan.layer_index):
        for j, token in enumerate(plan.token_index):
            if token >= 0 and valid[token]:
                out[i, j] = ids[token, layer].numpy()
    return out


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_definition(seed):
    ids, valid, plan = random_case(seed)
    out = gather_routes_reference(ids, valid, torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index))
    np.testing.assert_array_equal(out.numpy(), definition_gather(ids, valid, plan))


@pytest.mark.parametrize("seed", range(200))
def test_cpu_kernel_gather_and_scatter_match_reference(seed):
    ids, valid, plan = random_case(1000 + seed)
    tok, lay = torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index)
    expected = gather_routes_reference(ids, valid, tok, lay)
    out = gather_routes(ids, valid, tok, lay)
    assert out.dtype == torch.int64 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    # Record direction: scatter what the router saw back; untouched rows keep their old value.
    rng = np.random.default_rng(seed)
    recorded = expected.clone()
    recorded[torch.from_numpy(rng.random(recorded.shape[:2]) < 0.1)] = -1  # nothing recorded there
    base_ids = torch.from_numpy(rng.integers(0, 3, ids.shape).astype(ids.numpy().dtype))
    base_recorded = torch.from_numpy(rng.random(ids.shape[:2]) < 0.3)
    ref_ids, ref_recorded = base_ids.clone(), base_recorded.clone()
    scatter_routes_reference(recorded, tok, lay, ref_ids, ref_recorded)
    for dtype in (torch.int64, torch.int32):
        got_ids, got_recorded = base_ids.clone(), base_recorded.clone()
        scatter_routes(recorded.to(dtype), tok, lay, got_ids, got_recorded)
        assert torch.equal(got_ids, ref_ids) and torch.equal(got_recorded, ref_recorded)


def test_gather_then_scatter_round_trips_every_rank():
    """Scattering every rank's gathered routes rebuilds exactly the routed tokens' rows."""
    rng = np.random.default_rng(3)
    lens = [13, 1, 29, 8]
    moe = (1, 2, 4, 5, 6, 7)
    ids = torch.from_numpy(rng.integers(0, 256, (sum(lens), len(moe), 4)).astype(np.uint8))
    valid = torch.from_numpy(rng.random(sum(lens)) < 0.9)
    config = pipeline_config(8, pp=2, vp=2)
    out_ids, recorded = torch.zeros_like(ids), torch.zeros(ids.shape[:2], dtype=torch.bool)
    for tp_rank in range(2):
        for cp_rank in range(4):
            for pp_rank in range(2):
                for vp in range(2):
                    rank = RankLayout(tp_size=2, tp_rank=tp_rank, sequence_parallel=True, cp_size=4,
                                      cp_rank=cp_rank, pp_rank=pp_rank, vp_stage=vp)
                    plan = RoutingPlan.build(rank, lens, source_layer_numbers=moe, config=config, qkv_format="thd")
                    tok, lay = torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index)
                    scatter_routes(gather_routes(ids, valid, tok, lay), tok, lay, out_ids, recorded)
    assert torch.equal(recorded, valid[:, None].expand_as(recorded))
    assert torch.equal(out_ids[valid], ids[valid]) and not out_ids[~valid].any()


def test_front_end_rejects_bad_input_before_any_kernel():
    ids = torch.zeros((4, 2, 2), dtype=torch.uint8)
    valid = torch.ones(4, dtype=torch.bool)
    tok = torch.tensor([0, 1], dtype=torch.int32)
    lay = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"token_index\[1\] = 4 outside \[-1, 4\)"):
        gather_routes(ids, valid, torch.tensor([0, 4], dtype=torch.int32), lay)
    with pytest.raises(ValueError, match="int32"):
        gather_routes(ids, valid, torch.tensor([0, 1]), lay)
    with pytest.raises(ValueError, match="uint8 or int16"):
        gather_routes(ids.int(), valid, tok, lay)
    with pytest.raises(ValueError, match=r"layer_index\[0\] = 2 outside \[0, 2\)"):
        gather_routes(ids, valid, tok, torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"mask must be bool \(4,\)"):
        gather_routes(ids, torch.ones((4, 2), dtype=torch.bool), tok, lay)
    out_ids, recorded = torch.zeros_like(ids), torch.zeros((4, 2), dtype=torch.bool)
    with pytest.raises(ValueError, match=r"token_index\[0\] = -2"):
        scatter_routes(torch.zeros((2, 2, 2), dtype=torch.long), torch.tensor([-2, 0], dtype=torch.int32),
                       lay, out_ids, recorded)
    with pytest.raises(ValueError, match=r"mask must be bool \(4, 2\)"):
        scatter_routes(torch.zeros((2, 2, 2), dtype=torch.long), tok, lay, out_ids, valid)
    assert not recorded.any() and not out_ids.any()


def test_kernel_checks_dtypes_itself():
    # Defence in depth for direct callers of the extension (the dtype path is the one
    # exception route seen to work on every build, see docs/dataplane.md).
    assert megatron_r3.kernel_info()["cpu"], "the C++ extension was not built"
    from megatron_r3 import _C

    ids = torch.zeros((4, 2, 2), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="uint8 or int16"):
        _C.gather_routes(ids, torch.ones(4, dtype=torch.bool), torch.zeros(2, dtype=torch.int32),
                         torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(100))
def test_cuda_kernel_matches_reference(seed):
    assert megatron_r3.kernel_info()["cuda"], "CUDA kernels not built: reinstall on a machine with nvcc"
    ids, valid, plan = random_case(5000 + seed)
    tok, lay = torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index)
    expected = gather_routes_reference(ids, valid, tok, lay)
    dev = torch.device("cuda")
    out = gather_routes(ids.to(dev), valid.to(dev), tok.to(dev), lay.to(dev))
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    # Misaligned output (an offset view) takes the scalar path and must agree too.
    storage = torch.empty(out.numel() + 1, dtype=torch.int64, device=dev)
    shifted = storage[1:].view(out.shape)
    gather_routes(ids.to(dev), valid.to(dev), tok.to(dev), lay.to(dev), out=shifted)
    torch.testing.assert_close(shifted.cpu(), expected, rtol=0, atol=0)

    recorded = expected.clone()
    recorded[:, ::3] = -1
    ref_ids, ref_recorded = torch.zeros_like(ids), torch.zeros(ids.shape[:2], dtype=torch.bool)
    scatter_routes_reference(recorded, tok, lay, ref_ids, ref_recorded)
    got_ids, got_recorded = torch.zeros_like(ids, device=dev), torch.zeros_like(ref_recorded, device=dev)
    scatter_routes(recorded.to(dev), tok.to(dev), lay.to(dev), got_ids, got_recorded)
    assert torch.equal(got_ids.cpu(), ref_ids) and torch.equal(got_recorded.cpu(), ref_recorded)


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts, layers, topk", [(256, 94, 8), (1000, 61, 6), (128, 47, 1)])
def test_cuda_kernel_matches_reference_on_large_microbatches(num_experts, layers, topk):
    """Many layer tiles, ragged token and layer tiles, both id widths, odd top-k."""
    assert megatron_r3.kernel_info()["cuda"], "CUDA kernels not built: reinstall on a machine with nvcc"
    rng = np.random.default_rng(layers)
    lens = rng.integers(1, 2000, size=7)
    # Packing does not care whether a row repeats an id: plain random ids are enough here.
    ids = torch.from_numpy(rng.integers(0, num_experts, (int(lens.sum()), layers, topk)).astype(id_dtype(num_experts)))
    valid = torch.from_numpy(rng.random(len(ids)) < 0.9)
    numbers = range(1, layers + 1)
    plan = RoutingPlan.build(RankLayout(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=1), lens,
                             source_layer_numbers=numbers, layer_numbers=numbers[3:], qkv_format="thd")
    tok, lay = torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index)
    out = gather_routes(ids.cuda(), valid.cuda(), tok.cuda(), lay.cuda())
    torch.testing.assert_close(out.cpu(), gather_routes_reference(ids, valid, tok, lay), rtol=0, atol=0)
