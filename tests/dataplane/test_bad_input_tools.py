"""Bad input to the tools, the engine adapters and the rollout dump: refused where it enters, named, nothing lost.

Every refusal is checked for its exit status (the tools' ``main`` returns what the
process exits with), for a message naming the line, sample, token and field, and
for the files around it: checksums of every file in the folder before and after
(nothing created, changed or lost).
"""

import base64
import io
import json
import math
import re

import numpy as np
import pytest

from megatron_r3.dataplane.engines.engine_samples import vllm_samples
from megatron_r3.dataplane.formats.dump_checks import check_records
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
from megatron_r3.dataplane.formats.rollout_dump import RolloutDumpError
from megatron_r3.dataplane.sample_checks import SampleValueError
from megatron_r3.dataplane.samples import RolloutSample
from tests.support.planted import snapshot, unchecked_writer
from tests.dataplane.test_dump_rollouts import (
    MODEL_FLAGS,
    SPEC,
    make_truth,
    sglang_response,
    vllm_request,
    write_jsonl,
)
from tools import dump_rollouts, plot_metrics, synthetic_rollout_dump
from tools.dump_rollouts import request_output_to_json


def vllm_line(seed=0):
    """One vLLM request as a JSONL record: prompt of 4 tokens, two completions of 3 and 5."""
    rng = np.random.default_rng(seed)
    first = make_truth(rng, 4, 3)
    request = vllm_request([first, make_truth(rng, 4, 5, prompt=first.prompt)], request_id="q")
    return request_output_to_json(request, rewards=[1.0, 0.0])


def sglang_line(seed=0):
    truth = make_truth(np.random.default_rng(seed), 5, 4)
    return {"input_ids": truth.prompt, "response": sglang_response(truth, "s"), "reward": 0.5}


def convert(tmp_path, engine, records=None, raw=None, *flags):
    """Runs the tool on a JSONL file in ``tmp_path``; returns (exit status, stderr, checksums before, after)."""
    source = tmp_path / "in.jsonl"
    if raw is not None:
        source.write_bytes(raw)
    else:
        write_jsonl(source, records)
    (tmp_path / "other.txt").write_text("a file that is not the tool's")
    before = snapshot(tmp_path)
    status = dump_rollouts.main(["--engine", engine, "--input", str(source), "--out",
                                      str(tmp_path / "out.r3dump"), *MODEL_FLAGS, *flags])
    return status, before, snapshot(tmp_path)


def _vllm(mutate):
    def make():
        record = vllm_line()
        mutate(record)
        return record
    return make


def _set(path, value):
    """Sets ``record[path[0]][path[1]]...`` to ``value``."""
    def mutate(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]]) if callable(value) else value
    return mutate


def _logprob(position, value):
    """Sets the chosen token's log-prob at completion 1's ``logprobs[position]``."""
    def mutate(record):
        out = record["outputs"][1]
        token = str(out["token_ids"][position])
        out["logprobs"][position][token]["logprob"] = value
    return mutate


# (case, engine, record factory, extra flags, message). Completion 1 of the vLLM line is
# request 'q' sample 1 (prompt of 4 tokens), the SGLang line's response is request 's' sample 0.
MALFORMED_LINES = [
    ("float token id", "vllm", _vllm(_set(["outputs", 1, "token_ids", 2], lambda t: float(t))), [],
     r"line 1: request 'q' sample 1: token_ids\[2\] = \d+\.0 is not an integer token id"),
    ("token id >= 2**31", "vllm", _vllm(_set(["outputs", 0, "token_ids", 0], 2**31)), [],
     r"line 1: request 'q' sample 0: token_ids\[0\] = 2147483648 is outside \[0, 2\*\*31\)"),
    ("token id outside --vocab-size", "vllm", _vllm(_set(["prompt_token_ids", 1], 1000)), ["--vocab-size", "1000"],
     r"line 1: request 'q': prompt_token_ids\[1\] = 1000 is outside the vocabulary \[0, 1000\)"),
    ("negative token id", "vllm", _vllm(_set(["prompt_token_ids", 0], -3)), [],
     r"line 1: request 'q': prompt_token_ids\[0\] = -3 is outside"),
    ("string token id", "vllm", _vllm(_set(["outputs", 1, "token_ids", 0], "7")), [],
     r"line 1: request 'q' sample 1: token_ids\[0\] = '7' is not an integer token id"),
    ("nan log-prob", "vllm", _vllm(_logprob(1, float("nan"))), [],
     r"line 1: request 'q' sample 1: token 5: logprobs\[1\] = nan: a rollout log-prob must be finite and <= 0"),
    ("-inf log-prob", "vllm", _vllm(_logprob(0, float("-inf"))), [],
     r"line 1: request 'q' sample 1: token 4: logprobs\[0\] = -inf: a rollout log-prob must be finite and <= 0"),
    ("positive log-prob", "vllm", _vllm(_logprob(2, 5.0)), [],
     r"line 1: request 'q' sample 1: token 6: logprobs\[2\] = 5\.0: a rollout log-prob must be finite and <= 0"),
    ("string log-prob", "vllm", _vllm(_logprob(2, "-0.5")), [],
     r"line 1: request 'q' sample 1: logprobs\[2\]\[\d+\]\.logprob = '-0\.5' is not a number"),
    ("nan prompt log-prob", "vllm", _vllm(lambda r: next(iter(r["prompt_logprobs"][2].values())).update(
        logprob=float("nan"))), [], r"line 1: request 'q': token 2: prompt_logprobs\[1\] = nan"),
    ("nan reward", "vllm", _vllm(_set(["outputs", 0, "reward"], float("nan"))), [],
     r"line 1: request 'q' sample 0: reward = nan is not finite"),
    ("string reward", "vllm", _vllm(_set(["outputs", 1, "reward"], "good")), [],
     r"line 1: request 'q' sample 1: reward = 'good' is not a number"),
    ("outputs not an array", "vllm", _vllm(_set(["outputs"], 3)), [],
     r"line 1: vLLM request: 'outputs' must be an array, got a number"),
    ("completion not an object", "vllm", _vllm(_set(["outputs", 0], "done")), [],
     r"line 1: vLLM request 'q' outputs\[0\] must be a JSON object, got a string"),
    ("token_ids not an array", "vllm", _vllm(_set(["outputs", 0, "token_ids"], {"0": 1})), [],
     r"line 1: vLLM request 'q' outputs\[0\]: 'token_ids' must be an array, got an object"),
    ("no completions", "vllm", _vllm(_set(["outputs"], [])), [], r"line 1: request 'q': no completions"),
    ("empty completion", "vllm", _vllm(lambda r: r["outputs"][0].update(token_ids=[], logprobs=[])), [],
     r"line 1: request 'q' sample 0: the completion has no tokens \(token_ids is empty\)"),
    ("bad base64 routes", "vllm", _vllm(_set(["outputs", 0, "routed_experts", "base64"], "not base64!")), [],
     r"line 1: vLLM request 'q' outputs\[0\]\.routed_experts must be an integer array, nested lists.*Error"),
    ("float routes", "vllm", _vllm(_set(["outputs", 0, "routed_experts"], [[[0.5, 1.0]] * 4] * 6)), [],
     r"line 1: vLLM request 'q' outputs\[0\]\.routed_experts: expert ids must be integers, got dtype float64"),
    ("a line that is an array", "vllm", lambda: [1, 2], [], r"line 1: a JSON object is expected, got an array"),
    ("sglang routes of 3 layers", "sglang", lambda: _sglang_routes(lambda rows: rows[:, :3]), [],
     r"line 1: request 's' sample 0: SGLang meta_info\['routed_experts'\] holds 48 int32 values; this sample "
     r"needs \[tokens - 1, layers, topk\] = \[8, 4, 2\] = 64"),
    ("sglang routes of top-1", "sglang", lambda: _sglang_routes(lambda rows: rows[:, :, :1]), [],
     r"line 1: request 's' sample 0: SGLang meta_info\['routed_experts'\] holds 32 int32 values; this sample "
     r"needs \[tokens - 1, layers, topk\] = \[8, 4, 2\] = 64"),
    ("sglang bad base64", "sglang", lambda: _sglang_meta("routed_experts", "@@@@"), [],
     r"line 1: request 's' sample 0: SGLang meta_info\['routed_experts'\] is not base64 of int32 values"),
    ("sglang routes not a string", "sglang", lambda: _sglang_meta("routed_experts", {"a": 1}), [],
     r"line 1: request 's' sample 0: SGLang meta_info\['routed_experts'\] must be a base64 string, got dict"),
    ("sglang nan output log-prob", "sglang", lambda: _sglang_output_logprob(2, float("nan")), [],
     r"line 1: request 's' sample 0: token 7: output_token_logprobs\[2\] = nan"),
    ("sglang string output log-prob", "sglang", lambda: _sglang_output_logprob(1, "x"), [],
     r"line 1: request 's' sample 0: output_token_logprobs\[1\]\[0\] = 'x' is not a number"),
    ("sglang float output id", "sglang", lambda: _sglang_response(lambda r: r["output_ids"].__setitem__(0, 1.5)), [],
     r"line 1: request 's' sample 0: output_ids\[0\] = 1\.5 is not an integer token id"),
    ("sglang response a string", "sglang", lambda: {"input_ids": [1, 2], "response": "oops"}, [],
     r"line 1: SGLang line: 'response' must be an object or an array, got a string"),
    ("sglang count a string", "sglang", lambda: _sglang_meta("prompt_tokens", "5"), [],
     r"line 1: request 's' sample 0: meta_info\['prompt_tokens'\] = '5' is not an integer"),
    ("sglang log-prob entry a number", "sglang", lambda: _sglang_response(
        lambda r: r["meta_info"]["output_token_logprobs"].__setitem__(0, -0.5)), [],
     r"line 1: request 's' sample 0: output_token_logprobs\[0\] must be \[logprob, token_id, text\], got -0\.5"),
    ("sglang infinite reward", "sglang", lambda: {**sglang_line(), "reward": float("inf")}, [],
     r"line 1: request 's' sample 0: reward = inf is not finite"),
    ("sglang empty completion", "sglang", lambda: _sglang_response(
        lambda r: r.update(output_ids=[])), [], r"request 's' sample 0: the completion has no tokens"),
]


def _sglang_response(mutate):
    record = sglang_line()
    mutate(record["response"])
    return record


def _sglang_meta(key, value):
    return _sglang_response(lambda r: r["meta_info"].__setitem__(key, value))


def _sglang_routes(reshape):
    def mutate(response):
        rows = np.frombuffer(base64.b64decode(response["meta_info"]["routed_experts"]), "<i4").reshape(8, 4, 2)
        response["meta_info"]["routed_experts"] = base64.b64encode(
            np.ascontiguousarray(reshape(rows)).tobytes()).decode()
    return _sglang_response(mutate)


def _sglang_output_logprob(position, value):
    return _sglang_response(lambda r: r["meta_info"]["output_token_logprobs"][position].__setitem__(0, value))


@pytest.mark.parametrize("case, engine, record, flags, message", MALFORMED_LINES, ids=[c[0] for c in MALFORMED_LINES])
def test_malformed_engine_line_is_refused_naming_line_sample_and_field(tmp_path, capsys, case, engine, record, flags,
                                                                        message):
    status, before, after = convert(tmp_path, engine, [record()], None, *flags)
    err = capsys.readouterr().err
    assert status == 1
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    assert err.startswith(f"dump_rollouts: error: {tmp_path / 'in.jsonl'} line 1: ")
    assert re.search(message, err), err
    assert before == after  # no output, no temporary file, the input as it was


@pytest.mark.parametrize("raw, message", [
    (b"", "holds no request: a dump without samples trains nothing"),
    (b"\n  \n", "holds no request"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", r"line 1: not UTF-8 text \(byte 0x89 at column 1\)"),
    (json.dumps(vllm_line()).encode() + b"\n{\"request_id\": \"x\", \"outputs\": [\n",
     r"line 2: not JSON \(Expecting value"),
], ids=["empty", "blank lines", "binary", "cut JSON"])
def test_unreadable_engine_file_is_refused(tmp_path, capsys, raw, message):
    status, before, after = convert(tmp_path, "vllm", None, raw)
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert before == after


def test_dump_tool_never_writes_over_its_input_or_an_existing_dump(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [vllm_line()])
    old = tmp_path / "old.r3dump"
    old.write_bytes(b"someone's dump")
    before = snapshot(tmp_path)
    model = [*MODEL_FLAGS]
    for out, message in [(source, f"--out {source} is the input {source}: writing it would destroy the input"),
                         (tmp_path / "." / "in.jsonl", "is the input"),
                         (old, f"--out {old} exists: pass --overwrite to replace it"),
                         (tmp_path, f"--out {tmp_path} is a folder"),
                         (tmp_path / "missing" / "x.r3dump", "the folder")]:
        assert dump_rollouts.main(["--engine", "vllm", "--input", str(source), "--out", str(out), *model]) == 1
        assert message in capsys.readouterr().err
        assert snapshot(tmp_path) == before
    # Even --overwrite never writes over the input.
    assert dump_rollouts.main(["--engine", "vllm", "--input", str(source), "--out", str(source), "--overwrite",
                                    *model]) == 1
    assert snapshot(tmp_path) == before
    assert dump_rollouts.main(["--engine", "vllm", "--input", str(source), "--out", str(old), "--overwrite",
                                    *model]) == 0
    with RolloutDumpReader(old) as reader:
        assert len(reader) == 2 and reader.finished
    assert sorted(snapshot(tmp_path)) == sorted(before)  # replaced in place: no temporary left behind


def test_failed_conversion_keeps_the_existing_dump(tmp_path, capsys):
    """--overwrite replaces the old dump only once the new one is complete."""
    good = vllm_line()
    bad = vllm_line(1)
    bad["outputs"][0]["reward"] = float("nan")
    write_jsonl(tmp_path / "in.jsonl", [good, bad])
    (tmp_path / "out.r3dump").write_bytes(b"the previous dump")
    before = snapshot(tmp_path)
    assert dump_rollouts.main(["--engine", "vllm", "--input", str(tmp_path / "in.jsonl"), "--out",
                                    str(tmp_path / "out.r3dump"), "--overwrite", *MODEL_FLAGS]) == 1
    assert "line 2: request 'q' sample 0: reward = nan is not finite" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


SYNTHETIC = ["--num-samples", "3", "--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
             "--vocab-size", "50"]


def test_synthetic_dump_tool_refuses_an_existing_out_and_keeps_it_on_errors(tmp_path, capsys):
    out = tmp_path / "synthetic.r3dump"
    assert synthetic_rollout_dump.main(["--out", str(out), *SYNTHETIC]) == 0
    before = snapshot(tmp_path)
    assert synthetic_rollout_dump.main(["--out", str(out), *SYNTHETIC, "--seed", "1"]) == 1
    assert f"--out {out} exists: pass --overwrite to replace it" in capsys.readouterr().err
    # A bad flag fails before anything is written, even with --overwrite: the old dump stays.
    assert synthetic_rollout_dump.main(["--out", str(out), *SYNTHETIC, "--moe-router-topk", "5", "--overwrite"]) == 1
    assert "--moe-router-topk 5 must lie in [1, --num-experts 4]" in capsys.readouterr().err
    assert synthetic_rollout_dump.main(["--out", str(out), *SYNTHETIC, "--min-len", "1", "--overwrite"]) == 1
    assert "--min-len 1 and --max-len 40 must satisfy 2 <= min <= max" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    assert synthetic_rollout_dump.main(["--out", str(out), *SYNTHETIC, "--seed", "1", "--overwrite"]) == 0
    assert snapshot(tmp_path).keys() == before.keys() and snapshot(tmp_path) != before


def test_plot_tool_refuses_to_write_over_an_input_or_an_existing_png(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i, "mismatch/live/k3_kl": 0.1 / i}) + "\n" for i in (1, 2)))
    png = tmp_path / "m.png"
    png.write_bytes(b"an older plot")
    before = snapshot(tmp_path)
    assert plot_metrics.main([str(metrics), "--out", str(metrics), "--overwrite"]) == 1
    assert f"--out {metrics} is the input {metrics}" in capsys.readouterr().err
    assert plot_metrics.main([str(metrics), "--out", str(png), "--dpi", "20"]) == 1
    assert f"--out {png} exists: pass --overwrite to replace it" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    assert plot_metrics.main([str(metrics), "--out", str(png), "--dpi", "20", "--overwrite"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG") and sorted(snapshot(tmp_path)) == sorted(before)


# The dump writer and reader.

def _sample(n=6, seed=0, **changes):
    rng = np.random.default_rng(seed)
    sample = RolloutSample(token_ids=rng.integers(0, 100, n).astype(np.int32), loss_mask=np.arange(n) >= 2,
                           logprobs=-rng.random(n).astype(np.float32), meta={"reward": 0.5})
    for name, value in changes.items():
        setattr(sample, name, value)
    return sample


def _with(array, index, value):
    array = np.array(array)
    array[index] = value
    return array


BAD_SAMPLES = [
    ("nan log-prob", dict(logprobs=_with(_sample().logprobs, 3, np.nan)),
     r"token 3: logprobs\[3\] = nan: a rollout log-prob must be finite and <= 0 \(1 of 6 entries are not\)"),
    ("-inf log-prob", dict(logprobs=_with(_sample().logprobs, 0, -np.inf)), r"token 0: logprobs\[0\] = -inf"),
    ("positive log-prob", dict(logprobs=_with(_sample().logprobs, 5, 5.0)), r"token 5: logprobs\[5\] = 5\.0"),
    ("nan reward", dict(meta={"reward": math.nan}), r"meta\['reward'\] = nan is not finite"),
    ("null reward", dict(meta={"reward": None}), r"meta\['reward'\] = None is not a number"),
    ("inf advantage", dict(meta={"advantage": -math.inf}), r"meta\['advantage'\] = -inf is not finite"),
    ("string advantage", dict(meta={"advantage": "1.0"}), r"meta\['advantage'\] = '1\.0' is not a number"),
    ("bool reward", dict(meta={"reward": True}), r"meta\['reward'\] = True is not a number"),
    ("token id >= 2**31", dict(token_ids=_with(np.zeros(6, np.int64), 4, 2**31)),
     r"token_ids\[4\] = 2147483648 is outside \[0, 2\*\*31\)"),
    ("float token ids", dict(token_ids=np.arange(6) + 0.5), r"token_ids has dtype float64: token ids must be integers"),
]


@pytest.mark.parametrize("case, changes, message", BAD_SAMPLES, ids=[c[0] for c in BAD_SAMPLES])
def test_dump_writer_and_reader_refuse_numbers_the_loss_cannot_take(tmp_path, case, changes, message):
    path = tmp_path / "x.r3dump"
    with RolloutDumpWriter(path, num_experts=16, topk=2, layer_numbers=(2, 4)) as writer:
        writer.write(_sample(seed=1))
        with pytest.raises(SampleValueError, match=f"sample 1: {message}"):
            writer.write(_sample(**changes))
        writer.write(_sample(seed=2))
    with RolloutDumpReader(path) as reader:
        assert len(reader) == 2  # the refused sample was not written
    if "token_ids" in changes:
        return
    planted = tmp_path / "planted.r3dump"  # the same sample in a dump from elsewhere
    with unchecked_writer(), RolloutDumpWriter(planted, num_experts=16, topk=2, layer_numbers=(2, 4)) as writer:
        writer.write(_sample(seed=1))
        writer.write(_sample(**changes))
    with RolloutDumpReader(planted) as reader:
        reader.read(0)
        with pytest.raises(SampleValueError, match=f"record 1: {message}"):
            reader.read(1)
        with pytest.raises(SampleValueError, match=f"record 1: {message}"):
            list(reader)
        with pytest.raises(SampleValueError, match=f"record 1: {message}"):
            check_records(reader)


def test_dump_writer_refuses_an_existing_file(tmp_path):
    path = tmp_path / "x.r3dump"
    path.write_bytes(b"precious")
    with pytest.raises(RolloutDumpError, match=f"rollout dump {path} exists: pass overwrite=True"):
        RolloutDumpWriter(path, num_experts=16, topk=2, layer_numbers=(2,))
    assert path.read_bytes() == b"precious"
    with RolloutDumpWriter(path, num_experts=16, topk=2, layer_numbers=(2,), overwrite=True) as writer:
        writer.write(_sample())
    assert RolloutDumpReader(path).finished


def _dump_bytes(samples, finish=True):
    buffer = io.BytesIO()
    writer = RolloutDumpWriter(buffer, num_experts=16, topk=2, layer_numbers=(2, 4))
    for sample in samples:
        writer.write(sample)
    if finish:
        writer.close()
    return buffer.getvalue()


def test_a_dump_knows_its_length_and_refuses_bytes_after_its_footer():
    samples = [_sample(seed=i) for i in range(4)]
    data = _dump_bytes(samples)
    reader = RolloutDumpReader(io.BytesIO(data))
    assert reader.finished and len(reader) == 4
    records_end = reader.index.end
    # Cut exactly at a record boundary: readable, but not finished (samples may be lost).
    cut = data[:int(reader.index.offsets[3])]
    short = RolloutDumpReader(io.BytesIO(cut))
    assert not short.finished and len(short) == 3
    # Cut inside the footer: no footer, every record whole.
    assert not RolloutDumpReader(io.BytesIO(data[:records_end + 5])).finished
    # Anything after a whole footer is an error, streamed or indexed.
    for garbage in (b"x", b"\0" * 16, data[-40:]):
        with pytest.raises(RolloutDumpError, match=rf"{len(garbage)} bytes follow its footer, which ends at byte "
                                                   rf"{len(data)} \(data appended to a finished dump\?\)"):
            RolloutDumpReader(io.BytesIO(data + garbage)).index
        with pytest.raises(RolloutDumpError, match="bytes follow its footer"):
            list(RolloutDumpReader(io.BytesIO(data + garbage)))
    assert len(list(RolloutDumpReader(io.BytesIO(data)))) == 4


def test_check_records_reads_every_record_and_reports_missing_loss_fields():
    samples = [_sample(seed=0), _sample(seed=1, meta={"advantage": 1.0}), _sample(seed=2, meta={}),
               _sample(seed=3, meta={"reward": 0.0, "advantage": -1.0})]
    data = bytearray(_dump_bytes(samples))
    reader = RolloutDumpReader(io.BytesIO(bytes(data)))
    assert check_records(reader) == {"reward": 1, "advantage": 0}
    assert check_records(reader, 3) == {"reward": None, "advantage": None}
    data[int(reader.index.offsets[2]) + 16 + 20] ^= 0xFF  # a byte of record 2's body
    with pytest.raises(RolloutDumpError, match="record 2: CRC mismatch"):
        check_records(RolloutDumpReader(io.BytesIO(bytes(data))))
    assert check_records(RolloutDumpReader(io.BytesIO(bytes(data))), 3) == {"reward": None, "advantage": None}


def test_engine_api_refuses_what_the_tool_refuses():
    """The in-process path (vLLM's own objects) runs the same checks as the JSONL tool."""
    rng = np.random.default_rng(3)
    first = make_truth(rng, 4, 3)
    request = vllm_request([first, make_truth(rng, 4, 5, prompt=first.prompt)])
    request.outputs[0].token_ids = [float(t) for t in request.outputs[0].token_ids]
    with pytest.raises(SampleValueError, match=r"request 'r7' sample 0: token_ids\[0\] = \d+\.0 is not an integer"):
        vllm_samples(request, SPEC)
    request = vllm_request([first])
    request.outputs[0].logprobs[1][request.outputs[0].token_ids[1]].logprob = float("nan")
    with pytest.raises(SampleValueError, match=r"request 'r7' sample 0: token 5: logprobs\[1\] = nan"):
        vllm_samples(request, SPEC)
    with pytest.raises(SampleValueError, match=r"request 'r7' sample 0: reward = inf is not finite"):
        vllm_samples(vllm_request([first]), SPEC, rewards=[math.inf])
    with pytest.raises(SampleValueError, match=r"prompt_token_ids\[\d\] = \d+ is outside the vocabulary \[0, 10\)"):
        vllm_samples(vllm_request([first]), SPEC, vocab_size=10)


# A damaged dump: its header, a record's body, named part by part.

def _with_header(header):
    """The bytes of a one-sample dump whose header JSON is ``header`` (bytes), records as written."""
    data = _dump_bytes([_sample()], finish=False)
    json_len = int.from_bytes(data[8:12], "little")
    return data[:8] + len(header).to_bytes(4, "little") + header + data[12 + json_len:]


def _good_header(**changes):
    header = {"num_experts": 16, "topk": 2, "layer_numbers": [2, 4], "id_dtype": "uint8", **changes}
    return json.dumps({k: v for k, v in header.items() if v is not None}).encode()


DAMAGED_HEADERS = [
    ("not JSON", b'{"num_experts": 16, ', r"header: not a JSON object \(Expecting"),
    ("not UTF-8", b"\xff\xfe", r"header: not a JSON object \(Expecting value"),
    ("an array", b"[16, 2]", r"header: a JSON object is expected, got list"),
    ("no topk", _good_header(topk=None), r"header: no 'topk'"),
    ("topk a string", _good_header(topk="2"), r"header: topk = '2' is not an integer >= 1"),
    ("experts 0", _good_header(num_experts=0), r"header: num_experts = 0 is not an integer >= 1"),
    ("layers not a list", _good_header(layer_numbers=4), r"header: layer_numbers = 4 is not a list of increasing"),
    ("layers repeated", _good_header(layer_numbers=[2, 2]), r"header: layer_numbers = \[2, 2\] is not a list"),
    ("wrong id dtype", _good_header(id_dtype="int64"), r"header: id_dtype = 'int64' does not fit 16 experts \(it "
                                                       r"is 'uint8'\)"),
    ("too many experts", _good_header(num_experts=40000), r"header: num_experts = 40000 do not fit int16"),
    ("cut", None, r"header: truncated \(5 of \d+ bytes\)"),
]


@pytest.mark.parametrize("case, header, message", DAMAGED_HEADERS, ids=[c[0] for c in DAMAGED_HEADERS])
def test_a_damaged_dump_header_is_named_with_the_file_and_the_field(tmp_path, case, header, message):
    path = tmp_path / "damaged.r3dump"
    path.write_bytes(_dump_bytes([_sample()])[:17] if header is None else _with_header(header))
    before = snapshot(tmp_path)
    with pytest.raises(RolloutDumpError, match=f"^rollout dump {path}: {message}"):
        RolloutDumpReader(path)
    assert snapshot(tmp_path) == before


def _with_body(body):
    """A dump of one record holding ``body`` (a valid CRC), no footer."""
    import struct
    import zlib

    data = _dump_bytes([], finish=False)
    return data + struct.pack("<4sQI", b"R3RC", len(body), zlib.crc32(body)) + body


def _body(t=3, flags=0, meta=b"{}", extra=b""):
    import struct

    return struct.pack("<III", t, flags, len(meta)) + meta + b"\0" * (5 * t) + extra


DAMAGED_RECORDS = [
    ("no head", b"\0" * 5, r"record 0: (a body of 5 bytes has no room for its 12-byte head|truncated \(5 of 12 "
                            r"bytes\))"),
    ("short body", _body()[:-2], r"record 0: its body of 27 bytes does not hold what its head says \(num_tokens 3, "
                                 r"flags 0x0, meta_len 2: 29 bytes\)"),
    ("trailing bytes", _body(extra=b"xx"), r"record 0: its body of 31 bytes does not hold what its head says"),
    ("log-probs missing", _body(flags=1), r"flags 0x1, meta_len 2: 41 bytes"),
    ("unknown flag", _body(flags=4), r"flags 0x4"),
    ("meta not JSON", _body(meta=b"{oops"), r"record 0: meta is not JSON \(Expecting"),
    ("meta a list", _body(meta=b"[1]"), r"record 0: meta must be a JSON object, got list"),
]


@pytest.mark.parametrize("case, body, message", DAMAGED_RECORDS, ids=[c[0] for c in DAMAGED_RECORDS])
def test_a_damaged_record_is_named_with_what_its_head_promised(case, body, message):
    reader = RolloutDumpReader(io.BytesIO(_with_body(body)))
    with pytest.raises(RolloutDumpError, match=message):
        list(reader)
    with pytest.raises(RolloutDumpError, match=message):
        reader.read(0)


def test_a_damaged_footer_is_named():
    data = bytearray(_dump_bytes([_sample()]))
    reader = RolloutDumpReader(io.BytesIO(bytes(data)))
    at = reader.index.end  # the index record's head
    body_at = at + 16
    json_len = int.from_bytes(data[body_at:body_at + 4], "little")
    stats = json.loads(data[body_at + 4:body_at + 4 + json_len])
    del stats["max_num_tokens"]
    text = json.dumps(stats).encode().ljust(json_len)
    import zlib

    data[body_at + 4:body_at + 4 + json_len] = text
    body = bytes(data[body_at:len(data) - 16])
    data[at + 12:at + 16] = zlib.crc32(body).to_bytes(4, "little")
    with pytest.raises(RolloutDumpError, match=r"corrupt footer: its stats are not the JSON object expected "
                                               r"\(KeyError: 'max_num_tokens'\)"):
        RolloutDumpReader(io.BytesIO(bytes(data))).index


# The same sample twice: warned of, with the count and the first ids.

def test_repeated_requests_in_jsonl_are_warned_of_with_their_lines(tmp_path, capsys):
    first, other = vllm_line(), vllm_line(1)
    other["request_id"] = "other"
    status, _, _ = convert(tmp_path, "vllm", [first, other, first, first])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert ("dump_rollouts: warning: " + str(tmp_path / "in.jsonl") + ": 4 samples repeat the request id and "
            "completion index of an earlier one: request \"q\" completion 0 (lines 1 and 3), request \"q\" completion "
            "1 (lines 1 and 3), request \"q\" completion 0 (lines 1 and 4), ...; each is in the dump as often as it "
            "appears") in captured.err
    status, _, _ = convert(tmp_path, "vllm", [first, other], None, "--overwrite")
    assert status == 0 and "warning" not in capsys.readouterr().err


def test_repeated_records_of_a_dump_are_found_by_their_content():
    from megatron_r3.dataplane.formats.dump_checks import repeated_records

    samples = [_sample(seed=0), _sample(seed=1), _sample(seed=0), _sample(seed=1, meta={"reward": 0.25}),
               _sample(seed=1)]
    reader = RolloutDumpReader(io.BytesIO(_dump_bytes(samples)))
    digests = []
    check_records(reader, 0, 3, digests=digests)
    check_records(reader, 3, 5, digests=digests)  # another rank's share
    assert repeated_records(digests[::-1]) == [(2, 0), (4, 1)]  # a different reward is another sample
