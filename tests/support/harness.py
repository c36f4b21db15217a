"""One training step of the tiny MoE GPT under a layout, and its results in full form.

``run_layout`` is the worker (start it with ``launcher.run_workers``); the parent
turns what the ranks return into layout-independent tensors with
``full_token_losses``, ``full_grads`` and ``routes`` and compares them with a
single-rank run.
"""

import dataclasses
from functools import partial
from typing import Callable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from tests.support.batches import Sequences, layout_microbatches
from tests.support.parallel import Layout, init_parallel
from tests.support.routes import RouterRecorder, full_routes
from tests.support.schedule import forward_backward, forward_step
from tests.support.tiny_moe import TinyMoE, build_gpt, launcher_args
from tests.support.weights import assemble, grad_shards


@dataclasses.dataclass(frozen=True)
class Step:
    """What one run does, besides the layout.

    Attributes:
        model: Model hyper-parameters.
        seed: Weight seed.
        micro_batch_size: Sequences per microbatch (BSHD) or per pack (THD).
        forward_only: Skip the backward pass (no gradients returned).
        flags: More launcher flags (``--moe-enable-routing-replay``, ``--moe-router-score-function``, ...).
        config_fields: ``TransformerConfig`` fields no flag sets, as a tuple of pairs.
        forward_step_func: A module-level ``f(data_iterator, model, recorder)``
            (see ``schedule.forward_step``, the default), e.g. one that passes
            replay data from the microbatch to the model.
        setup: A module-level ``f(config) -> dict`` run on every rank once the
            parallel state exists and before the schedule (collective set-up, such
            as process groups); its result is bound to ``forward_step_func`` as
            keyword arguments.
    """

    model: TinyMoE = TinyMoE()
    seed: int = 0
    micro_batch_size: int = 2
    forward_only: bool = False
    flags: tuple = ()
    config_fields: tuple = ()
    forward_step_func: Callable = forward_step
    setup: Optional[Callable] = None


def run_layout(layout: Layout, data: Sequences, step: Step = Step()) -> dict:
    """Worker: one forward/backward of the tiny MoE GPT on ``data`` under ``layout``.

    Builds the model chunks of this rank (weights from ``step.seed``) in Megatron's
    ``DistributedDataParallel``, slices ``data`` for this rank (BSHD, or THD when
    ``layout.packed``) and runs Megatron's schedule, which ends a training pass with
    ``finalize_model_grads``: gradients reduced across ranks and divided by the number
    of loss tokens (the same divisor in every layout). Returns:

    * ``"losses"``: ``(token_index, per_token_loss)`` 1-D CPU tensors of the tokens
      this rank computed a loss for (last pipeline stage; padding dropped);
    * ``"grads"``: ``[(Shard, grad)]`` of every local parameter (unless forward-only);
    * ``"routes"`` and ``"router_margins"``: what a
      :class:`~tests.support.routes.RouterRecorder` recorded on this rank.
    """
    device = init_parallel(layout, args=launcher_args(layout, step.model, step.flags))
    try:
        config, chunks = build_gpt(layout, step.model, step.seed, device, flags=step.flags,
                                   **dict(step.config_fields))
        config.finalize_model_grads_func = finalize_model_grads
        model = [DistributedDataParallel(config, DistributedDataParallelConfig(), chunk) for chunk in chunks]
        microbatches = layout_microbatches(layout, data, step.micro_batch_size, device)
        recorder = RouterRecorder(chunks, config.sequence_parallel)
        forward_step_func = step.forward_step_func
        if step.setup is not None:
            forward_step_func = partial(forward_step_func, **step.setup(config))
        results = forward_backward(model, microbatches, step.forward_only, recorder, forward_step_func)
        recorder.remove()
        out = {
            "losses": _local_losses(results),
            "routes": recorder.routes,
            "router_margins": recorder.margins,
        }
        if not step.forward_only:
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
    assert not missing.any(), f"no rank computed tokens {missing.nonzero().flatten()[:10].tolist()}"
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


def routes(results: list[dict], num_tokens: int, topk: int) -> dict[int, torch.Tensor]:
    """The experts of every token per MoE layer, ``{layer: [num_tokens, k]}``."""
    return full_routes([r["routes"] for r in results], num_tokens, topk)


def assert_losses_and_grads_match(
    results: list[dict],
    ref_losses: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
    num_tokens: int,
    loss_atol: float,
    grad_rtol: float,
) -> None:
    """Per-token losses within ``loss_atol``; every gradient within ``grad_rtol`` of the
    reference tensor's largest value (exactly zero where the reference is all zero,
    e.g. experts no token was sent to)."""
    losses = full_token_losses(results, num_tokens)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=loss_atol)
    assert_grads_match(full_grads(results), ref_grads, grad_rtol)


def assert_grads_match(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor], grad_rtol: float) -> None:
    """The same gradients by name, each within ``grad_rtol`` of the reference tensor's largest value
    (exactly zero where the reference is all zero)."""
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        scale = ref.abs().max().item()
        if scale == 0:
            assert not grads[name].any(), f"{name}: gradient where the reference has none"
            continue
        err = (grads[name] - ref).abs().max().item() / scale
        assert err <= grad_rtol, f"{name}: relative gradient error {err:.3g}"
