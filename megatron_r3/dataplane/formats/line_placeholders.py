"""Values cut out of a JSONL line before its JSON parse, put back in their place after it."""

from __future__ import annotations

import os
from typing import Callable, Optional


def parse_cut_line(raw: bytes, cuts: list, keys: tuple, parse_json: Callable[[bytes], object]) -> object:
    """The line's value, each ``(begin, end, value)`` of ``cuts`` (``raw[begin:end]`` a JSON value of one of
    ``keys``) parsed as ``value`` (:func:`parse_with_cut`). Cuts that overlap (one inside another's text) leave
    the whole line to the general path."""
    # A key that is not a JSON key (inside a string) cannot be told from the bytes alone: the placeholders must
    # all come back as the values of the keys, or the line is read the general way.
    nonce = os.urandom(8).hex()
    view = memoryview(raw)
    pieces, values, at = [], {}, 0
    for begin, end, value in sorted(cuts, key=lambda cut: cut[0]):
        if begin < at:
            return parse_json(raw)
        name = f"r3-cut {nonce} {len(values)}"
        values[name] = value
        pieces += [view[at:begin], b'"', name.encode(), b'"']
        at = end
    pieces.append(view[at:])
    return parse_with_cut(raw, pieces, values, keys, parse_json)


def parse_with_cut(raw: bytes, pieces: list, cut: dict, keys: tuple, parse_json: Callable[[bytes], object]) -> object:
    """The line's value: ``pieces`` (its bytes, each cut value replaced by its placeholder) parsed and ``cut``
    put back. The whole line is parsed the general way where nothing was cut, where the rest does not parse
    (the line's own fault, named as the general path names it: its columns) or where a placeholder does not
    come back as the value of one of ``keys`` (a key inside a string)."""
    if not cut:
        return parse_json(raw)
    try:
        value = parse_json(b"".join(pieces))
    except ValueError:
        return parse_json(raw)
    if put_back(value, cut, keys) != len(cut):
        return parse_json(raw)
    return value


def put_back(value: object, cut: dict, keys: tuple, wanted: Optional[int] = None) -> int:
    """Replaces each placeholder string (a key of ``cut``) that is the value of one of ``keys`` by
    ``cut[placeholder]``; returns how many were. A placeholder anywhere else stays as it is: the caller
    compares the count with ``len(cut)`` and reads the line the general way where they differ.

    The walk stops once ``wanted`` (default: all of ``cut``) are back, and enters a dict's objects before its
    arrays: the routes sit beside arrays of thousands of log-prob objects, which it then need not walk.
    """
    wanted = len(cut) if wanted is None else wanted
    found = 0
    if isinstance(value, dict):
        objects, arrays = [], []
        for key, item in value.items():
            if isinstance(item, str):
                if key in keys and item in cut:
                    value[key] = cut[item]
                    found += 1
            elif isinstance(item, dict):
                objects.append(item)
            elif isinstance(item, list) and _holds_containers(item):
                arrays.append(item)
        for item in objects + arrays:
            if found >= wanted:
                break
            found += put_back(item, cut, keys, wanted - found)
    elif isinstance(value, list):
        for item in value:
            if found >= wanted:
                break
            if isinstance(item, (dict, list)):
                found += put_back(item, cut, keys, wanted - found)
    return found


def _holds_containers(value: object) -> bool:
    """Whether a JSON value may hold a dict (a list of numbers, as token ids are, need not be walked)."""
    return isinstance(value, dict) or (bool(value) and isinstance(value[0], (dict, list)))
