"""Checks of a rollout dump before a run trains on it: every record readable, the dump fits the model.

:func:`check_records` reads a range of records once, checking each as training
would; :func:`check_dump_fits` compares the header and the dump-wide stats with
the model's settings without reading a sample (when the dump has its footer).
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence, Union

import numpy as np

from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.rollout_dump import RolloutDumpError, RolloutDumpStats
from megatron_r3.dataplane.sample_checks import LOSS_FIELDS
from megatron_r3.dataplane.samples import RolloutSample


def sample_digest(sample: RolloutSample) -> bytes:
    """A 16-byte digest of everything a sample holds: equal samples, and only they (barring collisions), share it."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(sample.meta, sort_keys=True).encode())
    for array in (sample.token_ids, sample.loss_mask, sample.logprobs,
                  None if sample.routes is None else sample.routes.ids,
                  None if sample.routes is None else sample.routes.valid):
        digest.update(b"-" if array is None else np.ascontiguousarray(array).tobytes())
    return digest.digest()


def repeated_records(digests: Sequence[tuple[int, bytes]]) -> list[tuple[int, int]]:
    """``(record, the earlier record it repeats)`` for every record whose digest an earlier one has, in order."""
    first: dict[bytes, int] = {}
    repeats = []
    for record, digest in sorted(digests):
        if digest in first:
            repeats.append((record, first[digest]))
        else:
            first[digest] = record
    return repeats


def check_records(reader: RolloutDumpReader, first: int = 0, stop: Optional[int] = None, *,
                  require_loss_field: bool = False,
                  digests: Optional[list[tuple[int, bytes]]] = None) -> dict[str, Optional[int]]:
    """Reads records ``[first, stop)`` front to back, one in memory at a time, and checks each as training would.

    Every record's CRC, routes and values (log-probs finite and ``<= 0``, ``reward``
    and ``advantage`` finite numbers) are checked; the first bad record raises.

    Args:
        reader: The dump.
        first, stop: The records to read (default: all).
        require_loss_field: Refuse a record with neither a ``reward`` nor an ``advantage``
            (the policy-gradient loss needs one).
        digests: Gets ``(record, sample_digest)`` of every record read, to find repeated samples
            (:func:`repeated_records`).

    Returns:
        For each of :data:`~megatron_r3.dataplane.sample_checks.LOSS_FIELDS`, the first record of the range
        without it in its metadata (None: every record has it).

    Raises:
        RolloutDumpError, RoutingValidationError, SampleValueError: naming the record.
    """
    missing: dict[str, Optional[int]] = dict.fromkeys(LOSS_FIELDS)
    for record in range(first, len(reader) if stop is None else stop):
        sample = reader.read(record)
        meta = sample.meta
        if digests is not None:
            digests.append((record, sample_digest(sample)))
        if require_loss_field and not any(key in meta for key in LOSS_FIELDS):
            raise RolloutDumpError(f"record {record} has neither 'reward' nor 'advantage' in its metadata: the "
                                   f"policy-gradient loss needs one")
        for key in LOSS_FIELDS:
            if missing[key] is None and key not in meta:
                missing[key] = record
    return missing


def check_dump_fits(
    dump: Union[str, RolloutDumpReader],
    *,
    num_experts: int,
    topk: int,
    model_moe_layers: Sequence[int],
    vocab_size: int,
    seq_length: int,
) -> RolloutDumpStats:
    """Refuses a dump that does not fit the model, before training; returns its stats.

    Checks the header's routes (MoE layer numbers, experts, top-k) and the dump's
    stats (at least one sample, token ids in ``[0, vocab_size)``, no sample longer
    than ``seq_length``). The stats come from the footer when there is one (no
    sample is read), else from a scan that reads every record's token ids (its
    cost: :mod:`megatron_r3.dataplane.formats.dump_reader`).

    Args:
        dump: Path of the dump, or an open reader.
        num_experts, topk: The model's ``--num-experts`` and ``--moe-router-topk``.
        model_moe_layers: The model's MoE layers (global 1-based layer numbers).
        vocab_size: The model's ``--vocab-size``.
        seq_length: The model's ``--seq-length``: a sample must fit one row.

    Raises:
        RolloutDumpError: naming every field that does not fit, with the dump's and the model's value.
    """
    reader = RolloutDumpReader(dump) if isinstance(dump, str) or hasattr(dump, "__fspath__") else dump
    try:
        layers = tuple(int(n) for n in model_moe_layers)
        problems = []
        if tuple(reader.layer_numbers) != layers:
            problems.append(f"MoE layers: the dump holds routes for MoE layers {tuple(reader.layer_numbers)}, "
                            f"the model's MoE layers are {layers}")
        if reader.num_experts != num_experts:
            problems.append(f"experts: the dump holds routes over {reader.num_experts} experts, "
                            f"the model's --num-experts is {num_experts}")
        if reader.topk != topk:
            problems.append(f"top-k: the dump holds {reader.topk} experts per token, "
                            f"the model's --moe-router-topk is {topk}")
        stats = reader.stats
        if stats.num_samples == 0:
            problems.append("samples: the dump holds no samples, training needs at least one")
        if stats.max_token_id is not None and stats.max_token_id >= vocab_size:
            problems.append(f"vocab: the dump holds token id {stats.max_token_id}, "
                            f"the model's --vocab-size is {vocab_size}")
        if stats.min_token_id is not None and stats.min_token_id < 0:
            problems.append(f"vocab: the dump holds token id {stats.min_token_id}, token ids are >= 0")
        if stats.max_num_tokens > seq_length:
            longest = int(np.argmax(reader.index.num_tokens))
            problems.append(f"seq-length: sample {longest} has {stats.max_num_tokens} tokens, "
                            f"the model's --seq-length is {seq_length}")
        if problems:
            raise RolloutDumpError(f"rollout dump {reader.name} does not fit the model: " + "; ".join(problems))
        return stats
    finally:
        if reader is not dump:
            reader.close()
