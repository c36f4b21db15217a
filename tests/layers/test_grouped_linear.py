"""megatron_r3.layers.grouped_linear: fp32 grouped linear layers on CUDA that read no group ends back.

Forward and both gradients equal per-group float64 matmuls (rounded to fp32) on fresh random
shapes: empty groups, one-row groups, rows after the last end, widths that fill no tile, and
they run with no device sync and replay from a CUDA graph with other group sizes.
"""

import numpy as np
import pytest
import torch

import megatron_r3
from megatron_r3.layers.grouped_linear import grouped_linear, grouped_linear_runs


def random_case(seed, device="cuda"):
    """Rows sorted by group, the group ends (some groups empty, maybe unassigned rows after the last),
    weights [groups, out, in] and an output gradient."""
    rng = np.random.default_rng(seed)
    groups = int(rng.choice([1, 3, 8, 17]))
    in_features, out_features = (int(v) for v in rng.choice([1, 16, 40, 64, 72, 130], size=2))
    counts = rng.integers(0, 90, size=groups) * (rng.random(groups) < 0.8)
    if rng.random() < 0.3:
        counts[rng.integers(groups)] = 1
    rows = int(counts.sum()) + int(rng.integers(0, 5) if rng.random() < 0.3 else 0)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(groups, out_features, in_features, generator=gen)
    grad = torch.randn(rows, out_features, generator=gen)
    ends = torch.from_numpy(np.cumsum(counts).astype(np.int32))
    return [t.to(device) for t in (x, weight, ends, grad)]


def reference(x, weight, ends, grad):
    """Per-group float64 matmuls: output, input gradient, weight gradient."""
    x, weight, grad = (t.double().cpu() for t in (x, weight, grad))
    out, grad_x, grad_w = torch.zeros(len(x), weight.shape[1]).double(), torch.zeros_like(x), torch.zeros_like(weight)
    start = 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end] @ weight[g].T
        grad_x[start:end] = grad[start:end] @ weight[g]
        grad_w[g] = grad[start:end].T @ x[start:end]
        start = end
    return out.float(), grad_x.float(), grad_w.float()


def forward_backward(x, weight, ends, grad):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = grouped_linear(x, weight, ends)
    grad_x, grad_w = torch.autograd.grad(out, [x, weight], grad)
    return out.detach(), grad_x, grad_w


def assert_matches(got, want):
    for g, w in zip(got, want):
        # fp32 sums of up to 130 products in another order than float64's.
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


def test_grouped_linear_takes_only_fp32_cuda_rows():
    x, weight, ends, _ = random_case(0, device="cpu")
    assert not grouped_linear_runs(x)
    with pytest.raises(ValueError, match="grouped_linear takes fp32 CUDA rows"):
        grouped_linear(x, weight, ends)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(40))
def test_grouped_linear_matches_per_group_matmuls(seed):
    assert megatron_r3.kernel_info()["cuda"], "CUDA kernels not built: reinstall on a machine with nvcc"
    case = random_case(seed)
    assert_matches(forward_backward(*case), reference(*case))


def split_rows(rows, groups, rng):
    """Group ends splitting ``rows`` rows into ``groups`` groups (some empty), as int32 on the GPU."""
    cut = np.sort(rng.integers(0, rows + 1, size=groups - 1))
    return torch.tensor(np.append(cut, rows), dtype=torch.int32, device="cuda")


@pytest.mark.gpu
def test_grouped_linear_makes_no_sync_and_replays_from_a_graph_with_other_group_sizes():
    rng = np.random.default_rng(100)
    x, weight, grad = torch.randn(200, 72, device="cuda"), torch.randn(5, 40, 72, device="cuda"), torch.randn(
        200, 40, device="cuda")
    ends = split_rows(200, 5, rng)
    forward_backward(x, weight, ends, grad)  # one eager call first, as torch asks before a capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward(x, weight, ends, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward_backward(x, weight, ends, grad)
    for _ in range(3):  # new values and a new split of the same rows
        for static, value in ((x, torch.randn_like(x)), (weight, torch.randn_like(weight)),
                              (ends, split_rows(200, 5, rng)), (grad, torch.randn_like(grad))):
            static.copy_(value)
        graph.replay()
        assert_matches(captured, reference(x, weight, ends, grad))
