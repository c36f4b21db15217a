"""The rollout dump: an append-only, streamable file of rollout samples with their routes.

A launcher writes what the rollout engine produced (tokens, loss mask, rollout
log-probs, routes) and a trainer streams it back one sample at a time, so
rollouts larger than memory can be replayed. Layout (little-endian throughout):

File header, once::

    magic      8 bytes   b"R3DUMP\\x00\\x02"  (format version 2)
    json_len   uint32
    json       utf-8 JSON {"num_experts", "topk", "layer_numbers", "id_dtype"}

Records, repeated to the end of the file::

    magic      4 bytes   b"R3RC"
    body_len   uint64
    crc32      uint32    zlib.crc32 of the body
    body:
      num_tokens  uint32  T
      flags       uint32  bit 0: has log-probs, bit 1: has routes
      meta_len    uint32
      meta        utf-8 JSON object (per-sample metadata: ids, rewards, ...)
      token_ids   int32   [T]
      loss_mask   uint8   [T]          1 = token is trained on
      logprobs    float32 [T]          if bit 0; rollout log-prob of token t
      route_ids   uint8|int16 [T, L, K]  if bit 1; the header's id_dtype, L = len(layer_numbers)
      route_valid uint8   [T]          if bit 1; per token, 0 = no route (the live router
                                       decides the token at every MoE layer)

Every array of a sample is whole in one record; a reader needs one record of
memory. Routes are validated again when read (a dump may come from elsewhere).
A dump of another format version (version 1: ``route_valid [T, L]``) is
rejected, not converted.
A truncated last record (a writer that died) is reported, not skipped
silently, unless the reader is asked to tolerate it.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Optional, Sequence, Union

import numpy as np

from megatron_r3.routes import RolloutRoutes, id_dtype
from megatron_r3.validation import validate_routes

FORMAT_VERSION = 2  # 2: route_valid per token; 1: per token and layer
MAGIC = b"R3DUMP" + FORMAT_VERSION.to_bytes(2, "big")
RECORD_MAGIC = b"R3RC"
_RECORD_HEAD = struct.Struct("<4sQI")
_BODY_HEAD = struct.Struct("<III")
_HAS_LOGPROBS, _HAS_ROUTES = 1, 2


class RolloutDumpError(ValueError):
    """A dump file that is not what it claims to be (bad magic, CRC, truncation, mismatch)."""


@dataclass
class RolloutSample:
    """One rollout sample as stored in a dump.

    Attributes:
        token_ids: int32 ``[T]``, prompt and generated tokens.
        loss_mask: bool ``[T]``.
        logprobs: Optional float32 ``[T]``, the rollout engine's log-prob of each token.
        routes: Optional routes over the same T tokens.
        meta: JSON-serialisable per-sample metadata.
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: Optional[np.ndarray] = None
    routes: Optional[RolloutRoutes] = None
    meta: dict = field(default_factory=dict)


class RolloutDumpWriter:
    """Appends samples to a new dump file.

    Args:
        path: File to create (or a binary file object).
        num_experts: Routed experts per MoE layer.
        topk: Experts per token.
        layer_numbers: The MoE layer numbers every sample's routes cover.
    """

    def __init__(self, path: Union[str, BinaryIO], *, num_experts: int, topk: int, layer_numbers: Sequence[int]):
        self._owns = isinstance(path, (str, bytes)) or hasattr(path, "__fspath__")
        self._file = open(path, "wb") if self._owns else path
        self.num_experts, self.topk = int(num_experts), int(topk)
        self.layer_numbers = tuple(int(n) for n in layer_numbers)
        self._dtype = id_dtype(num_experts)
        header = json.dumps({"num_experts": self.num_experts, "topk": self.topk,
                             "layer_numbers": list(self.layer_numbers), "id_dtype": self._dtype.name}).encode()
        self._file.write(MAGIC + struct.pack("<I", len(header)) + header)
        self.count = 0

    def write(self, sample: RolloutSample) -> None:
        """Appends one sample; raises if its shapes or routes do not fit the header."""
        t = len(sample.token_ids)
        where = f"sample {self.count}"
        if np.shape(sample.loss_mask) != (t,):
            raise RolloutDumpError(f"{where}: loss_mask has shape {np.shape(sample.loss_mask)}, tokens {t}")
        if sample.logprobs is not None and np.shape(sample.logprobs) != (t,):
            raise RolloutDumpError(f"{where}: logprobs has shape {np.shape(sample.logprobs)}, tokens {t}")
        parts = [np.asarray(sample.token_ids, dtype="<i4"), np.asarray(sample.loss_mask, dtype=np.uint8)]
        flags = 0
        if sample.logprobs is not None:
            flags |= _HAS_LOGPROBS
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
            flags |= _HAS_ROUTES
            parts += [r.ids.astype(self._dtype.newbyteorder("<"), copy=False), r.valid.view(np.uint8)]
        meta = json.dumps(sample.meta).encode()
        body = [_BODY_HEAD.pack(t, flags, len(meta)), meta] + [np.ascontiguousarray(p).tobytes() for p in parts]
        length = sum(len(b) for b in body)
        crc = 0
        for b in body:
            crc = zlib.crc32(b, crc)
        self._file.write(_RECORD_HEAD.pack(RECORD_MAGIC, length, crc))
        for b in body:
            self._file.write(b)
        self.count += 1

    def close(self) -> None:
        if self._owns:
            self._file.close()
        else:
            self._file.flush()

    def __enter__(self) -> "RolloutDumpWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RolloutDumpReader:
    """Streams samples from a dump file, one record in memory at a time.

    Args:
        path: The dump (or a binary file object positioned at its start).
        allow_truncated_tail: Stop quietly at a truncated last record instead of raising.

    Attributes:
        num_experts, topk, layer_numbers: From the header.
    """

    def __init__(self, path: Union[str, BinaryIO], *, allow_truncated_tail: bool = False):
        self._owns = isinstance(path, (str, bytes)) or hasattr(path, "__fspath__")
        self._file = open(path, "rb") if self._owns else path
        self.allow_truncated_tail = allow_truncated_tail
        magic = self._file.read(len(MAGIC))
        if len(magic) != len(MAGIC) or magic[:6] != MAGIC[:6]:
            raise RolloutDumpError(f"not a megatron-r3 rollout dump (magic {magic!r})")
        version = int.from_bytes(magic[6:], "big")
        if version != FORMAT_VERSION:
            raise RolloutDumpError(
                f"rollout dump format version {version} is not supported: this reader reads version "
                f"{FORMAT_VERSION} (route validity per token); write the dump again"
            )
        (json_len,) = struct.unpack("<I", self._read_exact(4, "header"))
        header = json.loads(self._read_exact(json_len, "header"))
        self.num_experts = int(header["num_experts"])
        self.topk = int(header["topk"])
        self.layer_numbers = tuple(header["layer_numbers"])
        self._dtype = np.dtype(header["id_dtype"]).newbyteorder("<")
        if np.dtype(header["id_dtype"]) != id_dtype(self.num_experts):
            raise RolloutDumpError(f"header id_dtype {header['id_dtype']} does not fit {self.num_experts} experts")

    def __iter__(self) -> Iterator[RolloutSample]:
        index = 0
        while True:
            head = self._file.read(_RECORD_HEAD.size)
            if not head:
                return
            if len(head) < _RECORD_HEAD.size:
                if self._truncated(index):
                    return
            magic, length, crc = _RECORD_HEAD.unpack(head)
            if magic != RECORD_MAGIC:
                raise RolloutDumpError(f"record {index}: bad record magic {magic!r}")
            body = self._file.read(length)
            if len(body) < length:
                if self._truncated(index):
                    return
            if zlib.crc32(body) != crc:
                raise RolloutDumpError(f"record {index}: CRC mismatch (corrupt file)")
            yield self._decode(memoryview(body), index)
            index += 1

    def _truncated(self, index: int) -> bool:
        if self.allow_truncated_tail:
            return True
        raise RolloutDumpError(f"record {index}: truncated (the writer did not finish it)")

    def _decode(self, body: memoryview, index: int) -> RolloutSample:
        t, flags, meta_len = _BODY_HEAD.unpack_from(body)
        at = _BODY_HEAD.size
        meta = json.loads(bytes(body[at : at + meta_len]))
        at += meta_len

        def take(dtype, shape):
            nonlocal at
            dtype = np.dtype(dtype)
            n = int(np.prod(shape)) * dtype.itemsize
            array = np.frombuffer(body[at : at + n], dtype=dtype).reshape(shape)
            at += n
            return array.astype(dtype.newbyteorder("="), copy=True)  # own the memory, native order

        token_ids = take("<i4", (t,))
        loss_mask = take(np.uint8, (t,)).astype(np.bool_)
        logprobs = take("<f4", (t,)) if flags & _HAS_LOGPROBS else None
        routes = None
        if flags & _HAS_ROUTES:
            n_layers = len(self.layer_numbers)
            ids = take(self._dtype, (t, n_layers, self.topk))
            valid = take(np.uint8, (t,)).astype(np.bool_)
            validate_routes(ids, valid, num_experts=self.num_experts, topk=self.topk,
                            layer_numbers=self.layer_numbers, sample=index)
            routes = RolloutRoutes(ids, valid, self.num_experts, self.layer_numbers)
        if at != len(body):
            raise RolloutDumpError(f"record {index}: {len(body) - at} unexpected trailing bytes")
        return RolloutSample(token_ids, loss_mask, logprobs, routes, meta)

    def _read_exact(self, n: int, what: str) -> bytes:
        data = self._file.read(n)
        if len(data) != n:
            raise RolloutDumpError(f"truncated {what}")
        return data

    def close(self) -> None:
        if self._owns:
            self._file.close()

    def __enter__(self) -> "RolloutDumpReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
