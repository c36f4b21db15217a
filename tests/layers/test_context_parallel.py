"""zigzag_placement, the one context-parallel token placement, against a brute-force split."""

import numpy as np
import pytest
import torch

from megatron_r3.layers.context_parallel import zigzag_placement, zigzag_placement_host


def _brute_force(padded_lens, cp_size, cp_rank):
    """(index, seq_id, position) of rank ``cp_rank``'s tokens: cut, pick chunks, concatenate."""
    index, seq_id, position = [], [], []
    start = 0
    for seq, length in enumerate(padded_lens):
        chunks = np.array_split(np.arange(length), 2 * cp_size) if cp_size > 1 else [np.arange(length)]
        picked = [chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]] if cp_size > 1 else chunks
        for pos in np.concatenate(picked):
            index.append(start + pos)
            seq_id.append(seq)
            position.append(pos)
        start += length
    return index, seq_id, position


def _placement(padded_lens, cp_size, cp_rank):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(padded_lens)]), dtype=torch.int32)
    placement = zigzag_placement(cu, cp_size, cp_rank, int(sum(padded_lens)) // cp_size)
    return [t.tolist() for t in placement]


def test_bshd_and_thd_examples():
    # 16 tokens, CP=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert _placement([16], 2, 0)[2] == [0, 1, 2, 3, 12, 13, 14, 15]
    assert _placement([16], 2, 1)[2] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert _placement([8, 4], 2, 0) == [[0, 1, 6, 7, 8, 11], [0, 0, 0, 0, 1, 1], [0, 1, 6, 7, 0, 3]]
    assert _placement([8, 4], 2, 1)[0] == [2, 3, 4, 5, 9, 10]
    assert _placement([8, 4], 1, 0) == [list(range(12)), [0] * 8 + [1] * 4, [*range(8), *range(4)]]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_matches_brute_force_on_random_lengths(cp_size):
    rng = np.random.default_rng(cp_size)
    for _ in range(50):
        # Lengths a multiple of 2*cp (any length without CP), odd and even multiples, empty sequences too.
        unit = 2 * cp_size if cp_size > 1 else 1
        padded = (rng.integers(0, 9, size=int(rng.integers(1, 8))) * unit).tolist()
        if sum(padded) == 0:
            padded[0] = unit
        seen = []
        for cp_rank in range(cp_size):
            got = _placement(padded, cp_size, cp_rank)
            assert got == [list(map(int, x)) for x in _brute_force(padded, cp_size, cp_rank)], (padded, cp_rank)
            seen += got[0]
        assert sorted(seen) == list(range(sum(padded)))


def test_odd_lengths_without_context_parallelism():
    assert _placement([5, 3, 1], 1, 0) == [list(range(9)), [0] * 5 + [1] * 3 + [2], [*range(5), *range(3), 0]]


def test_reads_nothing_back_to_the_host():
    # Meta tensors hold no values: any read back to the host (a sync on a GPU) would raise.
    device = torch.device("meta")
    placement = zigzag_placement(torch.tensor([0, 8, 16], device=device), 2, 1, 8)
    assert all(t.device == device and t.shape == (8,) for t in placement)


@pytest.mark.gpu
@pytest.mark.parametrize("cp_size", [2, 4])
def test_placement_equals_transformer_engines_thd_partition(cp_size):
    """The data plane places each CP rank's THD tokens (and so their routes) where TransformerEngine's
    attention expects them: ``thd_get_partitioned_indices``, on random packings."""
    tex = pytest.importorskip("transformer_engine_torch", reason="needs TransformerEngine")
    gen = np.random.default_rng(cp_size)
    for _ in range(20):
        lens = gen.integers(1, 40, size=int(gen.integers(1, 9)))
        padded = -(-lens // (2 * cp_size)) * (2 * cp_size)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32, device="cuda")
        total = int(padded.sum())
        for cp_rank in range(cp_size):
            ours = zigzag_placement(cu, cp_size, cp_rank, total // cp_size).index
            theirs = tex.thd_get_partitioned_indices(cu, total, cp_size, cp_rank)
            assert torch.equal(ours.cpu(), theirs.to(torch.int64).cpu()), (padded.tolist(), cp_rank)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_host_placement_equals_the_device_one(cp_size):
    """zigzag_placement_host (numpy, the data plane's) gives zigzag_placement's tensors on random packings,
    empty sequences and odd lengths (without CP) included."""
    rng = np.random.default_rng(10 + cp_size)
    for _ in range(100):
        unit = 2 * cp_size if cp_size > 1 else 1
        padded = (rng.integers(0, 40, size=int(rng.integers(1, 12))) * unit).tolist()
        if cp_size == 1:
            padded = rng.integers(0, 300, size=int(rng.integers(1, 12))).tolist()
        for cp_rank in range(cp_size):
            host = zigzag_placement_host(padded, cp_size, cp_rank)
            device = _placement(padded, cp_size, cp_rank)
            assert [a.dtype for a in host] == [np.int64] * 3
            assert [a.tolist() for a in host] == device, (padded, cp_rank)
