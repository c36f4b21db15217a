"""Megatron's nested route lists: the C++ parser against the JSON reference, and the tool with and without it."""

import json
import subprocess
import sys

import numpy as np
import orjson
import pytest

import megatron_r3
from megatron_r3.dataplane.formats import route_lists
from megatron_r3.dataplane.formats.route_lists import parse_int_lists, parse_route_lists

pytestmark = pytest.mark.skipif(not megatron_r3.kernel_info()["cpu"], reason="megatron_r3._C not built")


def _reference(text: bytes) -> np.ndarray:
    return np.asarray(orjson.loads(text), dtype=np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_random_lists_match_the_json_reference(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 6, rng.integers(1, 5)))
    values = rng.integers(-2**31, 2**31, shape) if seed % 2 else rng.integers(0, 300, shape)
    separators = [",", ", ", " ,\n", "\t,\r\n "]
    text = json.dumps(values.tolist(), separators=(separators[seed % 4], ":")).encode()
    prefix = b'{"x": 1, "moe_topk_indices": '
    array, end = parse_int_lists(prefix + text + b" }", len(prefix))
    assert array.dtype == np.int32 and array.shape == values.shape
    np.testing.assert_array_equal(array, _reference(text))
    assert end == len(prefix) + len(text) + 1  # after the list and its trailing whitespace


@pytest.mark.parametrize("text", [
    b"[[1, 2], [3]]",          # ragged
    b"[[1, 2], 3]",            # a number where a list was
    b"[[1, 2], [[3, 4]]]",     # deeper than the first
    b"[[]]", b"[]",            # empty
    b"[[1.0, 2]]", b"[[1e3]]", b"[[1, -]]", b"[[+1]]", b"[[01]]",
    b"[[2147483648]]", b"[[-2147483649]]", b"[[123456789012345]]",
    b'[["1"]]', b"[[1, 2,]]", b"[[1 2]]", b"[[1, null]]", b"[[true]]",
    b"[[1, 2]", b"[[1, 2], [3, 4]", b"[[1,", b"[", b"", b"{}", b"[[1]]]"[:3],
])
def test_refuses_what_is_not_strict_rectangular_int32_lists(text):
    with pytest.raises(RuntimeError, match="offset"):
        parse_int_lists(text)


def test_int32_bounds_and_negative_zero_are_read():
    array, _ = parse_int_lists(b"[[2147483647, -2147483648, -0, 0]]")
    assert array.tolist() == [[2**31 - 1, -2**31, 0, 0]]


def _line(routes, **extra):
    choice = {"index": 0, "prompt_token_ids": [1, 2], "generation_token_ids": [3],
              "generation_log_probs": [-0.5], "moe_topk_indices": routes, "finish_reason": "length", **extra}
    return json.dumps({"response": {"id": "m0", "choices": [choice]}, "reward": [1.0]}).encode()


def test_route_lists_come_back_as_arrays_and_the_rest_as_json():
    routes = [[[3, 17], [5, 2]], [[1, 0], [7, 6]]]
    value = parse_route_lists(_line(routes, prompt_moe_topk_indices=routes[:1]), orjson.loads)
    choice = value["response"]["choices"][0]
    assert isinstance(choice["moe_topk_indices"], np.ndarray)
    assert choice["moe_topk_indices"].tolist() == routes
    assert choice["prompt_moe_topk_indices"].tolist() == routes[:1]
    expected = orjson.loads(_line(routes, prompt_moe_topk_indices=routes[:1]))
    del choice["moe_topk_indices"], choice["prompt_moe_topk_indices"]
    del expected["response"]["choices"][0]["moe_topk_indices"], expected["response"]["choices"][0]["prompt_moe_topk_indices"]
    assert value == expected


@pytest.mark.parametrize("line", [
    _line([[[3, 1.5]]]),                                          # refused by the parser: left as JSON
    _line({"data": [[[3, 1]]], "dtype": "int32"}),                # not a list
    json.dumps({"text": 'a "moe_topk_indices": [[1]]', "k": 1}).encode(),   # the key inside a string
    json.dumps({'x"moe_topk_indices': [[1, 2]]}).encode(),         # a key that ends like one
    json.dumps({"other": {"moe_topk_indices": [[1]]}, "l": [0, {"moe_topk_indices": [[2]]}]}).encode(),
    _line([[[3, 1.5]]], prompt_moe_topk_indices=[[[1, 2]]]),      # a refused list, then one the parser reads
    json.dumps({"moe_topk_indices": [[1, 2]], 'y"moe_topk_indices': [[5]]}).encode(),  # a look-alike after a list
    json.dumps({"moe_topk_indices": [[1, 2]], "prompt_moe_topk_indices": [[3]], "t": "]]"}).encode(),
])
def test_anything_else_reads_as_the_json_reference(line):
    def plain(value):
        return json.loads(json.dumps(value, default=lambda a: a.tolist()))

    assert plain(parse_route_lists(line, orjson.loads)) == orjson.loads(line)


def test_a_bad_line_is_named_as_the_general_path_names_it():
    line = _line([[[3, 1]]])[:-1] + b"x"

    def parse_json(text):
        return json.loads(text)

    with pytest.raises(json.JSONDecodeError) as fast:
        parse_route_lists(line, parse_json)
    with pytest.raises(json.JSONDecodeError) as reference:
        parse_json(line)
    assert str(fast.value) == str(reference.value)


def test_dump_is_the_same_with_and_without_the_parser(tmp_path, monkeypatch):
    from megatron_r3.dataplane.samples import RoutingSpec
    from megatron_r3.layers.moe_layers import model_moe_layers
    from tools.dump_rollouts import dump_jsonl

    rng = np.random.default_rng(1)
    spec = RoutingSpec(num_layers=4, model_moe_layers=model_moe_layers(4, 1), num_experts=16, topk=2)
    source = tmp_path / "in.jsonl"
    with open(source, "w") as f:
        for i in range(3):
            tokens = rng.integers(0, 1000, 9).tolist()
            routes = np.argsort(rng.random((8, 4, 16)), axis=2)[:, :, :2].tolist()
            f.write(json.dumps({"response": {"id": f"m{i}", "choices": [{
                "index": 0, "prompt_token_ids": tokens[:4], "generation_token_ids": tokens[4:],
                "generation_log_probs": (-rng.random(5)).tolist(), "moe_topk_indices": routes,
                "finish_reason": "length"}]}, "reward": [1.0]}) + "\n")
    fast = dump_jsonl(str(source), str(tmp_path / "fast.r3dump"), "megatron", spec, log_interval=0)
    monkeypatch.setattr(route_lists, "_C", None)
    slow = dump_jsonl(str(source), str(tmp_path / "slow.r3dump"), "megatron", spec, log_interval=0)
    assert fast == slow
    assert (tmp_path / "fast.r3dump").read_bytes() == (tmp_path / "slow.r3dump").read_bytes()


def test_an_extension_built_before_the_parser_leaves_lines_to_json():
    import importlib

    from megatron_r3 import _C

    try:
        parser = _C.parse_int_lists
        del _C.parse_int_lists
        module = importlib.reload(route_lists)
        assert module._C is None
        line = _line([[[3, 1]]])
        assert module.parse_route_lists(line, orjson.loads) == orjson.loads(line)
    finally:
        _C.parse_int_lists = parser
        importlib.reload(route_lists)


@pytest.mark.parametrize("module", ["route_lists", "logprob_positions"])
def test_the_parser_is_found_when_its_module_is_imported_first(module):
    # _C links against libc10, which only `import torch` loads: a module that imported _C before torch
    # found no extension and left every line to the general path.
    code = (f"import megatron_r3.dataplane.formats.{module} as m, megatron_r3; "
            "print(m._C is not None, megatron_r3.kernel_info()['cpu'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1], out
