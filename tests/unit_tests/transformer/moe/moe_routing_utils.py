"""Helpers shared by the MoERouting unit tests of GPTModel and HybridModel: a batch, random
routes, the routing maps every router produced, and one forward (and backward) of a model."""

from contextlib import contextmanager

import torch

from megatron.core.transformer.moe.router import TopKRouter

NUM_EXPERTS = 8
TOPK = 2
HIDDEN = 32
VOCAB = 64

def make_batch(batch_size=2, seq=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch_size, seq), generator=gen)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch_size, -1)
    return tokens, position_ids, labels


def random_routes(num_layers, num_tokens, seed=0):
    """int64 [num_layers, num_tokens, TOPK]: distinct random experts per token."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(num_layers, num_tokens, NUM_EXPERTS, generator=gen).topk(TOPK, -1).indices


def as_routing_map(ids):
    return torch.zeros(ids.shape[0], NUM_EXPERTS, dtype=torch.bool).scatter(1, ids, True)


@contextmanager
def routing_maps(model):
    """{router layer: [routing_map per call]} of every router of the model."""
    seen = {}
    handles = []
    for module in model.modules():
        if isinstance(module, TopKRouter):

            def hook(router, args, output):
                seen.setdefault(router.moe_routing_layer_number, []).append(output[1].clone())

            handles.append(module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def run_model(model, batch, routing, backward=True):
    tokens, position_ids, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(
        tokens, position_ids, None, labels=labels, extra_block_kwargs={"moe_routing": routing}
    )
    if backward:
        loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if backward}
