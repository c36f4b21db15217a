"""Checks of the numbers a rollout sample brings to the loss, run wherever samples enter.

Samples enter through the engine adapters (:mod:`megatron_r3.dataplane.engines.engine_samples`,
``tools/dump_rollouts.py``), the dump writer and reader
(:mod:`megatron_r3.dataplane.formats.dump_writer`, :mod:`megatron_r3.dataplane.formats.dump_reader`),
the built-in engine (:mod:`megatron_r3.rl.rollout.engine`) and the trainer's step. Each runs these
checks, so a bad number is refused where it comes in, with the sample, the
token and the field named, and never reaches the weights:

* token ids: integers (a float id is refused, never truncated) in
  ``[0, vocab_size)``, and below ``2**31`` whatever the vocabulary (a dump stores
  int32);
* rollout log-probs: finite and ``<= 0`` (``+5.0`` is no log-probability);
* ``reward`` and ``advantage`` of a sample's metadata: finite numbers (not
  bools, strings or null).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

TOKEN_ID_LIMIT = 2**31
"""Token ids lie below this: a rollout dump stores them as int32."""

LOSS_FIELDS = ("reward", "advantage")
"""The metadata keys the policy-gradient loss reads (an ``advantage``, or a ``reward`` to normalise)."""


class SampleValueError(ValueError):
    """A number of a rollout sample that cannot enter the loss."""


def token_id_array(values: Any, where: str, field: str, vocab_size: Optional[int] = None) -> np.ndarray:
    """``values`` as int64 token ids; raises on the first entry that is not one.

    Args:
        values: A sequence of ids (an engine's list, or an integer array).
        where: What holds them, for messages (``"request 'r1' sample 0"``).
        field: Their field name, for messages (``"token_ids"``).
        vocab_size: The model's vocabulary; None: only the int32 bound.
    """
    limit = TOKEN_ID_LIMIT if vocab_size is None else min(int(vocab_size), TOKEN_ID_LIMIT)
    bound = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "[0, 2**31) (int32 in a rollout dump)"
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":  # bool and float arrays too: an id is never rounded
            raise SampleValueError(f"{where}: {field} has dtype {values.dtype}: token ids must be integers")
        flat = values.reshape(-1)
        bad = (flat < 0) | (flat >= limit)
        if bad.any():
            i = int(np.argmax(bad))
            raise SampleValueError(f"{where}: {field}[{i}] = {int(flat[i])} is outside {bound}")
        return flat.astype(np.int64)
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise SampleValueError(f"{where}: {field} must be a list of token ids, got {type(values).__name__}")
    if isinstance(values, list) and set(map(type, values)) <= {int}:  # a JSON list: one pass in C, then bounds
        try:
            return token_id_array(np.array(values, dtype=np.int64), where, field, vocab_size)
        except OverflowError:  # beyond int64: the loop below names it
            pass
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise SampleValueError(f"{where}: {field}[{i}] = {value!r} is not an integer token id")
        if not 0 <= value < limit:
            raise SampleValueError(f"{where}: {field}[{i}] = {value} is outside {bound}")
        out[i] = value
    return out


def logprob_value(value: Any, where: str, field: str) -> float:
    """One log-prob as it comes from an engine: a number (not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SampleValueError(f"{where}: {field} = {value!r} is not a number")
    return float(value)


def logprob_array(values: Sequence[Any], where: str, field: str, first_token: int = 0, entry: str = "") -> np.ndarray:
    """Log-probs as they come from an engine, one per token: numbers, finite and ``<= 0``, as float32.

    Args:
        values: The numbers (a list, as JSON or an engine gives them).
        where, field, first_token: As for :func:`check_logprobs`; entry ``i`` is ``field[i]``.
        entry: Where in ``field[i]`` the number is, for messages (``"[0]"``: SGLang's entries).
    """
    if set(map(type, values)) <= {float, int}:  # plain numbers: one pass in C
        out = np.array(values, dtype=np.float32)
    else:
        out = np.array([logprob_value(v, where, f"{field}[{i}]{entry}") for i, v in enumerate(values)], np.float32)
    check_logprobs(out, where, field, first_token=first_token)
    return out


def check_logprobs(logprobs: Sequence[float], where: str, field: str = "logprobs", first_token: int = 0) -> None:
    """Rollout log-probs must be finite and ``<= 0``; raises naming the first token that is not.

    Args:
        logprobs: One log-prob per token of ``field``.
        where: The sample, for messages.
        field: The array's name; entry ``i`` is the sample's token ``first_token + i``.
        first_token: The sample's token of entry 0.
    """
    values = np.asarray(logprobs)
    if values.dtype.kind not in "fiu":
        raise SampleValueError(f"{where}: {field} has dtype {values.dtype}: log-probs must be numbers")
    bad = ~(np.isfinite(values) & (values <= 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise SampleValueError(
            f"{where}: token {first_token + i}: {field}[{i}] = {float(values[i])}: a rollout log-prob must be finite "
            f"and <= 0 ({int(bad.sum())} of {len(values)} entries are not)"
        )


def loss_number(value: Any, where: str, field: str) -> float:
    """A reward or an advantage: a finite number (not a bool, a string or null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SampleValueError(f"{where}: {field} = {value!r} is not a number")
    if not math.isfinite(value):
        raise SampleValueError(f"{where}: {field} = {value!r} is not finite")
    return float(value)


def loss_value(meta: dict, key: str, where: str) -> Optional[float]:
    """``meta[key]`` (one of :data:`LOSS_FIELDS`) as a finite float; None when the key is absent."""
    if key not in meta:
        return None
    return loss_number(meta[key], where, f"meta[{key!r}]")


def check_sample_values(sample: Any, where: str) -> None:
    """The log-probs and the loss fields of a :class:`~megatron_r3.dataplane.samples.RolloutSample`."""
    if sample.logprobs is not None:
        check_logprobs(sample.logprobs, where)
    if not isinstance(sample.meta, dict):
        raise SampleValueError(f"{where}: meta must be a dict, got {type(sample.meta).__name__}")
    for key in LOSS_FIELDS:
        loss_value(sample.meta, key, where)
