"""Single-process Megatron fixtures for the routing-replay tests (gloo group of one)."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

NUM_EXPERTS = 8
TOPK = 2
VOCAB = 64


def init_single_rank():
    """One gloo rank with every model-parallel size 1 (idempotent)."""
    if not dist.is_initialized():
        # An in-memory store: a group of one needs no rendezvous (and no port).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def make_config(**overrides):
    """A tiny MoE config with replay on: dense first layer, three MoE layers."""
    kwargs = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=16,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        moe_layer_freq=[0, 1, 1, 1],
        add_bias_linear=False,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall",
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def make_model(config, seed=7):
    """A GPTModel with deterministic weights for ``seed``."""
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=64,
    )


def make_hybrid_model(config, hybrid_layer_pattern, seed=7):
    """A HybridModel of the local hybrid stack spec with deterministic weights for ``seed``
    (``config.num_layers`` is the pattern's length)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_r3.layers.hybrid_specs import get_hybrid_stack_r3_spec

    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
    return HybridModel(
        config,
        get_hybrid_stack_r3_spec(hybrid_layer_pattern, config.num_moe_experts),
        vocab_size=VOCAB,
        max_sequence_length=64,
        hybrid_layer_pattern=hybrid_layer_pattern,
        position_embedding_type="rope",
    )


def random_routes(num_layers, num_tokens, seed=0, num_experts=NUM_EXPERTS, topk=TOPK):
    """int64 [num_layers, num_tokens, topk] distinct random experts per token."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_layers, num_tokens, num_experts, generator=gen)
    return scores.topk(topk, dim=-1).indices.to(torch.int64)
