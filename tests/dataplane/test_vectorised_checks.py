"""The vectorised paths of the host checks agree with their definitions and name what they refuse as before.

``rows_equal`` compares a row as one integer (or 8-byte words); ``token_id_array`` and
``logprob_array`` take a list of plain numbers in one numpy pass; ``json_line`` reads strict JSON
with orjson and falls back to the standard library. Each is checked against the plain definition
on the inputs its shortcut must not change, and on the inputs it must leave to the slow path.
"""

import json

import numpy as np
import pytest

from megatron_r3.dataplane.formats.jsonl import json_line
from megatron_r3.dataplane.route_checks import rows_equal
from megatron_r3.dataplane.sample_checks import SampleValueError, logprob_array, token_id_array


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("topk", [1, 2, 3, 4, 6, 8, 16])
def test_rows_equal_is_the_row_wise_all(dtype, topk):
    rng = np.random.default_rng(topk)
    ids = rng.integers(0, 3, (40, 5, topk)).astype(dtype)
    ids[::3] = 0
    ids[1::7, 2] = 0
    ids[5, 1, -1] = 1  # a row equal but for its last entry
    values = [0, 1] + ([-1] if np.dtype(dtype).kind == "i" else [])
    if np.dtype(dtype).kind == "i":
        ids[2::5, 3] = -1
        ids[4, 4, 0] = -1
    for value in values:
        np.testing.assert_array_equal(rows_equal(ids, value), (ids == value).all(axis=2))
        strided = ids[:, ::2]  # not contiguous: the plain reduction
        np.testing.assert_array_equal(rows_equal(strided, value), (strided == value).all(axis=2))
    assert not rows_equal(ids.astype(np.uint8), -1).any()  # -1 is no uint8 value


def test_token_ids_of_a_json_list_are_checked_as_one_array():
    np.testing.assert_array_equal(token_id_array([3, 0, 7], "sample 0", "token_ids", vocab_size=8), [3, 0, 7])
    for values, message in [
        ([3, True, 7], r"token_ids\[1\] = True is not an integer token id"),
        ([3, 7.0], r"token_ids\[1\] = 7.0 is not an integer token id"),
        ([3, 2**70], r"token_ids\[1\] = 1180591620717411303424 is outside \[0, 2\*\*31\)"),
        ([3, -1], r"token_ids\[1\] = -1 is outside"),
        ([3, 9], r"token_ids\[1\] = 9 is outside the vocabulary \[0, 8\)"),
    ]:
        with pytest.raises(SampleValueError, match=rf"sample 0: {message}"):
            token_id_array(values, "sample 0", "token_ids", vocab_size=8 if values[1] == 9 else None)


def test_logprobs_of_a_json_list_are_checked_as_one_array():
    np.testing.assert_allclose(logprob_array([-0.5, 0, -2], "s", "lp"), [-0.5, 0, -2])
    for values, message in [
        ([-0.5, False], r"s: lp\[1\]\[0\] = False is not a number"),
        ([-0.5, "-1"], r"s: lp\[1\]\[0\] = '-1' is not a number"),
        ([-0.5, None], r"s: lp\[1\]\[0\] = None is not a number"),
        ([-0.5, 0.25], r"s: token 4: lp\[1\] = 0.25: a rollout log-prob must be finite and <= 0"),
    ]:
        with pytest.raises(SampleValueError, match=message):
            logprob_array(values, "s", "lp", first_token=3, entry="[0]")


def test_json_lines_fall_back_to_the_standard_library_and_name_what_neither_reads():
    assert json_line(b'{"a": [1, 2.5, "x"]}\n', "f line 1", ValueError) == {"a": [1, 2.5, "x"]}
    nan = json_line(json.dumps({"lp": float("nan"), "big": 2**70}).encode(), "f line 2", ValueError)
    assert np.isnan(nan["lp"]) and nan["big"] == 2**70  # Python's json.dumps writes both; orjson refuses them
    assert json_line(b"  \n", "f line 3", ValueError) is None
    with pytest.raises(ValueError, match=r"f line 4: not UTF-8 text \(byte 0xff at column 3\)"):
        json_line(b'{"\xff": 1}', "f line 4", ValueError)
    with pytest.raises(ValueError, match=r"f line 5: not JSON \(Expecting"):
        json_line(b'{"a": }', "f line 5", ValueError)
