# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""FlashAttention-4 calls ask for one KV split on SM90.

FA4 has no split-KV kernel on SM90 and asserts where its split heuristic (``num_splits=0``)
picks more than one split, so the dynamic engine's FA4 calls, decode-only and with prefill
requests, ask for one split there, and for the heuristic on other architectures (unless
batch-invariant mode asks for one).
The kernel is replaced by a recorder: what is checked is the split count it is asked for.
"""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import attention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

HEADS, HEAD_DIM, REQUESTS = 4, 16, 3


@pytest.fixture
def self_attention():
    Utils.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=64)
    module = model.decoder.layers[0].self_attention
    module.eval()
    yield module
    Utils.destroy_model_parallel()


def _splits(module, monkeypatch, capability, batch_invariant=False, decode_only=True):
    """The num_splits the FA4 call of flash_decode_and_prefill asks for on a device of
    ``capability``: the decode-only call, or the one for a batch with prefill requests."""
    asked = []

    def kernel(q, k, v, **kwargs):
        asked.append(kwargs["num_splits"])
        return torch.zeros_like(q), None

    monkeypatch.setattr(attention, "flash_attn4_varlen_func", kernel, raising=False)
    monkeypatch.setattr(module, "_resolve_flash_version", lambda: (True, False))
    monkeypatch.setattr(module, "batch_invariant_mode", batch_invariant)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # Three requests whose KV spans several key tiles (blocks of 256 tokens); a prefill batch
    # adds 4 + 1 + 2 new tokens to them.
    new_tokens = [1, 1, 1] if decode_only else [4, 1, 2]
    q = torch.randn(sum(new_tokens), 1, HEADS, HEAD_DIM)
    cache = torch.randn(2, 256, HEADS, HEAD_DIM)
    seqlens = torch.tensor([300, 5, 129], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    module.flash_decode_and_prefill(
        q, cache, cache, max_seqlen_q=max(new_tokens), max_seqlen_k=300,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=None, seqlens_k=seqlens,
        block_table=torch.tensor([[0, 1], [0, 0], [1, 0]], dtype=torch.int32),
        is_decode_only=decode_only)
    (splits,) = asked
    return splits


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("capability, splits", [((9, 0), 1), ((10, 0), 0), ((8, 0), 0)])
def test_fa4_asks_for_one_split_on_sm90_only(self_attention, monkeypatch, capability, splits,
                                             decode_only):
    """The prefill call asked for the heuristic on SM90 too (num_splits=0) before."""
    assert _splits(self_attention, monkeypatch, capability, decode_only=decode_only) == splits


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
def test_batch_invariant_mode_asks_for_one_split_everywhere(self_attention, monkeypatch, decode_only):
    assert _splits(self_attention, monkeypatch, (10, 0), batch_invariant=True,
                   decode_only=decode_only) == 1
