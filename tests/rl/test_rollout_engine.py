"""The rollout engine's lookup of each sample's last position among a rank's local tokens."""

import numpy as np
import pytest
import torch

from megatron_r3.layers.context_parallel import zigzag_placement
from megatron_r3.rl.rollout_engine import _local_positions


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_positions_find_each_held_position_on_its_cp_rank(cp):
    rng = np.random.default_rng(cp)
    lengths = rng.integers(1, 30, size=7) * 2 * cp  # padded to a multiple of 2 * cp
    cu = torch.tensor([0, *np.cumsum(lengths)])
    positions = rng.choice(int(cu[-1]), size=12, replace=False)
    owners = {}
    for rank in range(cp):
        row_index = zigzag_placement(cu, cp, rank, int(cu[-1]) // cp).index.numpy()
        held, local = _local_positions(row_index, positions)
        expected = [(i, int(np.flatnonzero(row_index == p)[0])) for i, p in enumerate(positions) if p in row_index]
        assert list(zip(held.tolist(), local.tolist())) == expected
        for i in held.tolist():
            assert i not in owners
            owners[i] = rank
    assert sorted(owners) == list(range(len(positions)))  # every position on exactly one rank


def test_no_local_token_holds_nothing():
    held, local = _local_positions(np.zeros(0, dtype=np.int64), np.array([3, 5]))
    assert held.size == 0 and local.size == 0
