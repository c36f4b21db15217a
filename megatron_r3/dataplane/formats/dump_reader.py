"""Reading a rollout dump (:mod:`megatron_r3.dataplane.formats.rollout_dump`): streamed, or one record by its index.

Records are checked against their CRC whenever they are read, and routes and
values are validated again (a dump may come from elsewhere): rollout log-probs
finite and ``<= 0``, a ``reward`` or ``advantage`` a finite number
(:mod:`megatron_r3.dataplane.sample_checks`).

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
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from array import array
from typing import BinaryIO, Iterator, Optional, Union

import numpy as np

from megatron_r3.dataplane.formats.rollout_dump import (
    BODY_HEAD,
    FOOTER_MAGIC,
    HAS_LOGPROBS,
    HAS_ROUTES,
    INDEX_MAGIC,
    MAGIC,
    READABLE_VERSIONS,
    RECORD_HEAD,
    RECORD_MAGIC,
    TRAILER,
    RolloutDumpError,
    RolloutDumpIndex,
    RolloutDumpStats,
)
from megatron_r3.dataplane.route_checks import validate_routes
from megatron_r3.dataplane.routes import RolloutRoutes, id_dtype
from megatron_r3.dataplane.sample_checks import check_sample_values
from megatron_r3.dataplane.samples import RolloutSample


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
            raise RolloutDumpError(f"{self.name} is not a megatron-r3 rollout dump (magic {magic!r})")
        self.version = int.from_bytes(magic[6:], "big")
        if self.version not in READABLE_VERSIONS:
            raise RolloutDumpError(
                f"rollout dump {self.name}: format version {self.version} is not supported: this reader reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (route validity per token); write the dump again"
            )
        (json_len,) = struct.unpack("<I", self._read_exact(4, "header"))
        self._records_start = len(MAGIC) + 4 + json_len
        self.num_experts, self.topk, self.layer_numbers, self._dtype = self._header(
            self._read_exact(json_len, "header"))
        self._index: Optional[RolloutDumpIndex] = None
        self._stats: Optional[RolloutDumpStats] = None

    def _header(self, text: bytes) -> tuple[int, int, tuple[int, ...], np.dtype]:
        """The header's fields, each checked: a damaged header is named, field by field."""
        def bad(why: str) -> RolloutDumpError:
            return RolloutDumpError(f"rollout dump {self.name}: header: {why}")

        try:
            header = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise bad(f"not a JSON object ({error})") from None
        if not isinstance(header, dict):
            raise bad(f"a JSON object is expected, got {type(header).__name__}")
        missing = [key for key in ("num_experts", "topk", "layer_numbers", "id_dtype") if key not in header]
        if missing:
            raise bad(f"no {', '.join(repr(key) for key in missing)}")
        for key in ("num_experts", "topk"):
            if isinstance(header[key], bool) or not isinstance(header[key], int) or header[key] < 1:
                raise bad(f"{key} = {header[key]!r} is not an integer >= 1")
        layers = header["layer_numbers"]
        if (not isinstance(layers, list) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers)
                or layers != sorted(set(layers))):
            raise bad(f"layer_numbers = {layers!r} is not a list of increasing layer numbers >= 1")
        if header["num_experts"] > 32768:
            raise bad(f"num_experts = {header['num_experts']} do not fit int16 routing ids")
        wanted = id_dtype(header["num_experts"])
        if header["id_dtype"] != wanted.name:
            raise bad(f"id_dtype = {header['id_dtype']!r} does not fit {header['num_experts']} experts (it is "
                      f"{wanted.name!r})")
        return header["num_experts"], header["topk"], tuple(layers), wanted.newbyteorder("<")

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
        head = self._file.read(RECORD_HEAD.size)
        if len(head) < RECORD_HEAD.size:
            raise RolloutDumpError(f"record {record}: truncated at offset {offset}, where the index has it")
        magic, body_len, crc = RECORD_HEAD.unpack(head)
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
            head = self._file.read(RECORD_HEAD.size)
            if self._is_index(head[:4]):
                self._check_footer_end(position)
                return
            if not head:
                return
            if len(head) < RECORD_HEAD.size:
                if self._truncated(record):
                    return
            magic, length, crc = RECORD_HEAD.unpack(head)
            if magic != RECORD_MAGIC:
                raise RolloutDumpError(f"record {record}: bad record magic {magic!r}")
            body = self._file.read(length)
            if len(body) < length:
                if self._truncated(record):
                    return
            yield self._decode(self._checked(body, crc, record), record)
            position += RECORD_HEAD.size + length
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
        head = self._file.read(RECORD_HEAD.size)
        if len(head) < RECORD_HEAD.size:
            return
        end = index_at + RECORD_HEAD.size + RECORD_HEAD.unpack(head)[1] + TRAILER.size
        if size > end:
            raise RolloutDumpError(f"rollout dump {self.name}: {size - end} bytes follow its footer, which ends at "
                                   f"byte {end} (data appended to a finished dump?)")
        if size == end:
            self._file.seek(self._base + end - TRAILER.size)
            at, magic = TRAILER.unpack(self._file.read(TRAILER.size))
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
        if self.version < 3 or size < self._records_start + RECORD_HEAD.size + TRAILER.size:
            return None
        self._file.seek(self._base + size - TRAILER.size)
        index_at, magic = TRAILER.unpack(self._file.read(TRAILER.size))
        if magic != FOOTER_MAGIC:
            return None

        def corrupt(why: str) -> RolloutDumpError:
            return RolloutDumpError(f"rollout dump {self.name}: corrupt footer: {why}")

        if not self._records_start <= index_at <= size - TRAILER.size - RECORD_HEAD.size:
            raise corrupt(f"index offset {index_at} lies outside the file of {size} bytes")
        self._file.seek(self._base + index_at)
        magic, length, crc = RECORD_HEAD.unpack(self._file.read(RECORD_HEAD.size))
        if magic == INDEX_MAGIC and index_at + RECORD_HEAD.size + length + TRAILER.size < size:
            self._check_footer_end(index_at)  # a whole footer, then bytes that end like one
        if magic != INDEX_MAGIC or index_at + RECORD_HEAD.size + length + TRAILER.size != size:
            raise corrupt(f"no index record of the right length at offset {index_at}")
        body = self._file.read(length)
        if zlib.crc32(body) != crc:
            raise corrupt("CRC mismatch")
        if len(body) < 4:
            raise corrupt(f"the index body of {len(body)} bytes has no room for its length field")
        (json_len,) = struct.unpack_from("<I", body)
        try:
            stats = json.loads(body[4 : 4 + json_len])
            n = int(stats["num_samples"])
            max_num_tokens = int(stats["max_num_tokens"])
            low, high = stats["min_token_id"], stats["max_token_id"]
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, ValueError) as error:
            raise corrupt(f"its stats are not the JSON object expected ({type(error).__name__}: {error})") from None
        if len(body) != 4 + json_len + 12 * n:
            raise corrupt(f"the index body of {len(body)} bytes does not hold {n} records")
        offsets = np.frombuffer(body, dtype="<u8", count=n, offset=4 + json_len).astype(np.int64)
        num_tokens = np.frombuffer(body, dtype="<u4", count=n, offset=4 + json_len + 8 * n).astype(np.int64)
        ends = np.append(offsets[1:], index_at)
        if n and (offsets[0] != self._records_start or (ends - offsets < RECORD_HEAD.size + BODY_HEAD.size).any()):
            raise corrupt("record offsets do not run from the header to the index")
        if int(num_tokens.max(initial=0)) != max_num_tokens:
            raise corrupt(f"max_num_tokens {max_num_tokens} is not the longest sample's token count")
        index = RolloutDumpIndex(offsets, num_tokens, end=index_at, from_footer=True)
        return index, RolloutDumpStats(n, max_num_tokens, low, high)

    def _scan(self, *, with_token_ids: bool) -> tuple[RolloutDumpIndex, Optional[RolloutDumpStats]]:
        """Index (and, reading every record's token ids, stats) from the record heads, seeking over bodies."""
        size = self._size()
        offsets, num_tokens = array("q"), array("q")
        low = high = None
        position, record = self._records_start, 0
        while position < size:
            self._file.seek(self._base + position)
            head = self._file.read(RECORD_HEAD.size)
            if self._is_index(head[:4]):
                self._check_footer_end(position)
                break
            if len(head) < RECORD_HEAD.size:
                self._truncated(record)
                break
            magic, length, _ = RECORD_HEAD.unpack(head)
            if magic != RECORD_MAGIC:
                raise RolloutDumpError(f"record {record}: bad record magic {magic!r}")
            if position + RECORD_HEAD.size + length > size:
                self._truncated(record)
                break
            t, _, meta_len = BODY_HEAD.unpack(self._read_exact(BODY_HEAD.size, f"record {record}"))
            if BODY_HEAD.size + meta_len + 4 * t > length:
                raise RolloutDumpError(f"record {record}: {t} tokens do not fit its {length}-byte body")
            if with_token_ids and t:
                self._file.seek(meta_len, io.SEEK_CUR)
                ids = np.frombuffer(self._read_exact(4 * t, f"record {record}"), dtype="<i4")
                low = int(ids.min()) if low is None else min(low, int(ids.min()))
                high = int(ids.max()) if high is None else max(high, int(ids.max()))
            offsets.append(position)
            num_tokens.append(t)
            position += RECORD_HEAD.size + length
            record += 1
        index = RolloutDumpIndex(np.asarray(offsets, dtype=np.int64), np.asarray(num_tokens, dtype=np.int64),
                                 end=position, from_footer=False)
        if not with_token_ids:
            return index, None
        return index, RolloutDumpStats(record, int(index.num_tokens.max(initial=0)), low, high)

    def _decode(self, body: memoryview, index: int) -> RolloutSample:
        if len(body) < BODY_HEAD.size:
            raise RolloutDumpError(f"record {index}: a body of {len(body)} bytes has no room for its "
                                   f"{BODY_HEAD.size}-byte head")
        t, flags, meta_len = BODY_HEAD.unpack_from(body)
        per_token = 5 + (4 if flags & HAS_LOGPROBS else 0)  # token id, loss mask, log-prob
        if flags & HAS_ROUTES:
            per_token += len(self.layer_numbers) * self.topk * self._dtype.itemsize + 1  # routes, validity
        needed = BODY_HEAD.size + meta_len + t * per_token
        if flags & ~(HAS_LOGPROBS | HAS_ROUTES) or needed != len(body):
            raise RolloutDumpError(f"record {index}: its body of {len(body)} bytes does not hold what its head "
                                   f"says (num_tokens {t}, flags {flags:#x}, meta_len {meta_len}: {needed} bytes)")
        at = BODY_HEAD.size
        try:
            meta = json.loads(bytes(body[at : at + meta_len]))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RolloutDumpError(f"record {index}: meta is not JSON ({error})") from None
        if not isinstance(meta, dict):
            raise RolloutDumpError(f"record {index}: meta must be a JSON object, got {type(meta).__name__}")
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
        logprobs = take("<f4", (t,)) if flags & HAS_LOGPROBS else None
        routes = None
        if flags & HAS_ROUTES:
            n_layers = len(self.layer_numbers)
            ids = take(self._dtype, (t, n_layers, self.topk))
            valid = take(np.uint8, (t,)).astype(np.bool_)
            validate_routes(ids, valid, num_experts=self.num_experts, topk=self.topk,
                            layer_numbers=self.layer_numbers, sample=index)
            routes = RolloutRoutes(ids, valid, self.num_experts, self.layer_numbers)
        sample = RolloutSample(token_ids, loss_mask, logprobs, routes, meta)
        check_sample_values(sample, f"record {index}")  # the dump may come from elsewhere
        return sample

    def _read_exact(self, n: int, what: str) -> bytes:
        data = self._file.read(n)
        if len(data) != n:
            raise RolloutDumpError(f"rollout dump {self.name}: {what}: truncated ({len(data)} of {n} bytes)"
                                   if what == "header" else f"{what}: truncated ({len(data)} of {n} bytes)")
        return data

    def close(self) -> None:
        if self._owns:
            self._file.close()

    def __enter__(self) -> "RolloutDumpReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

