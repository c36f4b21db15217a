"""RouteUploader: same answer as the reference, on CPU and (marked gpu) on CUDA without host syncs."""

import numpy as np
import pytest
import torch

import megatron_r3
from megatron_r3.dataplane.device.packing import gather_routes_reference
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.device.transport import RouteUploader
from megatron_r3.dataplane.engines.adapters import from_array
from megatron_r3.dataplane.routes import concat_routes
from megatron_r3.dataplane.samples import RoutingSpec
from tests.support.pipeline import pipeline_config

SPEC = RoutingSpec(num_layers=8, model_moe_layers=(2, 3, 4, 6, 7, 8), num_experts=128, topk=8)
CONFIG = pipeline_config(8, pp=2, vp=2)


def microbatch(rng, lens, spec=SPEC):
    samples = []
    for i, n in enumerate(lens):
        ids = np.argsort(rng.random((n, len(spec.model_moe_layers), spec.num_experts)), axis=2)[:, :, : spec.topk]
        ids[rng.random(n) < 0.1] = -1  # tokens without a route: the live router decides them
        samples.append(from_array(ids, spec, sample=i))
    return samples


def chunk_plans(lens, rank_kw, qkv_format="thd"):
    return [
        RoutingPlan.build(RankLayout(pp_rank=1, vp_stage=vp, **rank_kw), lens,
                          source_layer_numbers=SPEC.model_moe_layers, config=CONFIG, qkv_format=qkv_format)
        for vp in range(2)
    ]


def expected(samples, plan):
    ids, valid = (torch.from_numpy(a) for a in concat_routes(samples))
    return gather_routes_reference(ids, valid, torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index))


def test_cpu_upload_matches_reference():
    rng = np.random.default_rng(0)
    uploader = RouteUploader("cpu")
    for lens in ([5, 33, 2], [1], [40, 40, 7, 9]):
        samples = microbatch(rng, lens)
        assert len(lens) == 1 or not all(s.valid.all() for s in samples)  # the no-route path is exercised
        plans = chunk_plans(lens, dict(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=0))
        packed = uploader.upload(samples, plans)
        assert [p.layer_numbers for p in packed] == [(3, 4), (7, 8)]
        for p, plan in zip(packed, plans):
            torch.testing.assert_close(p.wait(), expected(samples, plan), rtol=0, atol=0)


def test_cpu_upload_int16_ids_and_bshd():
    spec = RoutingSpec(num_layers=8, model_moe_layers=SPEC.model_moe_layers, num_experts=300, topk=3)
    rng = np.random.default_rng(4)
    lens = [17, 3, 30]
    samples = microbatch(rng, lens, spec)
    assert samples[0].ids.dtype == np.int16 and not all(s.valid.all() for s in samples)
    plans = chunk_plans(lens, dict(tp_size=2, tp_rank=0, sequence_parallel=True, cp_size=2, cp_rank=1), "bshd")
    for p, plan in zip(RouteUploader("cpu").upload(samples, plans), plans):
        torch.testing.assert_close(p.wait(), expected(samples, plan), rtol=0, atol=0)


def test_upload_rejects_plan_for_another_microbatch():
    rng = np.random.default_rng(1)
    samples = microbatch(rng, [4, 4])
    with pytest.raises(ValueError, match="plan expects 9 tokens"):
        RouteUploader("cpu").upload(samples, chunk_plans([4, 5], {}))


@pytest.mark.gpu
def test_cuda_upload_matches_reference():
    assert megatron_r3.kernel_info()["cuda"], "CUDA kernels not built: reinstall on a machine with nvcc"
    rng = np.random.default_rng(2)
    uploader = RouteUploader("cuda")
    for step in range(12):
        lens = rng.integers(1, 300, size=int(rng.integers(1, 9))).tolist()
        samples = microbatch(rng, lens)
        plans = chunk_plans(lens, dict(tp_size=4, tp_rank=step % 4, sequence_parallel=True, cp_size=2,
                                       cp_rank=step % 2))
        for p, plan in zip(uploader.upload(samples, plans), plans):
            got = p.wait()
            assert got.is_cuda and got.dtype == torch.int64
            torch.testing.assert_close(got.cpu(), expected(samples, plan), rtol=0, atol=0)


@pytest.mark.gpu
def test_replay_path_has_no_device_to_host_sync():
    """Upload, pack and a router-style forward/backward at the replayed ids under sync debug 'error'."""
    assert megatron_r3.kernel_info()["cuda"], "CUDA kernels not built: reinstall on a machine with nvcc"
    rng = np.random.default_rng(3)
    uploader = RouteUploader("cuda")
    lens = [700, 129, 1024, 3]
    rank_kw = dict(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=1)
    batches = [microbatch(rng, lens) for _ in range(6)]
    plans = chunk_plans(lens, rank_kw)
    uploader.upload(batches[0], plans)[0].wait()  # warm up: side stream, pinned buffers, allocator
    torch.cuda.synchronize()
    weight = torch.randn(64, SPEC.num_experts, device="cuda", requires_grad=True)
    results = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for samples in batches:
            for packed in uploader.upload(samples, plans):
                expert_ids = packed.wait()
                hidden = torch.randn(expert_ids.shape[1], 64, device="cuda")
                probs = torch.softmax(hidden @ weight, dim=-1)
                routed = expert_ids[0] >= 0  # [tokens, topk]
                picked = torch.gather(probs, 1, expert_ids[0].clamp(min=0))
                loss = torch.where(routed, picked, torch.zeros_like(picked)).sum()
                loss.backward()
                results.append(expert_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for i, samples in enumerate(batches):
        for j, plan in enumerate(plans):
            torch.testing.assert_close(results[2 * i + j].cpu(), expected(samples, plan), rtol=0, atol=0)
    assert weight.grad is not None and weight.grad.abs().sum().item() > 0
