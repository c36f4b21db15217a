# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""rope: apply THD rotary embeddings without host syncs.

The patched ``_apply_rotary_pos_emb_thd`` must give, bit for bit, what applying the
embedding sequence by sequence gives (the reference below, written from the layout
``_get_thd_freqs_on_this_cp_rank`` documents), for both frequency formats and every CP
rank; on a GPU it must not wait for the device.
"""

import pytest
import torch

from megatron.core.models.common.embeddings.rope_utils import (
    _apply_rotary_pos_emb_bshd,
    _apply_rotary_pos_emb_thd,
)

from tests.support.fake_group import FakeGroup


def _reference(t, cu_seqlens, freqs, cp_size, cp_rank, packed_freqs):
    """Sequence by sequence: this rank's chunks cp_rank and 2 * cp_size - 1 - cp_rank."""
    out, start = [], 0
    for begin, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        length = end - begin
        chunk = length // (2 * cp_size)
        positions = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
        positions += list(range((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk))
        positions = torch.tensor(positions) + (begin if packed_freqs else 0)
        piece = t[start : start + len(positions)]
        out.append(_apply_rotary_pos_emb_bshd(piece.unsqueeze(1), freqs[positions]).squeeze(1))
        start += len(positions)
    return torch.cat(out)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("packed_freqs", [False, True], ids=["per-sequence-freqs", "packed-freqs"])
def test_thd_rope_equals_the_per_sequence_application(cp_size, packed_freqs):
    gen = torch.Generator().manual_seed(cp_size)
    for _ in range(10):
        lengths = torch.randint(1, 6, (int(torch.randint(1, 5, (), generator=gen)),), generator=gen)
        lengths = lengths * 2 * cp_size
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
        total = int(cu_seqlens[-1])
        # An odd max length never equals an (even) packed length: the two formats stay apart.
        freqs = torch.randn(total if packed_freqs else 161, 1, 1, 8, generator=gen)
        for cp_rank in range(cp_size):
            t = torch.randn(total // cp_size, 3, 8, generator=gen)
            got = _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup(cp_size, cp_rank))
            want = _reference(t, cu_seqlens, freqs, cp_size, cp_rank, packed_freqs)
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_thd_rope_does_not_sync_the_device():
    cu_seqlens = torch.tensor([0, 8, 24, 28], dtype=torch.int32, device="cuda")
    freqs = torch.randn(64, 1, 1, 8, device="cuda")
    t = torch.randn(14, 3, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup(2, 1))
    finally:
        torch.cuda.set_sync_debug_mode("default")


class TestThdPackedLengthCheck:
    """rope: the packed length is the local token count times cp_size; checked on the host."""

    def test_cu_seqlens_longer_than_the_tokens_are_refused(self):
        t = torch.randn(16, 2, 8)
        freqs = torch.randn(32, 1, 1, 8)
        cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
        with pytest.raises(ValueError, match="cu_seqlens ends at 20, but this rank holds 16"):
            _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup())

    def test_cu_seqlens_shorter_than_the_tokens_are_refused(self):
        t = torch.randn(16, 2, 8)
        freqs = torch.randn(32, 1, 1, 8)
        cu_seqlens = torch.tensor([0, 4, 12], dtype=torch.int32)
        with pytest.raises(ValueError, match="cu_seqlens ends at 12"):
            _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup())

    def test_sequences_not_padded_to_twice_cp_are_refused(self):
        t = torch.randn(8, 2, 8)  # rank 0 of cp 2: half of 16 tokens
        freqs = torch.randn(32, 1, 1, 8)
        cu_seqlens = torch.tensor([0, 6, 16], dtype=torch.int32)
        with pytest.raises(ValueError, match="multiple of 2 \\* cp_size = 4"):
            _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=FakeGroup(2, 0))
