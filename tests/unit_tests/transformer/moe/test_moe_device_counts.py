# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""The alltoall dispatcher leaves token counts on the device at one tp_ep rank.

With one rank in the expert tensor-and-model-parallel group and dropless routing, the
dispatcher hands the experts the counts where the router made them, whatever the experts
class: it copies nothing to the host and waits for nothing. Upstream's SequentialMLP reads
them back itself, and the model computes what it computed before, forward and backward.
"""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

VOCAB = 64


def _gpt(seed=3, **overrides):
    fields = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1, 1],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    config = TransformerConfig(**fields)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    torch.manual_seed(seed)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64)


def _moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _batch():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 16), generator=gen)
    return tokens, torch.arange(16).unsqueeze(0).expand(2, -1), labels


def _loss_and_grads(model, batch):
    tokens, position_ids, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def single_rank():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def host_copies(monkeypatch):
    """Counts the dispatcher's device-to-host copies and its sorts by local expert."""
    calls = {"copies": 0, "sorts": 0}
    copy, sort = token_dispatcher.maybe_move_tensor_to_cpu, token_dispatcher.sort_chunks_by_idxs

    def counting_copy(*args, **kwargs):
        calls["copies"] += 1
        return copy(*args, **kwargs)

    def counting_sort(*args, **kwargs):
        calls["sorts"] += 1
        return sort(*args, **kwargs)

    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", counting_copy)
    monkeypatch.setattr(token_dispatcher, "sort_chunks_by_idxs", counting_sort)
    return calls


def test_upstream_experts_get_the_counts_on_the_device(single_rank):
    layers = _moe_layers(_gpt())
    assert len(layers) == 2 and all(isinstance(m.experts, SequentialMLP) for m in layers)
    assert all(layer.token_dispatcher.counts_stay_on_device() for layer in layers)


def test_device_counts_give_identical_results_without_copies(single_rank, host_copies, monkeypatch):
    # Negative control: the dispatcher's path that copies the counts to the host and waits.
    with monkeypatch.context() as patched:
        patched.setattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "counts_stay_on_device",
                        lambda self: False)
        want_loss, want_grads = _loss_and_grads(_gpt(), _batch())
    assert host_copies["copies"] > 0
    host_copies.update(copies=0, sorts=0)
    loss, grads = _loss_and_grads(_gpt(), _batch())
    assert host_copies == {"copies": 0, "sorts": 0}  # one rank: the sort by local expert is the identity
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


def test_the_fused_permutation_at_one_rank_keeps_the_counts_on_the_device(single_rank):
    """TE's fused permutation permutes by the routing map into num_tokens * topk rows: from one
    tp_ep rank it needs no count on the host either."""
    model = _gpt()
    model.config.moe_permute_fusion = True  # after the build: building it needs TransformerEngine
    layers = _moe_layers(model)
    assert all(layer.token_dispatcher.config is model.config for layer in layers)
    assert all(layer.token_dispatcher.counts_stay_on_device() for layer in layers)
    model.config.moe_expert_capacity_factor = 1.0  # dropping still needs them
    assert not any(layer.token_dispatcher.counts_stay_on_device() for layer in layers)


@pytest.mark.parametrize("option", [
    dict(moe_expert_capacity_factor=1.0),
    dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
], ids=["capacity", "pad-to-capacity"])
def test_dropping_tokens_keeps_the_device_path_off(single_rank, option):
    """With a capacity the number of routed tokens is known only on the device."""
    assert not any(layer.token_dispatcher.counts_stay_on_device() for layer in _moe_layers(_gpt(**option)))


def test_capacity_dropping_still_reads_the_counts_back(single_rank, host_copies):
    _loss_and_grads(_gpt(moe_expert_capacity_factor=1.0), _batch())
    assert host_copies["copies"] > 0
