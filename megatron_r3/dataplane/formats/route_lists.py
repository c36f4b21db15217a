"""Megatron's route lists read straight from a JSONL line's bytes, without a Python int per expert id.

Megatron's text-generation server sends ``moe_topk_indices`` (and ``prompt_moe_topk_indices``,
``routing_indices``) as JSON nested lists: 38.4M numbers for 100k tokens x 48 layers x top-8,
which a JSON parser turns into as many Python ints (9 MB/s of routes). :func:`parse_route_lists`
cuts each such list out of the line, parses it with the C++ parser of ``megatron_r3._C``
(strict: integers in int32 range, rectangular, nothing but JSON whitespace, brackets and commas)
and parses the rest of the line as JSON, the arrays put back in their place. A list the parser
refuses stays in the text, for the general path to read and name what is wrong; so does every
list where the extension is not built.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

import numpy as np
import torch  # noqa: F401  (loads libc10, which _C links against)

from megatron_r3.dataplane.formats.line_placeholders import parse_with_cut

try:
    from megatron_r3 import _C
except ImportError:  # extension not built: the general JSON path reads every line
    _C = None
if not hasattr(_C, "parse_int_lists"):  # an extension built before the parser was: likewise
    _C = None

ROUTE_LIST_KEYS = ("moe_topk_indices", "prompt_moe_topk_indices", "routing_indices")
_ROUTE_LIST = re.compile(rb'"(' + b"|".join(k.encode() for k in ROUTE_LIST_KEYS) + rb')"[ \t\r\n]*:[ \t\r\n]*\[')


def parse_int_lists(text: bytes, start: int = 0) -> tuple[np.ndarray, int]:
    """The JSON nested integer lists at ``text[start:]`` as an int32 array, and the offset after them.

    Raises:
        RuntimeError: anything but strict, rectangular, non-empty integer lists in int32 range
            (the message gives the byte offset); ImportError without the compiled extension.
    """
    if _C is None:
        raise ImportError("megatron_r3._C is not built (make install)")
    flat, shape, end = _C.parse_int_lists(text, start)
    return flat.numpy().reshape(shape), end


def parse_route_lists(raw: bytes, parse_json: Callable[[bytes], object]) -> object:
    """One JSONL line's value, its route lists (:data:`ROUTE_LIST_KEYS`) read by :func:`parse_int_lists`.

    Args:
        raw: The line's bytes.
        parse_json: What parses the rest of the line (and the whole line, where this path does not apply).
    """
    if _C is None:
        return parse_json(raw)
    # A key that is not a JSON key (inside a string) cannot be told from the bytes alone: the placeholders
    # must all come back as the values of route keys, or the line is read the general way.
    nonce = os.urandom(8).hex()
    pieces, arrays, at, search_from = [], {}, 0, 0
    # The next key is searched for after each list cut out, not inside it: the lists are most of the line.
    while (match := _ROUTE_LIST.search(raw, search_from)) is not None:
        begin = search_from = match.end() - 1
        try:
            array, end = parse_int_lists(raw, begin)
        except RuntimeError:  # left for the general path, which names the fault
            continue
        name = f"r3-route-list {nonce} {len(arrays)}"
        arrays[name] = array
        pieces += [raw[at:begin], b'"', name.encode(), b'"']
        at = search_from = end
    pieces.append(raw[at:])
    return parse_with_cut(raw, pieces, arrays, ROUTE_LIST_KEYS, parse_json)

