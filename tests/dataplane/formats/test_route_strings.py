"""Base64 route strings cut out before the JSON parse, and vLLM's JSON log-prob positions read in one pass,
each against the plain JSON reference on random and adversarial lines."""

import base64
import io
import json

import numpy as np
import pytest

from megatron_r3.dataplane.engines.adapters import route_array
from megatron_r3.dataplane.engines.engine_samples import _chosen_logprobs
from megatron_r3.dataplane.formats.jsonl import json_line
from megatron_r3.dataplane.formats.route_strings import parse_route_strings
from tools.dump_rollouts import InputLineError, _positions


def _json(raw):
    return json_line(raw, "f line 1", InputLineError)


def _npy_base64(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _routes(rng, dtype):
    """Routes of an odd token count with the dtype's edge values, a -1 row (signed) and ids >= 128."""
    info = np.iinfo(dtype)
    rows = rng.integers(0, 128, (int(rng.integers(1, 40)) * 2 + 1, 3, 5)).astype(dtype)
    rows[0, 0, :2] = [info.max, max(info.min, 128)]
    if info.min < 0:
        rows[-1] = -1
    return rows


@pytest.mark.parametrize("seed", range(8))
def test_random_lines_match_the_json_reference(seed):
    rng = np.random.default_rng(seed)
    dtype = [np.uint8, np.uint16, np.int16, np.int32][seed % 4]
    routes = _routes(rng, dtype)
    as_dict = {"dtype": np.dtype(dtype).name, "shape": list(routes.shape),
               "base64": base64.b64encode(routes.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode()}
    record = {"request_id": "r", "text": 'quoted \\"routed_experts\\": \\"AAAA\\" and \u00e9', "prompt_token_ids": [1, 2],
              "prompt_routed_experts": as_dict if seed % 2 else _npy_base64(routes),
              "outputs": [{"logprobs": [{"5": {"logprob": -0.5}}] * 3, "routed_experts": _npy_base64(routes)},
                          {"routed_experts": as_dict, "base64": "QUJD", "meta": {"routed_experts": ""}}]}
    separators = [(",", ":"), (", ", ": "), (" ,\n", " :\t")][seed % 3]
    raw = json.dumps(record, separators=separators).encode()
    got = parse_route_strings(raw, _json)
    assert got == _json(raw)
    np.testing.assert_array_equal(route_array(got["outputs"][0]["routed_experts"], "routed_experts"), routes)
    np.testing.assert_array_equal(route_array(got["outputs"][1]["routed_experts"], "routed_experts"), routes)


@pytest.mark.parametrize("raw", [
    b'{"routed_experts": "QUJD\\/"}',                          # an escape: left to the JSON parser
    b'{"routed_experts": "\xc3\xa9QUJD"}',                      # not ASCII: likewise
    b'{"text": "a\\"routed_experts\\": \\"QUJD", "x": 1}',      # the key inside a string
    b'{"routed_experts": ["QUJD", "routed_experts"]}',
    b'{"routed_experts": "QUJD", "other": "r3-route-string"}',
    b'{"base64": "QUJD", "a": [{"base64": "RA=="}, {"b": {"routed_experts": "x"}}]}',
    b"   ", b"",
])
def test_edge_lines_match_the_json_reference(raw):
    assert parse_route_strings(raw, _json) == _json(raw)


@pytest.mark.parametrize("raw", [
    b'{"routed_experts": "QUJD"',                               # unterminated object
    b'{"routed_experts": "QUJD}',                               # unterminated string
    b'{"routed_experts": "QUJD", "x": }',
    b'{"routed_experts": "QUJD" "x": 1}',
    b'{"routed_experts": "QU\xffJD"}',                          # not UTF-8
    b'["routed_experts": "QUJD"]',
])
def test_bad_lines_are_named_as_the_json_reference_names_them(raw):
    with pytest.raises(InputLineError) as reference:
        _json(raw)
    with pytest.raises(InputLineError) as got:
        parse_route_strings(raw, _json)
    assert str(got.value) == str(reference.value)


def _slow(positions):
    """The same positions as a plain list: the adapter reads them one at a time."""
    return [positions[i] for i in range(len(positions))]


@pytest.mark.parametrize("seed", range(6))
def test_chosen_logprobs_match_the_position_by_position_path(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, int(rng.integers(1, 30)))
    raw = [{str(t): {"logprob": float(-rng.random()), "rank": 1}, str(t + 1): {"logprob": -9.0}} for t in tokens]
    fault = seed % 6
    broken = int(rng.integers(0, len(tokens)))
    if fault == 1:
        raw[broken] = {str(tokens[broken] + 1): {"logprob": -1.0}}  # the chosen token missing
    elif fault == 2:
        raw[broken] = None
    elif fault == 3:
        raw[broken][str(tokens[broken])] = {"rank": 1}  # no logprob
    elif fault == 4:
        raw[broken][str(tokens[broken])] = [-1.0]
    elif fault == 5:
        raw[broken][str(tokens[broken])]["logprob"] = "x"
    outcomes = []
    for positions in (_positions(raw, "logprobs"), _slow(_positions(raw, "logprobs"))):
        try:
            outcomes.append(_chosen_logprobs(positions, tokens, "request 'r' sample 0", "logprobs", first=4).tolist())
        except ValueError as error:  # InputLineError, RoutingValidationError, SampleValueError
            outcomes.append((type(error), str(error)))
    assert outcomes[0] == outcomes[1]
    assert isinstance(outcomes[0], list) == (fault == 0)


def test_sliced_positions_keep_their_numbers_in_messages():
    positions = _positions([None, {"1": {"logprob": -1.0}}, {"2": {"rank": 1}}], "prompt_logprobs")
    tail = positions[1:]
    assert len(tail) == 2 and tail[0].index == 1 and positions[0] is None and positions[-1].index == 2
    with pytest.raises(InputLineError, match=r"prompt_logprobs\[2\]\[2\]"):
        _chosen_logprobs(tail, np.array([1, 2]), "request 'r'", "prompt_logprobs", first=1, offset=1)


@pytest.mark.parametrize("content", [b"", b"\n", b"a", b"a\nb", b"a\r\n\nb\n", b"\n\n{}\n", b"x" * 70000 + b"\ny"])
def test_mapped_lines_match_buffered_lines(tmp_path, content):
    from tools.dump_rollouts import _lines

    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    assert list(_lines(str(path))) == io.BytesIO(content).readlines()


def test_a_mapped_file_truncated_while_read_is_refused(tmp_path):
    from tools.dump_rollouts import _lines

    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a" * 10000 + b"\n" + b"b" * 10000 + b"\n")
    lines = _lines(str(path))
    assert next(lines) == b"a" * 10000 + b"\n"
    path.write_bytes(b"")  # truncated in place, as another writer would
    with pytest.raises(InputLineError, match=r"shrank from 20002 to 0 bytes while being read"):
        next(lines)
