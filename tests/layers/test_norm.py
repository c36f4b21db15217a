"""SequenceParallelNorm: torch's LayerNorm/RMSNorm math, parameters marked for the SP all-reduce."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.norm import SequenceParallelNorm

HIDDEN = 16


def _config(**fields):
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, **fields)


@pytest.mark.parametrize(
    "normalization, torch_norm",
    [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)],
)
def test_matches_torch_norm(normalization, torch_norm):
    norm = SequenceParallelNorm(_config(normalization=normalization), HIDDEN, eps=1e-5)
    reference = torch_norm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        for ours, theirs in zip(norm.parameters(), reference.parameters(), strict=True):
            theirs.copy_(torch.randn_like(theirs))
            ours.copy_(theirs)
    x = torch.randn(6, 2, HIDDEN)
    torch.testing.assert_close(norm(x), reference(x))


def test_zero_centered_gamma_stores_gamma_minus_one():
    norm = SequenceParallelNorm(_config(layernorm_zero_centered_gamma=True), HIDDEN)
    assert not norm.weight.any()
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (HIDDEN,)))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parameters_marked_for_tp_all_reduce(sequence_parallel):
    config = _config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    norm = SequenceParallelNorm(config, HIDDEN)
    assert [p.sequence_parallel for p in norm.parameters()] == [sequence_parallel] * 2


def test_rejects_other_normalizations():
    with pytest.raises(ValueError, match="L2Norm"):
        SequenceParallelNorm(_config(normalization="L2Norm"), HIDDEN)
