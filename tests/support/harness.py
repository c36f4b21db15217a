"""One training step of the tiny MoE GPT under a layout, and its results in full form.

``run_layout`` is the worker (start it with ``launcher.run_workers``); the parent
turns what the ranks return into layout-independent tensors with
``full_token_losses`` and ``full_grads`` and compares them with a single-rank run.
"""

import contextlib
import dataclasses
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from tests.support.batches import Sequences, bshd_microbatches, thd_microbatches
from tests.support.parallel import Layout, init_parallel
from tests.support.schedule import forward_backward
from tests.support.tiny_moe import TinyMoE, build_gpt, make_config
from tests.support.weights import assemble, grad_shards, reduce_grads


@dataclasses.dataclass(frozen=True)
class Step:
    """What one run does, besides the layout.

    Attributes:
        model: Model hyper-parameters.
        seed: Weight seed.
        micro_batch_size: Sequences per microbatch (BSHD) or per pack (THD).
        forward_only: Skip the backward pass (no gradients returned).
        config_overrides: Extra ``TransformerConfig`` fields, as a tuple of pairs.
    """

    model: TinyMoE = TinyMoE()
    seed: int = 0
    micro_batch_size: int = 2
    forward_only: bool = False
    config_overrides: tuple = ()


def run_layout(layout: Layout, data: Sequences, step: Step = Step()) -> dict:
    """Worker: one forward/backward of the tiny MoE GPT on ``data`` under ``layout``.

    Builds the model chunks of this rank (weights from ``step.seed``), slices
    ``data`` for this rank (BSHD, or THD when ``layout.packed``), runs Megatron's
    schedule, sums gradients across ranks like Megatron's DDP and
    ``finalize_model_grads``, and returns:

    * ``"losses"``: ``(token_index, per_token_loss)`` 1-D CPU tensors of the tokens
      this rank computed a loss for (last pipeline stage; padding dropped);
    * ``"grads"``: ``[(Shard, grad)]`` of every local parameter (unless forward-only);
    * ``"router_margins"``: ``{layer: min top-k margin}`` over the MoE layers this
      rank ran, see :func:`record_router_margins`.
    """
    device = init_parallel(layout)
    try:
        config = make_config(layout, step.model, **dict(step.config_overrides))
        chunks = build_gpt(config, step.model, step.seed, device)
        if layout.packed:
            microbatches = thd_microbatches(
                data, step.micro_batch_size, sequence_parallel=layout.sp, device=device
            )
        else:
            microbatches = bshd_microbatches(data, step.micro_batch_size, device=device)
        with record_router_margins(chunks) as margins:
            results = forward_backward(chunks, microbatches, forward_only=step.forward_only)
        out = {"losses": _local_losses(results), "router_margins": margins}
        if not step.forward_only:
            reduce_grads(chunks, config)
            out["grads"] = grad_shards(chunks)
        return out
    finally:
        parallel_state.destroy_model_parallel()


def _local_losses(results: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    if not results:
        return torch.empty(0, dtype=torch.long), torch.empty(0)
    index = torch.cat([r["token_index"].reshape(-1) for r in results]).cpu()
    loss = torch.cat([r["per_token_loss"].reshape(-1) for r in results]).float().cpu()
    real = index >= 0
    return index[real], loss[real]


@contextlib.contextmanager
def record_router_margins(chunks):
    """Record, per MoE layer, the smallest top-k margin of the router's decisions.

    The margin of a token is ``logit[k-th best] - logit[(k+1)-th best]``: how far
    its routing is from a tie. Yields a dict ``{global layer index: margin}`` that
    fills as the model runs (minimum over every call, recompute included).
    Valid for score functions that rank experts by their logits (softmax, and
    sigmoid without expert bias).
    """
    margins = {}
    handles = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter):
                layer = _layer_of(chunk, name)
                handles.append(module.register_forward_hook(_margin_hook(margins, layer)))
    try:
        yield margins
    finally:
        for handle in handles:
            handle.remove()


def _layer_of(chunk, module_name: str) -> int:
    local = int(module_name.split("decoder.layers.")[1].split(".")[0])
    return chunk.decoder.layers[local].layer_number - 1


def _margin_hook(margins: dict, layer: int):
    def hook(router, args, output):
        with torch.no_grad():
            logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts).float()
            k = router.topk
            top = logits.topk(k + 1, dim=-1).values
            margin = (top[:, k - 1] - top[:, k]).min().item()
        margins[layer] = min(margin, margins.get(layer, float("inf")))

    return hook


def full_token_losses(results: list[dict], num_tokens: int, atol: float = 1e-6) -> torch.Tensor:
    """Per-token losses of all ranks in global token order, ``[num_tokens]``.

    Ranks that compute the same token (TP replicas) must agree within ``atol``;
    every token must be computed by some rank.
    """
    full = torch.full((num_tokens,), float("nan"))
    for result in results:
        index, loss = result["losses"]
        seen = ~torch.isnan(full[index])
        if seen.any():
            err = (full[index][seen] - loss[seen]).abs().max().item()
            assert err <= atol, f"ranks disagree on a token's loss by {err:.3g}"
        full[index] = loss
    missing = torch.isnan(full)
    assert not missing.any(), f"no rank computed the loss of tokens {missing.nonzero().flatten().tolist()[:10]}"
    return full


def full_grads(results: list[dict]) -> dict[str, torch.Tensor]:
    """Gradients of all ranks as full single-rank tensors by name (see ``weights.assemble``)."""
    return assemble(r["grads"] for r in results)


def router_margins(results: list[dict]) -> dict[int, float]:
    """Smallest top-k margin per MoE layer over all ranks."""
    out = {}
    for result in results:
        for layer, margin in result["router_margins"].items():
            out[layer] = min(margin, out.get(layer, float("inf")))
    return out
