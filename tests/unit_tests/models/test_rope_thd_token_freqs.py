# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""rope: gather THD token frequencies once per packed batch.

Every attention layer applies RoPE to the queries and keys of the same packed batch. The
per-token frequencies are gathered once and reused while ``cu_seqlens`` and ``freqs`` are the
same tensors at the same version; anything else gathers again, and the result is always what
a fresh gather gives.
"""

import pytest
import torch

from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rope_utils import (
    _apply_rotary_pos_emb_bshd,
    _apply_rotary_pos_emb_thd,
)

from tests.support.fake_group import FakeGroup


@pytest.fixture
def gathers(monkeypatch):
    """How many times the token positions are computed."""
    calls = []
    original = rope_utils._thd_positions_on_this_cp_rank

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(rope_utils, "_thd_positions_on_this_cp_rank", counting)
    return calls


def _fresh(t, cu_seqlens, freqs):
    """RoPE with positions within each sequence, computed from scratch on the host."""
    positions = torch.cat([torch.arange(int(n)) for n in cu_seqlens[1:] - cu_seqlens[:-1]])
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions]).squeeze(1)


def test_the_layers_of_one_packed_batch_gather_once(gathers):
    cu_seqlens = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    freqs = torch.randn(33, 1, 1, 8)
    for _ in range(4):  # layers, each with its queries and keys
        q, k = torch.randn(16, 4, 8), torch.randn(16, 2, 8)
        assert torch.equal(_apply_rotary_pos_emb_thd(q, cu_seqlens, freqs, cp_group=FakeGroup()),
                           _fresh(q, cu_seqlens, freqs))
        assert torch.equal(_apply_rotary_pos_emb_thd(k, cu_seqlens, freqs, cp_group=FakeGroup()),
                           _fresh(k, cu_seqlens, freqs))
    assert len(gathers) == 1


def test_another_batch_or_a_changed_one_gathers_again(gathers):
    cu_seqlens = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    freqs = torch.randn(33, 1, 1, 8)
    t = torch.randn(16, 4, 8)
    _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup())
    same_values = cu_seqlens.clone()  # another batch of the same lengths: another tensor
    _apply_rotary_pos_emb_thd(t, same_values, freqs, cp_group=FakeGroup())
    assert len(gathers) == 2
    same_values[1:3] = torch.tensor([9, 10], dtype=torch.int32)  # lengths 9, 1, 6
    assert torch.equal(_apply_rotary_pos_emb_thd(t, same_values, freqs, cp_group=FakeGroup()),
                       _fresh(t, same_values, freqs))
    freqs.mul_(2)
    assert torch.equal(_apply_rotary_pos_emb_thd(t, same_values, freqs, cp_group=FakeGroup()),
                       _fresh(t, same_values, freqs))
    assert len(gathers) == 4
    halves = torch.tensor([0, 8, 16], dtype=torch.int32)
    _apply_rotary_pos_emb_thd(t, halves, freqs, cp_group=FakeGroup())
    _apply_rotary_pos_emb_thd(t[:8], halves, freqs, cp_group=FakeGroup(2, 0))  # under CP 2: half the tokens
    assert len(gathers) == 6


def test_learned_frequencies_are_gathered_every_time_and_get_gradients(gathers):
    cu_seqlens = torch.tensor([0, 6, 10], dtype=torch.int32)
    freqs = torch.randn(16, 1, 1, 8, requires_grad=True)
    t = torch.randn(10, 2, 8)
    out = [_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup()) for _ in range(2)]
    assert len(gathers) == 2
    (grad,) = torch.autograd.grad(sum(o.sum() for o in out), freqs)
    (want,) = torch.autograd.grad(2 * _fresh(t, cu_seqlens, freqs).sum(), freqs)
    assert torch.allclose(grad, want)


def test_inference_mode_gathers_without_a_version_counter(gathers):
    """Megatron's inference runs under torch.inference_mode(): its tensors have no version."""
    with torch.inference_mode():
        cu_seqlens = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
        freqs = torch.randn(33, 1, 1, 8)
        for _ in range(2):
            t = torch.randn(16, 4, 8)
            assert torch.equal(_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup()),
                               _fresh(t, cu_seqlens, freqs))
    # Inference tensors made outside inference mode: still no version counter to read.
    t = torch.randn(16, 4, 8)
    assert torch.equal(_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup()),
                       _fresh(t, cu_seqlens, freqs))
    assert len(gathers) == 3


def test_frequencies_gathered_under_inference_mode_are_not_reused_for_training(gathers):
    cu_seqlens = torch.tensor([0, 6, 10], dtype=torch.int32)
    freqs = torch.randn(16, 1, 1, 8)
    with torch.inference_mode():
        _apply_rotary_pos_emb_thd(torch.randn(10, 2, 8), cu_seqlens, freqs, cp_group=FakeGroup())
    t = torch.randn(10, 2, 8, requires_grad=True)
    out = _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup())
    (grad,) = torch.autograd.grad(out.sum(), t)
    (want,) = torch.autograd.grad(_fresh(t, cu_seqlens, freqs).sum(), t)
    assert torch.equal(grad, want)


@pytest.mark.gpu
def test_a_cuda_graph_capture_gathers_from_its_own_inputs():
    """Frequencies gathered before a capture, from the same tensors, are not baked into it."""
    cu_seqlens = torch.tensor([0, 5, 12, 16], dtype=torch.int32, device="cuda")
    freqs = torch.randn(33, 1, 1, 8, device="cuda")
    t = torch.randn(16, 4, 8, device="cuda")
    _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup())  # gathered for these values
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup())
    outputs = []
    for lengths in ([0, 5, 12, 16], [0, 9, 10, 16], [0, 16, 16, 16]):
        cu_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        fresh = _apply_rotary_pos_emb_thd(t, cu_seqlens.clone(), freqs, cp_group=FakeGroup())  # another tensor
        assert torch.equal(out, fresh)
        outputs.append(out.clone())
    assert not torch.equal(outputs[0], outputs[1])  # the lengths change the result
