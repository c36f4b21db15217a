# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""The alltoall dispatcher at one tp_ep rank (the dispatcher-host-sync pull request).

With one rank in the expert tensor-and-model-parallel group the sort by local expert is the
identity and is skipped (0001), and with dropless routing the dispatcher hands the experts the
counts where the router made them, whatever the experts class: it copies nothing to the host
and waits for nothing (0002). Upstream's SequentialMLP reads them back itself, and the model
computes what it computed before, forward and backward.
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


def _dispatchers(model):
    return [layer.token_dispatcher for layer in _moe_layers(model)]


def test_one_rank_skips_the_identity_sort_by_local_expert(single_rank, host_copies):
    """dispatcher-host-sync 0001: from one tp_ep rank the tokens reach the experts as the
    permutation leaves them; the sort by local expert (the identity there) is skipped."""
    model = _gpt()
    assert all(not d.sort_by_local_expert for d in _dispatchers(model))
    loss, grads = _loss_and_grads(model, _batch())
    assert host_copies["sorts"] == 0
    # Negative control: the same model made to sort (and to read the counts back for it).
    sorting = _gpt()
    for dispatcher in _dispatchers(sorting):
        dispatcher.sort_by_local_expert, dispatcher.counts_stay_on_device = True, False
    want_loss, want_grads = _loss_and_grads(sorting, _batch())
    assert host_copies["sorts"] == 4  # 2 MoE layers, a sort and its inverse
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


def test_upstream_experts_get_the_counts_on_the_device(single_rank, monkeypatch):
    """dispatcher-host-sync 0002: SequentialMLP receives the counts on the model's device."""
    model = _gpt()
    layers = _moe_layers(model)
    assert len(layers) == 2 and all(isinstance(m.experts, SequentialMLP) for m in layers)
    assert all(d.counts_stay_on_device for d in _dispatchers(model))
    seen = []
    forward = SequentialMLP.forward

    def recording_forward(self, hidden, tokens_per_expert, *args, **kwargs):
        seen.append(tokens_per_expert)
        return forward(self, hidden, tokens_per_expert, *args, **kwargs)

    monkeypatch.setattr(SequentialMLP, "forward", recording_forward)
    # The dispatcher's copy would leave a host tensor whatever the device: tell them apart by
    # identity with what the router's counts became, the device tensor preprocess() made.
    made = []
    preprocess = token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess
    monkeypatch.setattr(
        token_dispatcher.MoEAlltoAllTokenDispatcher, "preprocess",
        lambda self, routing_map: made.append(preprocess(self, routing_map)) or made[-1],
    )
    _loss_and_grads(model, _batch())
    assert len(seen) == 2 and all(a is b for a, b in zip(seen, made))


def test_device_counts_give_identical_results_without_copies(single_rank, host_copies):
    # Negative control: the dispatcher's path that copies the counts to the host and waits.
    copying = _gpt()
    for dispatcher in _dispatchers(copying):
        dispatcher.counts_stay_on_device = False
    want_loss, want_grads = _loss_and_grads(copying, _batch())
    assert host_copies["copies"] > 0
    host_copies.update(copies=0, sorts=0)
    loss, grads = _loss_and_grads(_gpt(), _batch())
    assert host_copies == {"copies": 0, "sorts": 0}
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize("option", [
    dict(moe_expert_capacity_factor=1.0),
    dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
], ids=["capacity", "pad-to-capacity"])
def test_dropping_tokens_keeps_the_device_path_off(single_rank, option):
    """With a capacity the number of routed tokens is known only on the device."""
    assert not any(d.counts_stay_on_device for d in _dispatchers(_gpt(**option)))


def test_capacity_dropping_still_reads_the_counts_back(single_rank, host_copies):
    _loss_and_grads(_gpt(moe_expert_capacity_factor=1.0), _batch())
    assert host_copies["copies"] > 0
