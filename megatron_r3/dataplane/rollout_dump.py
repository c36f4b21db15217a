"""The rollout dump: an append-only, streamable file of rollout samples with their routes.

A launcher writes what the rollout engine produced (tokens, loss mask, rollout
log-probs, routes) and a trainer reads it back one sample at a time, so
rollouts larger than memory can be replayed: streamed front to back, or one
record at a time by its index (what a data-parallel rank does, see
:mod:`megatron_r3.dataplane.rollout_shards`). Layout (little-endian throughout):

File header, once::

    magic      8 bytes   b"R3DUMP\\x00\\x03"  (format version 3)
    json_len   uint32
    json       utf-8 JSON {"num_experts", "topk", "layer_numbers", "id_dtype"}

Records, one per sample, in the order written::

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

Footer, written by :meth:`RolloutDumpWriter.close` (a writer that finished)::

    index record:
      magic      4 bytes   b"R3IX"
      body_len   uint64
      crc32      uint32    zlib.crc32 of the body
      body:
        json_len    uint32
        json        utf-8 JSON {"num_samples", "max_num_tokens", "min_token_id", "max_token_id"}
                    (token ids null when the dump holds no token)
        offsets     uint64 [N]  byte offset of record i's magic from the start of the file
        num_tokens  uint32 [N]  T of record i
    trailer (the last 16 bytes of the file):
      index_at   uint64    byte offset of the index record's magic
      magic      8 bytes   b"R3FOOTER"

Every array of a sample is whole in one record; a reader needs one record of
memory. Records are checked against their CRC whenever they are read, and routes
are validated again (a dump may come from elsewhere).

Finding records: a dump with a footer gives its index and stats from two small
reads at its end. A dump without one (the writer died or is still writing, or a
version 2 dump) is indexed by a scan of the record heads: per record one 16-byte
head and the 12-byte body head are read and the rest of the body is sought over,
one seek and two small reads per record. Its stats (token id range) cost a
second scan that also reads each record's token ids, 4 bytes per token: about 1%
of a dump with routes of 48 layers x top-8, about half of one without routes.
A truncated last record (a writer that died mid-record) is reported, not skipped
silently, unless the reader is asked to tolerate it; a footer cut short counts
as no footer, and bytes after a whole footer are an error. Only a footer tells a
dump's length: one cut exactly at a record boundary reads as a shorter dump, so
:attr:`RolloutDumpReader.finished` tells a caller that needs every sample (the
launcher) whether it has them.

Values: the writer refuses, and the reader refuses in every record it decodes,
rollout log-probs that are not finite or above 0 and a ``reward`` or
``advantage`` that is not a finite number (:mod:`megatron_r3.dataplane.sample_checks`);
the writer also refuses token ids that are not integers in ``[0, 2**31)``.
:func:`check_records` reads a range of records once, checking each, before a
run trains on them.

Versions: version 3 added the footer and left header and records as they were in
version 2, so a version 2 dump still reads (it is indexed by a scan, like a
version 3 dump whose writer died). A version 1 dump (``route_valid [T, L]``) is
rejected, not converted.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from array import array
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional, Sequence, Union

import numpy as np

from megatron_r3.dataplane.routes import RolloutRoutes, id_dtype
from megatron_r3.dataplane.sample_checks import LOSS_FIELDS, check_sample_values, token_id_array
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.dataplane.validation import validate_routes

FORMAT_VERSION = 3  # 3: index and stats in a footer; 2: route_valid per token; 1: per token and layer
READABLE_VERSIONS = (2, 3)
MAGIC = b"R3DUMP" + FORMAT_VERSION.to_bytes(2, "big")
RECORD_MAGIC = b"R3RC"
INDEX_MAGIC = b"R3IX"
FOOTER_MAGIC = b"R3FOOTER"
_RECORD_HEAD = struct.Struct("<4sQI")
_BODY_HEAD = struct.Struct("<III")
_TRAILER = struct.Struct("<Q8s")
_HAS_LOGPROBS, _HAS_ROUTES = 1, 2


class RolloutDumpError(ValueError):
    """A dump file that is not what it claims to be (bad magic, CRC, truncation, mismatch)."""


@dataclass(frozen=True)
class RolloutDumpIndex:
    """Where each record of a dump lies.

    Attributes:
        offsets: int64 ``[N]``, byte offset of record i's head from the start of the dump.
        num_tokens: int64 ``[N]``, token count of sample i.
        end: Byte offset just past the last record.
        from_footer: True when read from the footer, False when built by a scan.
    """

    offsets: np.ndarray
    num_tokens: np.ndarray
    end: int
    from_footer: bool

    def __len__(self) -> int:
        return len(self.offsets)

    def body_length(self, record: int) -> int:
        """Body bytes of ``record`` (records lie back to back)."""
        after = self.offsets[record + 1] if record + 1 < len(self.offsets) else self.end
        return int(after - self.offsets[record]) - _RECORD_HEAD.size


@dataclass(frozen=True)
class RolloutDumpStats:
    """Dump-wide figures a trainer checks against its model before training.

    Attributes:
        num_samples: Samples in the dump.
        max_num_tokens: Tokens of the longest sample (0 for an empty dump).
        min_token_id, max_token_id: Smallest and largest token id; None when no sample has a token.
    """

    num_samples: int
    max_num_tokens: int
    min_token_id: Optional[int]
    max_token_id: Optional[int]


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
        self._write([_TRAILER.pack(index_at, FOOTER_MAGIC)])
        self._release()

    def _write_record(self, magic: bytes, body: list[bytes]) -> None:
        crc = 0
        for b in body:
            crc = zlib.crc32(b, crc)
        self._write([_RECORD_HEAD.pack(magic, sum(len(b) for b in body), crc)] + body)

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


class RolloutDumpReader:
    """Reads samples from a dump file: streamed in order, or one by one by record number.

    Iterating streams the records front to back (the file may still be growing);
    :meth:`read` seeks to one record through :attr:`index`. Either way one record
    is in memory at a time, and its CRC is checked.

    Args:
        path: The dump (or a seekable binary file object positioned at its start).
        allow_truncated_tail: Stop quietly at a truncated last record instead of raising.

    Attributes:
        name: The path, or the file object's name, for messages.
        version: The dump's format version.
        num_experts, topk, layer_numbers: From the header.
    """

    def __init__(self, path: Union[str, BinaryIO], *, allow_truncated_tail: bool = False):
        self._owns = isinstance(path, (str, bytes)) or hasattr(path, "__fspath__")
        self._file = open(path, "rb") if self._owns else path
        self.name = str(path) if self._owns else str(getattr(path, "name", "<stream>"))
        self.allow_truncated_tail = allow_truncated_tail
        self._base = self._file.tell()
        magic = self._file.read(len(MAGIC))
        if len(magic) != len(MAGIC) or magic[:6] != MAGIC[:6]:
            raise RolloutDumpError(f"not a megatron-r3 rollout dump (magic {magic!r})")
        self.version = int.from_bytes(magic[6:], "big")
        if self.version not in READABLE_VERSIONS:
            raise RolloutDumpError(
                f"rollout dump format version {self.version} is not supported: this reader reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (route validity per token); write the dump again"
            )
        (json_len,) = struct.unpack("<I", self._read_exact(4, "header"))
        header = json.loads(self._read_exact(json_len, "header"))
        self._records_start = len(MAGIC) + 4 + json_len
        self.num_experts = int(header["num_experts"])
        self.topk = int(header["topk"])
        self.layer_numbers = tuple(header["layer_numbers"])
        self._dtype = np.dtype(header["id_dtype"]).newbyteorder("<")
        if np.dtype(header["id_dtype"]) != id_dtype(self.num_experts):
            raise RolloutDumpError(f"header id_dtype {header['id_dtype']} does not fit {self.num_experts} experts")
        self._index: Optional[RolloutDumpIndex] = None
        self._stats: Optional[RolloutDumpStats] = None

    @property
    def index(self) -> RolloutDumpIndex:
        """Record offsets and token counts: from the footer, else from a scan of the record heads."""
        if self._index is None:
            footer = self._read_footer()
            if footer is not None:
                self._index, self._stats = footer
            else:
                self._index = self._scan(with_token_ids=False)[0]
        return self._index

    @property
    def finished(self) -> bool:
        """True when the dump ends with its footer: its writer closed it, so the footer's count is its length.

        A dump without one (a writer that died or is still writing, a file cut anywhere,
        even at a record boundary, a version 2 dump) may have lost samples at its end.
        """
        if self._index is None:
            footer = self._read_footer()
            if footer is None:
                return False
            self._index, self._stats = footer
        return self._index.from_footer

    @property
    def stats(self) -> RolloutDumpStats:
        """Sample count, longest sample and token id range: from the footer, else from a scan."""
        if self._stats is None and not self.index.from_footer:  # a footer gives both at once
            self._index, self._stats = self._scan(with_token_ids=True)
        return self._stats

    def __len__(self) -> int:
        return len(self.index)

    def read(self, record: int) -> RolloutSample:
        """Sample ``record`` (0-based), read with one seek; its neighbours are not touched."""
        index = self.index
        if not 0 <= record < len(index):
            raise IndexError(f"record {record} is outside rollout dump {self.name} of {len(index)} samples")
        offset, length = int(index.offsets[record]), index.body_length(record)
        self._file.seek(self._base + offset)
        head = self._file.read(_RECORD_HEAD.size)
        if len(head) < _RECORD_HEAD.size:
            raise RolloutDumpError(f"record {record}: truncated at offset {offset}, where the index has it")
        magic, body_len, crc = _RECORD_HEAD.unpack(head)
        if magic != RECORD_MAGIC or body_len != length:
            raise RolloutDumpError(f"record {record}: the index has a {length}-byte record at offset {offset}; "
                                   f"the file has magic {magic!r} and {body_len} bytes there")
        body = self._file.read(length)
        if len(body) < length:
            raise RolloutDumpError(f"record {record}: truncated at offset {offset}, where the index has it")
        return self._decode(self._checked(body, crc, record), record)

    def __iter__(self) -> Iterator[RolloutSample]:
        position, record = self._records_start, 0
        while True:
            self._file.seek(self._base + position)
            head = self._file.read(_RECORD_HEAD.size)
            if self._is_index(head[:4]):
                self._check_footer_end(position)
                return
            if not head:
                return
            if len(head) < _RECORD_HEAD.size:
                if self._truncated(record):
                    return
            magic, length, crc = _RECORD_HEAD.unpack(head)
            if magic != RECORD_MAGIC:
                raise RolloutDumpError(f"record {record}: bad record magic {magic!r}")
            body = self._file.read(length)
            if len(body) < length:
                if self._truncated(record):
                    return
            yield self._decode(self._checked(body, crc, record), record)
            position += _RECORD_HEAD.size + length
            record += 1

    def _is_index(self, magic: bytes) -> bool:
        """The index record ends the samples (version 3 and later)."""
        return magic == INDEX_MAGIC and self.version >= 3

    def _check_footer_end(self, index_at: int) -> None:
        """Nothing may follow a whole footer (index record and trailer) that starts at ``index_at``.

        A footer cut short is no footer; bytes after a whole one were appended to a
        finished dump, and are an error rather than ignored.
        """
        size = self._size()
        self._file.seek(self._base + index_at)
        head = self._file.read(_RECORD_HEAD.size)
        if len(head) < _RECORD_HEAD.size:
            return
        end = index_at + _RECORD_HEAD.size + _RECORD_HEAD.unpack(head)[1] + _TRAILER.size
        if size > end:
            raise RolloutDumpError(f"rollout dump {self.name}: {size - end} bytes follow its footer, which ends at "
                                   f"byte {end} (data appended to a finished dump?)")
        if size == end:
            self._file.seek(self._base + end - _TRAILER.size)
            at, magic = _TRAILER.unpack(self._file.read(_TRAILER.size))
            if (at, magic) != (index_at, FOOTER_MAGIC):
                raise RolloutDumpError(f"rollout dump {self.name}: corrupt footer: the trailer after the index "
                                       f"record at offset {index_at} is {magic!r} pointing at {at}")

    def _truncated(self, record: int) -> bool:
        if self.allow_truncated_tail:
            return True
        raise RolloutDumpError(f"record {record}: truncated (the writer did not finish it)")

    @staticmethod
    def _checked(body: bytes, crc: int, record: int) -> memoryview:
        if zlib.crc32(body) != crc:
            raise RolloutDumpError(f"record {record}: CRC mismatch (corrupt file)")
        return memoryview(body)

    def _size(self) -> int:
        return self._file.seek(0, io.SEEK_END) - self._base

    def _read_footer(self) -> Optional[tuple[RolloutDumpIndex, RolloutDumpStats]]:
        """Index and stats from the footer; None when there is none (the writer did not finish)."""
        size = self._size()
        if self.version < 3 or size < self._records_start + _RECORD_HEAD.size + _TRAILER.size:
            return None
        self._file.seek(self._base + size - _TRAILER.size)
        index_at, magic = _TRAILER.unpack(self._file.read(_TRAILER.size))
        if magic != FOOTER_MAGIC:
            return None

        def corrupt(why: str) -> RolloutDumpError:
            return RolloutDumpError(f"rollout dump {self.name}: corrupt footer: {why}")

        if not self._records_start <= index_at <= size - _TRAILER.size - _RECORD_HEAD.size:
            raise corrupt(f"index offset {index_at} lies outside the file of {size} bytes")
        self._file.seek(self._base + index_at)
        magic, length, crc = _RECORD_HEAD.unpack(self._file.read(_RECORD_HEAD.size))
        if magic == INDEX_MAGIC and index_at + _RECORD_HEAD.size + length + _TRAILER.size < size:
            self._check_footer_end(index_at)  # a whole footer, then bytes that end like one
        if magic != INDEX_MAGIC or index_at + _RECORD_HEAD.size + length + _TRAILER.size != size:
            raise corrupt(f"no index record of the right length at offset {index_at}")
        body = self._file.read(length)
        if zlib.crc32(body) != crc:
            raise corrupt("CRC mismatch")
        (json_len,) = struct.unpack_from("<I", body)
        stats = json.loads(body[4 : 4 + json_len])
        n = int(stats["num_samples"])
        if len(body) != 4 + json_len + 12 * n:
            raise corrupt(f"the index body of {len(body)} bytes does not hold {n} records")
        offsets = np.frombuffer(body, dtype="<u8", count=n, offset=4 + json_len).astype(np.int64)
        num_tokens = np.frombuffer(body, dtype="<u4", count=n, offset=4 + json_len + 8 * n).astype(np.int64)
        ends = np.append(offsets[1:], index_at)
        if n and (offsets[0] != self._records_start or (ends - offsets < _RECORD_HEAD.size + _BODY_HEAD.size).any()):
            raise corrupt("record offsets do not run from the header to the index")
        if int(num_tokens.max(initial=0)) != stats["max_num_tokens"]:
            raise corrupt(f"max_num_tokens {stats['max_num_tokens']} is not the longest sample's token count")
        index = RolloutDumpIndex(offsets, num_tokens, end=index_at, from_footer=True)
        return index, RolloutDumpStats(n, int(stats["max_num_tokens"]), stats["min_token_id"], stats["max_token_id"])

    def _scan(self, *, with_token_ids: bool) -> tuple[RolloutDumpIndex, Optional[RolloutDumpStats]]:
        """Index (and, reading every record's token ids, stats) from the record heads, seeking over bodies."""
        size = self._size()
        offsets, num_tokens = array("q"), array("q")
        low = high = None
        position, record = self._records_start, 0
        while position < size:
            self._file.seek(self._base + position)
            head = self._file.read(_RECORD_HEAD.size)
            if self._is_index(head[:4]):
                self._check_footer_end(position)
                break
            if len(head) < _RECORD_HEAD.size:
                self._truncated(record)
                break
            magic, length, _ = _RECORD_HEAD.unpack(head)
            if magic != RECORD_MAGIC:
                raise RolloutDumpError(f"record {record}: bad record magic {magic!r}")
            if position + _RECORD_HEAD.size + length > size:
                self._truncated(record)
                break
            t, _, meta_len = _BODY_HEAD.unpack(self._read_exact(_BODY_HEAD.size, f"record {record}"))
            if _BODY_HEAD.size + meta_len + 4 * t > length:
                raise RolloutDumpError(f"record {record}: {t} tokens do not fit its {length}-byte body")
            if with_token_ids and t:
                self._file.seek(meta_len, io.SEEK_CUR)
                ids = np.frombuffer(self._read_exact(4 * t, f"record {record}"), dtype="<i4")
                low = int(ids.min()) if low is None else min(low, int(ids.min()))
                high = int(ids.max()) if high is None else max(high, int(ids.max()))
            offsets.append(position)
            num_tokens.append(t)
            position += _RECORD_HEAD.size + length
            record += 1
        index = RolloutDumpIndex(np.asarray(offsets, dtype=np.int64), np.asarray(num_tokens, dtype=np.int64),
                                 end=position, from_footer=False)
        if not with_token_ids:
            return index, None
        return index, RolloutDumpStats(record, int(index.num_tokens.max(initial=0)), low, high)

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
        sample = RolloutSample(token_ids, loss_mask, logprobs, routes, meta)
        check_sample_values(sample, f"record {index}")  # the dump may come from elsewhere
        return sample

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


def check_records(reader: RolloutDumpReader, first: int = 0, stop: Optional[int] = None, *,
                  require_loss_field: bool = False) -> dict[str, Optional[int]]:
    """Reads records ``[first, stop)`` front to back, one in memory at a time, and checks each as training would.

    Every record's CRC, routes and values (log-probs finite and ``<= 0``, ``reward``
    and ``advantage`` finite numbers) are checked; the first bad record raises.

    Args:
        reader: The dump.
        first, stop: The records to read (default: all).
        require_loss_field: Refuse a record with neither a ``reward`` nor an ``advantage``
            (the policy-gradient loss needs one).

    Returns:
        For each of :data:`~megatron_r3.dataplane.sample_checks.LOSS_FIELDS`, the first record of the range
        without it in its metadata (None: every record has it).

    Raises:
        RolloutDumpError, RoutingValidationError, SampleValueError: naming the record.
    """
    missing: dict[str, Optional[int]] = dict.fromkeys(LOSS_FIELDS)
    for record in range(first, len(reader) if stop is None else stop):
        meta = reader.read(record).meta
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
    sample is read), else from a scan that reads every record's token ids (see
    the module docstring for the cost).

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
