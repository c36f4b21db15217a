"""The launcher's training metrics: the sums ranks add up, the metrics they give, and how they are logged.

Every iteration the trainer fills :func:`zero_sums` on each rank and all-reduces
them (sums, then divide, so any layout gives the same numbers);
:func:`iteration_metrics` turns the totals into one flat dict with exactly these
keys (``None`` where the iteration did not measure a value):

* ``iteration``, ``consumed_samples``: the iteration and the samples trained on so far;
* ``tokens``: tokens (prompt and completion) of the iteration's samples; ``tokens_per_s``
  over the iterations since the last log; ``elapsed_s`` since training started;
  ``eta_s`` for the remaining iterations at the average pace so far;
* ``loss``: the clipped policy-gradient loss, averaged over completion tokens;
* ``reward/mean``: mean reward of the iteration's samples;
* ``lr``, ``grad_norm``: the learning rate of the iteration's optimizer step and the
  global gradient norm before clipping (what the trainer's step reports, not sums);
* ``mismatch/{replay,live}/...``: the trainer's log-probs with replay / with live
  routing against the rollout engine's, over completion tokens, ``d = logp_rollout -
  logp_train``: ``logp_abs_diff`` (mean ``|d|``), ``logp_sq_diff`` (mean ``d**2``),
  ``k3_kl`` (mean ``exp(d) - 1 - d``), ``frac_abs_gt_ln2`` and ``frac_abs_gt_ln5``
  (fraction of tokens with ``|d| > ln 2``, ``> ln 5``: ratio outside ``[1/2, 2]``,
  ``[1/5, 5]``);
* ``routing/agreement``: over (token, MoE layer) pairs with an engine route, the fraction
  where the trainer's own top-k set equals the engine's (measured in the comparison pass);
  ``routing/agreement/layer_<n>`` the same per MoE layer number ``n``;
* ``routing/replayed_tokens``, ``routing/filler_tokens``, ``routing/live_tokens``: tokens
  the training pass routed by replay of a recorded route, by a filler route (positions no
  loss can see, :mod:`megatron_r3.dataplane.device.filler_routes`) and by the live router (padding not
  counted);
* ``routing/host_split_microbatches``: the fraction of the update pass's microbatches whose
  MoE layers took their split sizes from the host (no device sync).
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_r3.rl.trainer.logprob_mismatch import MISMATCH_METRICS

MODES = ("replay", "live")
PHASES = ("rollout", "prepare", "pass/old_logprob", "pass/compare", "pass/update", "optimizer")
"""The timed phases of an iteration (:class:`~megatron_r3.rl.profiling.phase_timer.PhaseTimer`), in order."""


def zero_sums(num_moe_layers: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One rank's empty float64 sums of an iteration.

    ``mismatch/<mode>``: :func:`~megatron_r3.rl.trainer.logprob_mismatch.logprob_mismatch_sums`;
    ``loss``: the loss sum and the completion tokens it covers; ``agreement``:
    ``[2, num_moe_layers]``, agreeing and replayed (token, layer) pairs; ``reward``: sum
    and count; ``routing/host_split_microbatches``: update-pass microbatches on the sync-free
    path and all of them; the others are counts.
    """
    sizes = {"loss": (2,), "mismatch/replay": (6,), "mismatch/live": (6,), "agreement": (2, num_moe_layers),
             "tokens": (1,), "routing/replayed_tokens": (1,), "routing/filler_tokens": (1,),
             "routing/live_tokens": (1,), "routing/host_split_microbatches": (2,), "samples": (1,), "reward": (2,)}
    return {name: torch.zeros(shape, dtype=torch.float64, device=device) for name, shape in sizes.items()}


def metric_keys(model_moe_layers: Sequence[int]) -> list[str]:
    """The keys of :func:`iteration_metrics`, in order."""
    return (["iteration", "consumed_samples", "tokens", "tokens_per_s", "elapsed_s", "eta_s", "loss", "reward/mean",
             "lr", "grad_norm"]
            + [f"mismatch/{mode}/{name}" for mode in MODES for name in MISMATCH_METRICS]
            + ["routing/agreement"] + [f"routing/agreement/layer_{n}" for n in model_moe_layers]
            + ["routing/replayed_tokens", "routing/filler_tokens", "routing/live_tokens",
               "routing/host_split_microbatches"]
            + [f"time/{phase}_s" for phase in PHASES] + [f"host_syncs/{phase}" for phase in PHASES])


def iteration_metrics(
    sums: dict[str, np.ndarray],
    model_moe_layers: Sequence[int],
    *,
    iteration: int,
    consumed_samples: int,
    tokens_per_s: float,
    elapsed_s: float,
    eta_s: float,
    seconds: Optional[dict] = None,
    host_syncs: Optional[dict] = None,
) -> dict:
    """The flat metrics of one iteration from its reduced sums, and the step's ``lr`` and ``grad_norm``
    where ``sums`` has them (see the module docstring).

    ``seconds`` and ``host_syncs`` are this rank's per phase (:data:`PHASES`); a phase that
    did not run, or syncs that were not counted, are None.
    """
    loss_sum, loss_tokens = (float(v) for v in sums["loss"])
    reward_sum, reward_count = (float(v) for v in sums["reward"])
    agree, pairs = sums["agreement"]
    metrics = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "tokens": int(sums["tokens"][0]),
        "tokens_per_s": tokens_per_s,
        "elapsed_s": elapsed_s,
        "eta_s": eta_s,
        "loss": loss_sum / loss_tokens if loss_tokens else None,
        "reward/mean": reward_sum / reward_count if reward_count else None,
        "lr": float(sums["lr"][0]) if "lr" in sums else None,
        "grad_norm": float(sums["grad_norm"][0]) if "grad_norm" in sums else None,
    }
    for mode in MODES:
        totals = sums[f"mismatch/{mode}"]
        for i, name in enumerate(MISMATCH_METRICS):
            metrics[f"mismatch/{mode}/{name}"] = float(totals[i + 1]) / float(totals[0]) if totals[0] else None
    metrics["routing/agreement"] = float(agree.sum() / pairs.sum()) if pairs.sum() else None
    for n, a, p in zip(model_moe_layers, agree, pairs):
        metrics[f"routing/agreement/layer_{n}"] = float(a / p) if p else None
    metrics["routing/replayed_tokens"] = int(sums["routing/replayed_tokens"][0])
    metrics["routing/filler_tokens"] = int(sums["routing/filler_tokens"][0])
    metrics["routing/live_tokens"] = int(sums["routing/live_tokens"][0])
    host_split, microbatches = (float(v) for v in sums["routing/host_split_microbatches"])
    metrics["routing/host_split_microbatches"] = host_split / microbatches if microbatches else None
    for phase in PHASES:
        metrics[f"time/{phase}_s"] = (seconds or {}).get(phase)
    for phase in PHASES:
        metrics[f"host_syncs/{phase}"] = (host_syncs or {}).get(phase)
    return metrics


def progress_line(metrics: dict, train_iters: int, timers: bool = False) -> str:
    """Megatron-style one-line summary: iteration, loss, reward, k3 KL per mode, agreement, tokens/s, ETA.

    With ``timers``, then the seconds of each phase that ran (and its host syncs, if counted).
    """
    parts = [f" iteration {metrics['iteration']:8d}/{train_iters:8d}",
             f"consumed samples: {metrics['consumed_samples']:10d}",
             f"loss: {_number(metrics['loss'], '.6E')}",
             f"reward: {_number(metrics['reward/mean'], '.4f')}"]
    if metrics["lr"] is not None:
        parts += [f"lr: {metrics['lr']:.3E}", f"grad norm: {_number(metrics['grad_norm'], '.3f')}"]
    for mode in MODES:
        k3 = metrics[f"mismatch/{mode}/k3_kl"]
        if k3 is not None:
            parts.append(f"k3 {mode}: {k3:.3E}")
    parts += [f"agreement: {_number(metrics['routing/agreement'], '.4f')}",
              f"tokens/s: {metrics['tokens_per_s']:.1f}",
              f"ETA: {datetime.timedelta(seconds=round(metrics['eta_s']))}"]
    if timers:
        for phase in PHASES:
            seconds, syncs = metrics[f"time/{phase}_s"], metrics[f"host_syncs/{phase}"]
            if seconds is not None:
                parts.append(f"{phase} {seconds:.3f}s" + (f" ({syncs} syncs)" if syncs is not None else ""))
    return " | ".join(parts)


def _number(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
