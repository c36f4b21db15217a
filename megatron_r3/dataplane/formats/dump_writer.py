"""Writing a rollout dump (:mod:`megatron_r3.dataplane.formats.rollout_dump`): a record per sample, then the footer."""

from __future__ import annotations

import json
import struct
import zlib
from array import array
from typing import BinaryIO, Optional, Sequence, Union

import numpy as np

from megatron_r3.dataplane.formats.rollout_dump import (
    BODY_HEAD,
    FOOTER_MAGIC,
    HAS_LOGPROBS,
    HAS_ROUTES,
    INDEX_MAGIC,
    MAGIC,
    RECORD_HEAD,
    RECORD_MAGIC,
    TRAILER,
    RolloutDumpError,
)
from megatron_r3.dataplane.routes import id_dtype
from megatron_r3.dataplane.sample_checks import check_sample_values, token_id_array
from megatron_r3.dataplane.samples import RolloutSample


class RolloutDumpWriter:
    """Appends samples to a new dump file; :meth:`close` writes the footer.

    Leaving a ``with`` block by an exception closes the file without a footer: the
    samples written so far stay readable (by a scan), and the dump does not claim
    a finished writer.

    Every sample is checked before it is written: token ids integers in int32,
    rollout log-probs finite and ``<= 0``, ``reward`` and ``advantage`` finite
    numbers (:mod:`megatron_r3.dataplane.sample_checks`), routes fitting the header.

    Args:
        path: File to create (or a binary file object).
        num_experts: Routed experts per MoE layer.
        topk: Experts per token.
        layer_numbers: The MoE layer numbers every sample's routes cover.
        overwrite: Replace an existing file at ``path`` (by default it is refused).
    """

    def __init__(self, path: Union[str, BinaryIO], *, num_experts: int, topk: int, layer_numbers: Sequence[int],
                 overwrite: bool = False):
        self._owns = isinstance(path, (str, bytes)) or hasattr(path, "__fspath__")
        if self._owns:
            try:
                self._file = open(path, "wb" if overwrite else "xb")
            except FileExistsError:
                raise RolloutDumpError(f"rollout dump {path} exists: pass overwrite=True to replace it") from None
        else:
            self._file = path
        self.num_experts, self.topk = int(num_experts), int(topk)
        self.layer_numbers = tuple(int(n) for n in layer_numbers)
        self._dtype = id_dtype(num_experts)
        header = json.dumps({"num_experts": self.num_experts, "topk": self.topk,
                             "layer_numbers": list(self.layer_numbers), "id_dtype": self._dtype.name}).encode()
        self._written = 0  # bytes from the start of the dump: the next record's offset
        self._offsets, self._num_tokens = array("Q"), array("I")
        self._min_token_id: Optional[int] = None
        self._max_token_id: Optional[int] = None
        self._closed = False
        self._write([MAGIC, struct.pack("<I", len(header)), header])
        self.count = 0

    def write(self, sample: RolloutSample) -> None:
        """Appends one sample; raises if its shapes or routes do not fit the header."""
        if self._closed:
            raise RolloutDumpError("the rollout dump writer is closed")
        t = len(sample.token_ids)
        where = f"sample {self.count}"
        if np.shape(sample.loss_mask) != (t,):
            raise RolloutDumpError(f"{where}: loss_mask has shape {np.shape(sample.loss_mask)}, tokens {t}")
        if sample.logprobs is not None and np.shape(sample.logprobs) != (t,):
            raise RolloutDumpError(f"{where}: logprobs has shape {np.shape(sample.logprobs)}, tokens {t}")
        token_ids = token_id_array(sample.token_ids, where, "token_ids").astype("<i4")
        check_sample_values(sample, where)
        parts = [token_ids, np.asarray(sample.loss_mask, dtype=np.uint8)]
        flags = 0
        if sample.logprobs is not None:
            flags |= HAS_LOGPROBS
            parts.append(np.asarray(sample.logprobs, dtype="<f4"))
        if sample.routes is not None:
            r = sample.routes
            if (r.num_experts, r.topk, r.layer_numbers, r.num_tokens) != (
                self.num_experts, self.topk, self.layer_numbers, t
            ):
                raise RolloutDumpError(
                    f"{where}: routes (experts, topk, layers, tokens) = "
                    f"{(r.num_experts, r.topk, r.layer_numbers, r.num_tokens)} do not fit the dump "
                    f"{(self.num_experts, self.topk, self.layer_numbers, t)}"
                )
            flags |= HAS_ROUTES
            parts += [r.ids.astype(self._dtype.newbyteorder("<"), copy=False), r.valid.view(np.uint8)]
        meta = json.dumps(sample.meta).encode()
        # The arrays' own buffers (no copy): the CRC and the file read them once each.
        body = [BODY_HEAD.pack(t, flags, len(meta)), meta] + [memoryview(np.ascontiguousarray(p)).cast("B")
                                                              for p in parts]
        self._offsets.append(self._written)
        self._num_tokens.append(t)
        if t:
            low, high = int(token_ids.min()), int(token_ids.max())
            self._min_token_id = low if self._min_token_id is None else min(self._min_token_id, low)
            self._max_token_id = high if self._max_token_id is None else max(self._max_token_id, high)
        self._write_record(RECORD_MAGIC, body)
        self.count += 1

    def close(self) -> None:
        """Writes the footer (index and stats) and closes the file (flushes one passed in)."""
        if self._closed:
            return
        stats = json.dumps({
            "num_samples": self.count,
            "max_num_tokens": max(self._num_tokens, default=0),
            "min_token_id": self._min_token_id,
            "max_token_id": self._max_token_id,
        }).encode()
        index_at = self._written
        self._write_record(INDEX_MAGIC, [struct.pack("<I", len(stats)), stats,
                                         np.asarray(self._offsets, dtype="<u8").tobytes(),
                                         np.asarray(self._num_tokens, dtype="<u4").tobytes()])
        self._write([TRAILER.pack(index_at, FOOTER_MAGIC)])
        self._release()

    def _write_record(self, magic: bytes, body: list[bytes]) -> None:
        crc = 0
        for b in body:
            crc = zlib.crc32(b, crc)
        self._write([RECORD_HEAD.pack(magic, sum(len(b) for b in body), crc)] + body)

    def _write(self, parts: list[bytes]) -> None:
        for b in parts:
            self._file.write(b)
            self._written += len(b)

    def _release(self) -> None:
        self._closed = True
        if self._owns:
            self._file.close()
        else:
            self._file.flush()

    def __enter__(self) -> "RolloutDumpWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self._release()

