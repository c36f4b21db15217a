"""vLLM's per-position log-probs cut out of a JSONL line's bytes and read without a Python object per position.

A ``RequestOutput`` line gives each generated token's log-probs as ``[{"<token id>": {"logprob": -0.31,
"rank": 1, ...}}, ...]``: 3000 positions a completion, three Python objects each once parsed, whose
allocation sets off the interpreter's cyclic garbage collector over every object of the process (torch's
included): the parse of a 100k-token file's lines took 0.16 s with torch imported, 0.045 s with the collector
off.
:func:`logprob_position_cuts` finds each ``"logprobs": [{`` of a line and reads the array with the C++
scanner of ``megatron_r3._C`` (strict: see csrc/logprob_positions_cpu.cpp) into flat arrays. An array the
scanner refuses stays in the text, for the general path to read and name what is wrong; so does every array
where the extension is not built.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import numpy as np
import orjson
import torch  # noqa: F401  (loads libc10, which _C links against)

try:
    from megatron_r3 import _C
except ImportError:  # extension not built: the general JSON path reads every line
    _C = None
if not hasattr(_C, "parse_logprob_positions"):  # an extension built before the scanner was: likewise
    _C = None

LOGPROB_KEYS = ("logprobs",)
_LOGPROBS = re.compile(rb'"logprobs"[ \t\r\n]*:[ \t\r\n]*(\[)[ \t\r\n]*\{')


class LogprobPositions:
    """One ``logprobs`` array as the scanner read it: every entry's token id and log-prob, and each position's
    entry count. :meth:`chosen_logprobs` answers in one pass; anything else (a position without its token, a
    token twice in one position) is left to the general path's positions (:meth:`with_general`), read from the
    array's own text, so that it names the fault as it would have without the scanner."""

    __slots__ = ("tokens", "logprobs", "counts", "text", "read", "_general")

    def __init__(self, tokens: np.ndarray, logprobs: np.ndarray, counts: np.ndarray, text: bytes):
        self.tokens, self.logprobs, self.counts, self.text = tokens, logprobs, counts, text
        self.read: Optional[Callable[[list], object]] = None
        self._general = None

    def with_general(self, read: Callable[[list], object]) -> "LogprobPositions":
        """Sets what turns the array's parsed JSON into the general path's positions; returns self."""
        self.read = read
        return self

    def general(self):
        """The general path's positions (the array's text parsed as JSON and given to ``read``)."""
        if self._general is None:
            self._general = self.read(orjson.loads(self.text))
        return self._general

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, index):
        return self.general()[index]

    def __iter__(self):
        return iter(self.general())

    def chosen_logprobs(self, tokens) -> Optional[np.ndarray]:
        """Each position's log-prob (float64) for its token in ``tokens``, or None where a position lacks its
        token or holds it more than once (a JSON object's repeated key: the general path decides)."""
        wanted = np.asarray(tokens, np.int64)
        if len(wanted) != len(self.counts):
            return None
        if len(self.tokens) == len(self.counts):  # one entry a position: SamplingParams(logprobs=0)
            return self.logprobs if np.array_equal(self.tokens, wanted) else None
        position = np.repeat(np.arange(len(self.counts)), self.counts)
        hit = self.tokens == wanted[position]
        if not np.array_equal(np.bincount(position[hit], minlength=len(self.counts)), np.ones(len(self.counts))):
            return None
        return self.logprobs[hit]


def logprob_position_cuts(raw: bytes, skip: list = ()) -> list:
    """``(begin, end, LogprobPositions)`` of each ``logprobs`` array of objects the scanner reads in the line.

    Args:
        skip: ``(begin, end, ...)`` spans of the line not searched, in order (its route strings: most of its
            bytes, where a search would cost more than the scan).
    """
    if _C is None:
        return []
    cuts, at = [], 0
    starts = [0] + [end for _, end, *_ in skip]
    stops = [begin for begin, *_ in skip] + [len(raw)]
    for start, stop in zip(starts, stops):
        at = max(at, start)
        while (at := raw.find(b'"logprobs"', at, stop)) >= 0:
            match = _LOGPROBS.match(raw, at)
            at += 1
            if match is None:
                continue
            begin = match.start(1)
            try:
                tokens, logprobs, counts, end = _C.parse_logprob_positions(raw, begin)
            except RuntimeError:  # left for the general path, which names the fault
                continue
            cuts.append((begin, end, LogprobPositions(tokens.numpy(), logprobs.numpy(), counts.numpy(),
                                                      raw[begin:end])))
            at = end
    return cuts
