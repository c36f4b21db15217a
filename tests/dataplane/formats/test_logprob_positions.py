"""vLLM's JSON per-position log-probs read by the C++ scanner, against the general JSON path: the scanner's
entries against orjson's parse on random arrays, what it refuses, and whole vLLM lines converted both ways
(samples bit for bit, bad lines named identically)."""

import base64
import io
import json
import math

import numpy as np
import orjson
import pytest

from megatron_r3.dataplane.formats import logprob_positions
from megatron_r3.dataplane.samples import RoutingSpec
from tools.dump_rollouts import dump_jsonl

pytestmark = pytest.mark.skipif(logprob_positions._C is None, reason="megatron_r3._C without the scanner")

SPEC = RoutingSpec(num_layers=2, model_moe_layers=(1, 2), num_experts=16, topk=2)


def _number(rng):
    """A log-prob as engines and other writers spell it: repr of a double, exponents, integers, -0."""
    kind = int(rng.integers(0, 8))
    value = -float(rng.random()) * 10 ** int(rng.integers(-8, 3))
    if kind == 0:
        return repr(value)
    if kind == 1:
        return f"{value:.17e}"
    if kind == 2:
        return f"{value:.3E}".replace("E-0", "e-")
    if kind == 3:
        return str(-int(rng.integers(0, 10 ** 15)))
    if kind == 4:
        return ["-0", "0", "-0.0", "0.0", "-0e0", "-1e-320", "-2.2250738585072014e-308", "-1E+2"][int(rng.integers(8))]
    if kind == 5:
        return f"{value:.25f}"
    return repr(float(np.float32(value)))


def _scalar(rng):
    return ['1', '-3', 'null', 'true', 'false', '"a"', '"\\n\\"\\\\\\/\\u00e9\\uD7ff"', '""', '1.5e3'][int(rng.integers(9))]


def _random_array(rng):
    """A random log-prob array in the scanner's grammar, with random spacing."""
    space = [lambda: "", lambda: " ", lambda: " \n\t\r "][int(rng.integers(3))]
    positions = []
    for _ in range(int(rng.integers(1, 12))):
        items, seen = [], set()
        for _ in range(int(rng.integers(1, 4))):
            token = int(rng.integers(0, 10 ** int(rng.integers(1, 10))))
            if token in seen:
                continue
            seen.add(token)
            number = _number(rng)
            fields = [f'"logprob"{space()}:{space()}{number}'] + [
                f'"{name}"{space()}:{space()}{_scalar(rng)}' for name in ("rank", "decoded_token")[:int(rng.integers(3))]]
            rng.shuffle(fields)
            items.append(f'"{token}"{space()}:{space()}{{{space()}{(space() + "," + space()).join(fields)}{space()}}}')
        positions.append(f"{{{space()}{(',' + space()).join(items)}{space()}}}")
    return f"[{space()}{(',' + space()).join(positions)}{space()}]".encode()


@pytest.mark.parametrize("seed", range(40))
def test_scanned_entries_match_the_json_parse(seed):
    rng = np.random.default_rng(seed)
    text = _random_array(rng)
    line = b'{"logprobs": ' + text + b', "x": 1}'
    tokens, logprobs, counts, end = logprob_positions._C.parse_logprob_positions(line, 13)
    assert line[end:] == b', "x": 1}'
    parsed = orjson.loads(text)
    assert counts.tolist() == [len(p) for p in parsed]
    reference = [(int(token), float(entry["logprob"])) for position in parsed for token, entry in position.items()]
    assert tokens.tolist() == [token for token, _ in reference]
    # Bit for bit, the sign of a zero included: an integer literal is the integer (JSON's -0 is 0).
    assert logprobs.tolist() == [v for _, v in reference]
    assert [math.copysign(1, v) for v in logprobs.tolist()] == [math.copysign(1, v) for _, v in reference]


@pytest.mark.parametrize("number", ["-1e-320", "-4.9e-324", "-2.2250738585072014e-308", "-1.7976931348623157e308",
                                    "-0.1000000000000000055511151231257827", "-9007199254740993.0", "-123456789012345",
                                    "-1" + "0" * 40 + ".5e-40", "-0.0", "-0", "0"])
def test_edge_numbers_are_the_json_parse_s(number):
    text = f'[{{"5": {{"logprob": {number}}}}}]'.encode()
    value = logprob_positions._C.parse_logprob_positions(text, 0)[1].item()
    reference = float(orjson.loads(text)[0]["5"]["logprob"])
    assert (value, math.copysign(1, value)) == (reference, math.copysign(1, reference))


@pytest.mark.parametrize("text", [
    b"[]", b"[null]", b"[{}]", b"[[]]", b'[{"5": null}]', b'[{"5": {}}]', b'[{"5": {"rank": 1}}]',
    b'[{"05": {"logprob": -1}}]', b'[{"-5": {"logprob": -1}}]', b'[{"5a": {"logprob": -1}}]', b'[{"": {"logprob": -1}}]',
    b'[{"1234567890123456789": {"logprob": -1}}]',
    b'[{"5": {"logprob": NaN}}]', b'[{"5": {"logprob": -Infinity}}]', b'[{"5": {"logprob": "-1"}}]',
    b'[{"5": {"logprob": -1, "logprob": -2}}]', b'[{"5": {"log\\u0070rob": -1}}]', b'[{"5": {"logprob": [-1]}}]',
    b'[{"5": {"logprob": -1, "top": [1]}}]', b'[{"5": {"logprob": -1, "top": {}}}]',
    b'[{"5": {"logprob": -1, "t": "\xc3\xa9"}}]', b'[{"5": {"logprob": -1, "t": "a\x01"}}]',
    b'[{"5": {"logprob": -1, "t": "\\x"}}]', b'[{"5": {"logprob": -1, "t": "\\u12g4"}}]',
    b'[{"5": {"logprob": -1, "t": nul}}]', b'[{"5": {"logprob": -1, "t": "\\ud83d"}}]',
    b'[{"5": {"logprob": -1, "t": "\\uDE00"}}]', b'[{"5": {"logprob": -01}}]', b'[{"5": {"logprob": -1.}}]',
    b'[{"5": {"logprob": -.5}}]', b'[{"5": {"logprob": +1}}]', b'[{"5": {"logprob": -1e}}]',
    b'[{"5": {"logprob": -1234567890123456}}]', b'[{"5": {"logprob": -1e999}}]',
    b'[{"5": {"logprob": -0.' + b"1" * 70 + b'}}]',  # beyond 63 characters: left to the JSON parser
    b'[{"5": {"logprob": -1},}]', b'[{"5": {"logprob": -1}},]', b'[{"5": {"logprob": -1}}', b'[{"5": {"logprob": -1',
    b'[{"5" {"logprob": -1}}]', b'[{"5": {"logprob" -1}}]', b'[{"5": {"logprob": -1}} {"6": {"logprob": -1}}]',
])
def test_refused_arrays(text):
    with pytest.raises(RuntimeError, match="offset"):
        logprob_positions._C.parse_logprob_positions(text, 0)


def _npy_base64(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _line(rng, request_id, fault=None):
    """A vLLM 0.33 RequestOutput line (odd lengths, 1-3 entries a position), with one fault of the list below."""
    prompt = rng.integers(0, 50000, int(rng.integers(1, 6))).tolist()
    completion = rng.integers(0, 50000, int(rng.integers(1, 9))).tolist()
    routes = np.stack([np.argsort(rng.random((2, 16)), axis=1)[:, :2] for _ in prompt + completion[:-1]])
    positions = []
    for token in completion:
        position = {str(token): {"logprob": -float(rng.random()), "rank": int(rng.integers(1, 5)),
                                 "decoded_token": "t\n\u00e9"}}
        for _ in range(int(rng.integers(0, 3))):
            position[str(int(rng.integers(0, 50000)))] = {"logprob": -float(rng.random()) - 1}
        positions.append(position)
    record = {"request_id": request_id, "prompt_token_ids": prompt, "prompt_logprobs": None,
              "outputs": [{"index": 0, "token_ids": completion, "logprobs": positions,
                           "routed_experts": _npy_base64(routes.astype(np.uint8)), "finish_reason": "length"}]}
    at = int(rng.integers(0, len(completion)))
    chosen = str(completion[at])
    if fault == "missing token":
        positions[at] = {str(completion[at] + 1): {"logprob": -1.0}}
    elif fault == "null position":
        positions[at] = None
    elif fault == "no logprob":
        positions[at][chosen] = {"rank": 1}
    elif fault == "string logprob":
        positions[at][chosen]["logprob"] = "-1"
    elif fault == "positive logprob":
        positions[at][chosen]["logprob"] = 0.5
    elif fault == "NaN logprob":
        positions[at][chosen]["logprob"] = float("nan")  # json.dumps writes NaN: the standard library reads it
    elif fault == "too few positions":
        positions.pop()
    elif fault == "logprobs not a list":
        record["outputs"][0]["logprobs"] = {"token_logprobs": [-1.0] * len(completion)}
    elif fault == "key in a string":
        record["outputs"][0]["note"] = 'see "logprobs": [{"1": {"logprob": -1}}]'
    text = json.dumps(record, ensure_ascii=fault != "non-ASCII text")  # that one the scanner leaves to JSON
    if fault == "repeated key":  # the chosen token twice in one position: the last one counts, as in JSON
        old = f'"{chosen}": {{'
        head, tail = text.split('"logprobs": ', 1)
        positions_text = json.dumps(positions[at], ensure_ascii=False)
        tail = tail.replace(positions_text, positions_text[:-1] + f', "{chosen}": {{"logprob": -7.5}}}}', 1)
        assert old in tail
        text = head + '"logprobs": ' + tail
    return text


FAULTS = [None, "missing token", "null position", "no logprob", "string logprob", "positive logprob", "NaN logprob",
          "too few positions", "logprobs not a list", "key in a string", "repeated key", "non-ASCII text"]


def _convert(path, tmp_path, scanner):
    """dump_jsonl's samples or its error message, with or without the scanner."""
    saved = logprob_positions._C
    logprob_positions._C = saved if scanner else None
    try:
        out = tmp_path / f"out-{scanner}.r3dump"
        dump_jsonl(str(path), str(out), "vllm", SPEC, overwrite=True, log_interval=0)
    except ValueError as error:
        return str(error)
    finally:
        logprob_positions._C = saved
    from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader

    with open(out, "rb") as f:
        reader = RolloutDumpReader(f)
        return [(s.token_ids.tolist(), s.logprobs.tobytes(), s.routes.ids.tobytes(), s.routes.valid.tobytes(), s.meta)
                for s in (reader.read(i) for i in range(len(reader)))]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fault", FAULTS)
def test_lines_convert_as_on_the_general_path(tmp_path, seed, fault):
    rng = np.random.default_rng(seed)
    lines = [_line(rng, f"r{i}") for i in range(3)] + [_line(rng, "bad", fault)]
    assert all(logprob_positions.logprob_position_cuts(line.encode()) for line in lines[:3])  # the scanner reads them
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    general, scanned = _convert(path, tmp_path, False), _convert(path, tmp_path, True)
    assert scanned == general
    if fault in (None, "repeated key", "key in a string", "non-ASCII text"):
        assert isinstance(scanned, list) and len(scanned) == 4
    else:
        assert isinstance(scanned, str) and "line 4" in scanned, scanned
