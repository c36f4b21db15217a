"""ContextParallelDotProductAttention against plain causal attention, BSHD and THD, CP 1 and 2."""

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.context_parallel import zigzag_placement
from megatron_r3.layers.core_attention import ContextParallelDotProductAttention
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel

HEADS, GROUPS, DIM = 4, 2, 8
BATCH, SEQ = 2, 16
THD_LENGTHS = [5, 12, 1, 7]


def _reference(q, k, v):
    """Plain causal attention of one sequence, ``[s, heads, dim]`` -> ``[s, heads * dim]``."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.size(-1))
    causal = torch.ones(q.size(0), q.size(0), dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.size(0), -1)


def _full_inputs(shape_q, shape_kv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen) for s in (shape_q, shape_kv, shape_kv))
    grad_out = torch.randn((*shape_q[:-2], HEADS * DIM), generator=gen)
    return q, k, v, grad_out


def _module(cp: int) -> ContextParallelDotProductAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        context_parallel_size=cp,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self")


def _run_local(module, device, q, k, v, grad_out, **kwargs):
    """Forward and backward on ``device``; output and q/k/v gradients on the CPU."""
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    out = module(q, k, v, None, **kwargs)
    out.backward(grad_out.to(device))
    return tuple(t.detach().cpu() for t in (out, q.grad, k.grad, v.grad))


def bshd_worker(cp: int):
    """Attention over this rank's zigzag chunks of a full BSHD batch."""
    device = init_parallel(Layout(cp=cp))
    rank = torch.distributed.get_rank()
    q, k, v, grad_out = _full_inputs((SEQ, BATCH, HEADS, DIM), (SEQ, BATCH, GROUPS, DIM))
    pos = zigzag_placement(torch.tensor([0, SEQ]), cp, rank, SEQ // cp).position
    local = _run_local(_module(cp), device, q[pos], k[pos], v[pos], grad_out[pos])
    return pos, local


def thd_worker(cp: int):
    """Attention over this rank's zigzag chunks of every sequence of a packed batch."""
    device = init_parallel(Layout(cp=cp))
    rank = torch.distributed.get_rank()
    cu, cu_padded = _packed_offsets(cp)
    total = int(cu_padded[-1])
    q, k, v, grad_out = _full_inputs((total, HEADS, DIM), (total, GROUPS, DIM))
    index, seq, pos = zigzag_placement(cu_padded, cp, rank, total // cp)
    # No gradient flows in from padding tokens, as with a loss mask.
    real = pos < (cu[1:] - cu[:-1])[seq]
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu.to(device),
        cu_seqlens_kv=cu.to(device),
        cu_seqlens_q_padded=cu_padded.to(device),
        cu_seqlens_kv_padded=cu_padded.to(device),
        max_seqlen_q=int((cu_padded[1:] - cu_padded[:-1]).max()),
        max_seqlen_kv=int((cu_padded[1:] - cu_padded[:-1]).max()),
    )
    local = _run_local(
        _module(cp),
        device,
        q[index],
        k[index],
        v[index],
        grad_out[index] * real[:, None],
        packed_seq_params=params,
    )
    return index, local


def _packed_offsets(cp: int):
    multiple = 2 * cp if cp > 1 else 1
    padded = [n + (-n % multiple) for n in THD_LENGTHS]
    cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return cu, cu_padded


def _scatter(results, full_shapes):
    """Put every rank's local output and q/k/v gradients back at their global rows."""
    full = [torch.zeros(shape) for shape in full_shapes]
    for rows, local in results:
        for target, value in zip(full, local):
            target[rows] = value
    return full


@pytest.mark.parametrize("cp", [1, 2])
def test_bshd_matches_causal_attention(cp):
    results = run_workers(bshd_worker, cp, cp)
    q, k, v, grad_out = _full_inputs((SEQ, BATCH, HEADS, DIM), (SEQ, BATCH, GROUPS, DIM))
    out, dq, dk, dv = _scatter(results, [grad_out.shape, q.shape, k.shape, v.shape])
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.stack([_reference(q[:, b], k[:, b], v[:, b]) for b in range(BATCH)], dim=1)
    ref.backward(grad_out)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [1, 2])
def test_thd_matches_causal_attention_per_sequence(cp):
    results = run_workers(thd_worker, cp, cp)
    cu, cu_padded = _packed_offsets(cp)
    total = int(cu_padded[-1])
    q, k, v, grad_out = _full_inputs((total, HEADS, DIM), (total, GROUPS, DIM))
    out, dq, dk, dv = _scatter(results, [grad_out.shape, q.shape, k.shape, v.shape])
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    for i, length in enumerate(THD_LENGTHS):
        real = slice(int(cu_padded[i]), int(cu_padded[i]) + length)
        pad = slice(int(cu_padded[i]) + length, int(cu_padded[i + 1]))
        ref = _reference(q[real], k[real], v[real])
        ref.backward(grad_out[real])
        torch.testing.assert_close(out[real], ref.detach(), rtol=1e-5, atol=1e-5)
        # Padding is never attended to: its keys and values get no gradient.
        assert not dk[pad].any() and not dv[pad].any()
    real_rows = torch.cat(
        [torch.arange(int(cu_padded[i]), int(cu_padded[i]) + n) for i, n in enumerate(THD_LENGTHS)]
    )
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got[real_rows], want[real_rows], rtol=1e-5, atol=1e-5)


def masked_worker(mask):
    """BSHD attention without CP, with an explicit mask on top of the causal one."""
    device = init_parallel(Layout())
    q, k, v, grad_out = _full_inputs((SEQ, BATCH, HEADS, DIM), (SEQ, BATCH, GROUPS, DIM))
    q, k, v = (t.to(device) for t in (q, k, v))
    return _module(1)(q, k, v, mask.to(device)).cpu()


def test_explicit_mask_is_combined_with_causal():
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=gen) < 0.3
    mask &= ~torch.eye(SEQ, dtype=torch.bool)  # every query keeps itself
    (out,) = run_workers(masked_worker, 1, mask)
    q, k, v, _ = _full_inputs((SEQ, BATCH, HEADS, DIM), (SEQ, BATCH, GROUPS, DIM))
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(DIM)
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril() & ~mask
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(SEQ, BATCH, -1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def rejection_worker():
    """The error message of each unsupported use, as a list."""
    device = init_parallel(Layout())
    module = _module(1)
    q = torch.zeros(4, 1, HEADS, DIM, device=device)
    kv = torch.zeros(4, 1, GROUPS, DIM, device=device)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4], device=device))
    attempts = [
        lambda: module(q, kv, kv, None, attention_bias=torch.zeros(1, device=device)),
        lambda: module(
            q[:, 0],
            kv[:, 0],
            kv[:, 0],
            torch.zeros(1, 1, 4, 4, dtype=torch.bool, device=device),
            packed_seq_params=packed,
        ),
        lambda: module(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd")),
        lambda: ContextParallelDotProductAttention(
            module.config, 1, AttnMaskType.no_mask, "self"
        ),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as err:
            messages.append(str(err))
        else:
            messages.append(None)
    return messages


def test_rejects_unsupported_inputs():
    (messages,) = run_workers(rejection_worker, 1)
    assert "attention_bias" in messages[0]
    assert "attention_mask" in messages[1]
    assert "qkv_format" in messages[2]
    assert "causal" in messages[3]


def mask_reuse_worker():
    """Which forwards build the attention mask, and whether a reused mask gives the same output."""
    device = init_parallel(Layout())
    layers = [_module(1), _module(1)]
    builds = []
    build = ContextParallelDotProductAttention._build_allowed

    def counted(self, *args):
        builds.append(args[0])
        return build(self, *args)

    def params(lengths):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    total = sum(THD_LENGTHS)
    q, k, v, _ = _full_inputs((total, HEADS, DIM), (total, GROUPS, DIM))
    q, k, v = (t.to(device) for t in (q, k, v))
    ContextParallelDotProductAttention._build_allowed = counted
    try:
        first = params(THD_LENGTHS)
        outs = [layer(q, k, v, None, packed_seq_params=first) for layer in layers]  # two layers, one build
        counts = [len(builds)]
        other = params(THD_LENGTHS[::-1])  # other boundaries: a different mask
        other_out = layers[0](q, k, v, None, packed_seq_params=other)
        counts.append(len(builds))
        other.cu_seqlens_q.copy_(first.cu_seqlens_q)  # changed in place: built again
        again = layers[1](q, k, v, None, packed_seq_params=other)
        counts.append(len(builds))
        layers[0](q[:, None], k[:, None], v[:, None], None)  # BSHD, another key
        counts.append(len(builds))
    finally:
        ContextParallelDotProductAttention._build_allowed = build
    fresh = _module(1)._build_allowed(total, device, params(THD_LENGTHS))
    return counts, [o.cpu() for o in outs], other_out.cpu(), again.cpu(), fresh.cpu()


def test_layers_of_one_microbatch_build_the_mask_once():
    ((counts, outs, other_out, again, fresh),) = run_workers(mask_reuse_worker, 1)
    assert counts == [1, 2, 3, 4]
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(again, outs[0])  # the rebuilt mask is the packed one again
    assert not torch.allclose(other_out, outs[0])  # other boundaries, other attention
    cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()])
    seq = torch.bucketize(torch.arange(int(cu[-1])), cu[1:], right=True)
    expected = (seq[:, None] == seq[None, :]) & torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
    assert torch.equal(fresh, expected)


def dropout_fork_worker(attention_dropout, training):
    """How many times attention forks the CUDA RNG tracker in one forward."""
    from megatron.core import tensor_parallel

    device = init_parallel(Layout())
    module = _module(1)
    module.attention_dropout.p = attention_dropout
    module.train(training)
    forks = []
    tracker = tensor_parallel.get_cuda_rng_tracker()
    fork = tracker.fork

    def counting_fork(*args, **kwargs):
        forks.append(1)
        return fork(*args, **kwargs)

    tracker.fork = counting_fork
    try:
        q, k, v, _ = _full_inputs((SEQ, BATCH, HEADS, DIM), (SEQ, BATCH, GROUPS, DIM))
        module(q.to(device), k.to(device), v.to(device), None)
    finally:
        tracker.fork = fork
    return len(forks)


@pytest.mark.parametrize("attention_dropout, training, forks", [(0.0, True, 0), (0.1, False, 0), (0.1, True, 1)])
def test_attention_forks_the_rng_only_to_drop_out(attention_dropout, training, forks):
    """Without dropout no RNG state is read or set (a CUDA graph capture could not set it)."""
    assert run_workers(dropout_fork_worker, 1, attention_dropout, training) == [forks]
