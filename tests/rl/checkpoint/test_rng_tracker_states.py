"""Megatron's RNG tracker states in a checkpoint: tensors under either tracker kind (the default one holds
tensors, the graph-safe one that Megatron's engine's CUDA graphs need holds generators)."""

import pytest
import torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

from megatron_r3.rl.checkpoint.rng import set_tracker_states, tracker_states


class GraphSafeTracker:
    """A graph-safe tracker's interface (``use_cudagraphable_rng``: its states are generators, which CUDA
    graphs and forks read in place); CPU generators stand in for the CUDA ones."""

    use_cudagraphable_rng = True

    def __init__(self, seeds: dict[str, int]):
        self.states_ = {name: torch.Generator().manual_seed(seed) for name, seed in seeds.items()}

    def get_states(self):
        return dict(self.states_)


def _draw(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(4, generator=generator)


def test_a_graph_safe_trackers_states_save_as_tensors_and_restore_into_its_own_generators():
    tracker = GraphSafeTracker({"model-parallel-rng": 1, "expert-parallel-rng": 2})
    generators = tracker.get_states()
    saved = tracker_states(tracker)
    assert all(isinstance(state, torch.Tensor) for state in saved.values())
    expected = {name: _draw(g) for name, g in generators.items()}  # advances them past the saved states
    set_tracker_states(tracker, saved)
    assert tracker.get_states() == generators  # the same generator objects, which captured graphs read
    for name, generator in generators.items():
        assert torch.equal(_draw(generator), expected[name])


def test_states_move_between_the_two_tracker_kinds():
    graph_safe = GraphSafeTracker({"model-parallel-rng": 3})
    default = CudaRNGStatesTracker()
    set_tracker_states(default, tracker_states(graph_safe))
    restored = tracker_states(default)["model-parallel-rng"]
    assert torch.equal(restored, graph_safe.get_states()["model-parallel-rng"].get_state())
    expected = _draw(graph_safe.get_states()["model-parallel-rng"])
    other = GraphSafeTracker({"model-parallel-rng": 9})
    set_tracker_states(other, {"model-parallel-rng": restored})
    assert torch.equal(_draw(other.get_states()["model-parallel-rng"]), expected)


def test_a_graph_safe_tracker_refuses_states_of_other_names():
    tracker = GraphSafeTracker({"model-parallel-rng": 1, "expert-parallel-rng": 2})
    with pytest.raises(ValueError, match=r"checkpoint's RNG tracker states are \['model-parallel-rng'\], this "
                                         r"run's tracker has \['expert-parallel-rng', 'model-parallel-rng'\]"):
        set_tracker_states(tracker, {"model-parallel-rng": torch.Generator().get_state()})
