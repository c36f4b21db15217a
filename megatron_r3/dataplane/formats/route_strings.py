"""Base64 route strings cut out of a JSONL line's bytes before its JSON parse.

A rollout line of vLLM, SGLang or TensorRT-LLM is mostly one base64 string of routes
(``routed_experts``, ``prompt_routed_experts``, or the ``base64`` of ``{"dtype", "shape", "base64"}``):
200 MB of text for 100k tokens x 48 layers x top-8 in int32. A JSON parser reads it a character at a
time, looking for escapes (orjson: 0.6 s of such a file, most of the conversion). :func:`parse_route_strings`
finds each such string by its key, takes its bytes as the same ASCII ``str`` in one copy, and parses the
rest of the line as JSON, the strings put back in their place. A string that holds an escape or a
non-ASCII byte stays in the text for the JSON parser. The strings are checked where they are decoded
(strict base64), so a control character in one is refused there, naming the field, rather than by the
JSON parse.
"""

from __future__ import annotations

import re
from typing import Callable

from megatron_r3.dataplane.formats.line_placeholders import parse_cut_line

ROUTE_STRING_KEYS = ("routed_experts", "prompt_routed_experts", "base64")
_ROUTE_STRING = re.compile(rb'"(' + b"|".join(k.encode() for k in ROUTE_STRING_KEYS) + rb')"[ \t\r\n]*:[ \t\r\n]*"')


def parse_route_strings(raw: bytes, parse_json: Callable[[bytes], object]) -> object:
    """One JSONL line's value, its route strings (:data:`ROUTE_STRING_KEYS`) cut out before the JSON parse.

    Args:
        raw: The line's bytes.
        parse_json: What parses the rest of the line (and the whole line, where this path does not apply).
    """
    return parse_cut_line(raw, route_string_cuts(raw), ROUTE_STRING_KEYS, parse_json)


def route_string_cuts(raw: bytes) -> list:
    """``(begin, end, text)`` of each route string of the line without escapes or non-ASCII bytes: ``raw[begin:end]``
    the string with its quotes, ``text`` its content as a ``str``."""
    view = memoryview(raw)
    cuts, search_from = [], 0
    while (match := _ROUTE_STRING.search(raw, search_from)) is not None:
        begin = match.end()
        end = raw.find(b'"', begin)
        if end < 0:  # an unterminated string: the JSON parser names it
            break
        search_from = end + 1
        if raw.find(b"\\", begin, end) >= 0:
            continue
        try:
            text = str(view[begin:end], "ascii")
        except UnicodeDecodeError:
            continue
        cuts.append((begin - 1, end + 1, text))
    return cuts
