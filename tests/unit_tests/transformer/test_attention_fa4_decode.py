# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""FlashAttention-4 decodes without split KV on SM90.

FA4 has no split-KV kernel on SM90 and asserts where its split heuristic (``num_splits=0``)
picks more than one split, so the dynamic engine's decode-only call asks for one split there,
and for the heuristic on other architectures (unless batch-invariant mode asks for one).
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


def _decode_splits(module, monkeypatch, capability, batch_invariant=False):
    """The num_splits the decode-only FA4 call asks for on a device of ``capability``."""
    asked = []

    def kernel(q, k, v, **kwargs):
        asked.append(kwargs["num_splits"])
        return torch.zeros_like(q), None

    monkeypatch.setattr(attention, "flash_attn4_varlen_func", kernel, raising=False)
    monkeypatch.setattr(module, "_resolve_flash_version", lambda: (True, False))
    monkeypatch.setattr(module, "batch_invariant_mode", batch_invariant)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    q = torch.randn(REQUESTS, 1, HEADS, HEAD_DIM)
    cache = torch.randn(2, 256, HEADS, HEAD_DIM)  # blocks of 256 tokens
    seqlens = torch.tensor([300, 5, 129], dtype=torch.int32)
    module.flash_decode_and_prefill(
        q, cache, cache, max_seqlen_q=1, max_seqlen_k=300,
        cu_seqlens_q=torch.arange(REQUESTS + 1, dtype=torch.int32), cu_seqlens_k=None, seqlens_k=seqlens,
        block_table=torch.tensor([[0, 1], [0, 0], [1, 0]], dtype=torch.int32), is_decode_only=True)
    (splits,) = asked
    return splits


@pytest.mark.parametrize("capability, splits", [((9, 0), 1), ((10, 0), 0), ((8, 0), 0)])
def test_fa4_decodes_with_one_split_on_sm90_only(self_attention, monkeypatch, capability, splits):
    assert _decode_splits(self_attention, monkeypatch, capability) == splits


def test_batch_invariant_mode_asks_for_one_split_everywhere(self_attention, monkeypatch):
    assert _decode_splits(self_attention, monkeypatch, (10, 0), batch_invariant=True) == 1
