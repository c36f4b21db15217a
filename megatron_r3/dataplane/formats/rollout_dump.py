"""The rollout dump: an append-only, streamable file of rollout samples with their routes.

A launcher writes what the rollout engine produced (tokens, loss mask, rollout
log-probs, routes) with :class:`~megatron_r3.dataplane.formats.dump_writer.RolloutDumpWriter`
and a trainer reads it back one sample at a time with
:class:`~megatron_r3.dataplane.formats.dump_reader.RolloutDumpReader`, so rollouts larger
than memory can be replayed: streamed front to back, or one record at a time by
its index (what a data-parallel rank does, see :mod:`megatron_r3.dataplane.formats.rollout_shards`).
:mod:`megatron_r3.dataplane.formats.dump_checks` checks a dump before a run trains on it.
This module holds the format: its layout, constants and the types reader and
writer share. Layout (little-endian throughout):

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

Footer, written when the writer closes the dump (a writer that finished)::

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
memory.

Versions: version 3 added the footer and left header and records as they were in
version 2, so a version 2 dump still reads (it is indexed by a scan, like a
version 3 dump whose writer died). A version 1 dump (``route_valid [T, L]``) is
rejected, not converted.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

FORMAT_VERSION = 3  # 3: index and stats in a footer; 2: route_valid per token; 1: per token and layer
READABLE_VERSIONS = (2, 3)
MAGIC = b"R3DUMP" + FORMAT_VERSION.to_bytes(2, "big")
RECORD_MAGIC = b"R3RC"
INDEX_MAGIC = b"R3IX"
FOOTER_MAGIC = b"R3FOOTER"
RECORD_HEAD = struct.Struct("<4sQI")  # magic, body_len, crc32: of a sample's record and of the index record
BODY_HEAD = struct.Struct("<III")  # num_tokens, flags, meta_len
TRAILER = struct.Struct("<Q8s")  # index_at, FOOTER_MAGIC
HAS_LOGPROBS, HAS_ROUTES = 1, 2  # bits of a body's flags


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
        return int(after - self.offsets[record]) - RECORD_HEAD.size


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
