"""Rollout dump: round trip, streaming, and loud failures on bad files."""

import dataclasses
import io

import numpy as np
import pytest

from megatron_r3.dataplane.engines.adapters import from_array
from megatron_r3.dataplane.formats.dump_checks import check_dump_fits
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
from megatron_r3.dataplane.formats.rollout_dump import RolloutDumpError, RolloutDumpStats
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.sample_checks import SampleValueError
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample
from tests.support.counting_file import CountingFile
from tests.support.planted import unchecked_writer


def make_sample(rng, n, spec, with_routes=True, with_logprobs=True, index=0):
    routes = None
    if with_routes:
        ids = np.argsort(rng.random((n, len(spec.model_moe_layers), spec.num_experts)), axis=2)[:, :, : spec.topk]
        ids[rng.random(n) < 0.2] = -1  # tokens without a route
        routes = from_array(ids, spec)
    return RolloutSample(
        token_ids=rng.integers(0, 150000, n).astype(np.int32),
        loss_mask=rng.random(n) < 0.5,
        logprobs=-rng.random(n).astype(np.float32) if with_logprobs else None,
        routes=routes,
        meta={"index": index, "reward": float(rng.random())},
    )


def assert_same(a, b):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.routes is None) == (b.routes is None)
    if a.routes is not None:
        assert b.routes.ids.dtype == a.routes.ids.dtype and b.routes.layer_numbers == a.routes.layer_numbers
        np.testing.assert_array_equal(a.routes.to_int64(), b.routes.to_int64())
    assert a.meta == b.meta


@pytest.mark.parametrize("num_experts", [8, 256, 300])
def test_round_trip(tmp_path, num_experts):
    spec = RoutingSpec(num_layers=4, model_moe_layers=(2, 3, 4), num_experts=num_experts, topk=4)
    rng = np.random.default_rng(num_experts)
    samples = [make_sample(rng, int(n), spec, with_routes=i % 3 != 1, with_logprobs=i % 2 == 0, index=i)
               for i, n in enumerate(rng.integers(0, 50, 12))]
    path = tmp_path / "rollouts.r3d"
    with RolloutDumpWriter(path, num_experts=num_experts, topk=4, layer_numbers=spec.model_moe_layers) as w:
        for s in samples:
            w.write(s)
    with RolloutDumpReader(path) as r:
        assert (r.num_experts, r.topk, r.layer_numbers) == (num_experts, 4, (2, 3, 4))
        back = list(r)
    assert len(back) == len(samples)
    for a, b in zip(samples, back):
        assert_same(a, b)


def test_streaming_reads_one_record_at_a_time():
    spec = RoutingSpec(num_layers=2, model_moe_layers=(1, 2), num_experts=64, topk=8)
    rng = np.random.default_rng(1)
    buffer = io.BytesIO()
    w = RolloutDumpWriter(buffer, num_experts=64, topk=8, layer_numbers=(1, 2))
    for i in range(200):
        w.write(make_sample(rng, 500, spec, index=i))
    w.close()
    f = CountingFile(buffer.getvalue())
    it = iter(RolloutDumpReader(f))
    first = next(it)
    assert first.meta["index"] == 0
    assert f.bytes_read < 2 * len(buffer.getvalue()) / 200  # about one record, not the file
    assert sum(1 for _ in it) == 199


def test_bad_files_fail_loudly(tmp_path):
    spec = RoutingSpec(num_layers=2, model_moe_layers=(1, 2), num_experts=16, topk=2)
    rng = np.random.default_rng(2)
    buffer = io.BytesIO()
    w = RolloutDumpWriter(buffer, num_experts=16, topk=2, layer_numbers=(1, 2))
    for i in range(3):
        w.write(make_sample(rng, 20, spec, index=i))
    data = buffer.getvalue()
    with pytest.raises(RolloutDumpError, match="record 2: truncated"):
        list(RolloutDumpReader(io.BytesIO(data[:-5])))
    assert len(list(RolloutDumpReader(io.BytesIO(data[:-5]), allow_truncated_tail=True))) == 2
    corrupt = bytearray(data)
    corrupt[-3] ^= 0xFF
    with pytest.raises(RolloutDumpError, match="record 2: CRC mismatch"):
        list(RolloutDumpReader(io.BytesIO(bytes(corrupt))))
    with pytest.raises(RolloutDumpError, match="not a megatron-r3 rollout dump"):
        RolloutDumpReader(io.BytesIO(b"PK\x03\x04" + data[4:]))
    other = RoutingSpec(num_layers=3, model_moe_layers=(1, 2, 3), num_experts=16, topk=2)
    with pytest.raises(RolloutDumpError, match="do not fit the dump"):
        w.write(make_sample(rng, 5, other))
    with pytest.raises(RolloutDumpError, match="loss_mask"):
        w.write(RolloutSample(np.zeros(3, np.int32), np.zeros(2, bool)))


def test_reader_validates_routes():
    buffer = io.BytesIO()
    w = RolloutDumpWriter(buffer, num_experts=16, topk=2, layer_numbers=(1,))
    sample = make_sample(np.random.default_rng(3), 4, RoutingSpec(1, (1,), 16, 2))
    sample.routes.ids[2, 0] = [3, 3]  # corrupt after validation: a repeated id
    sample.routes.valid[2] = True
    w.write(sample)
    with pytest.raises(RoutingValidationError, match="sample 0: token 2, layer 1: repeated expert id"):
        list(RolloutDumpReader(io.BytesIO(buffer.getvalue())))


def test_routes_take_the_ids_and_one_valid_byte_per_token():
    spec = RoutingSpec(num_layers=3, model_moe_layers=(1, 3), num_experts=300, topk=3)
    sample = make_sample(np.random.default_rng(4), 10, spec)
    assert not sample.routes.valid.all()
    with_routes, without = _dump(sample, spec), _dump(dataclasses.replace(sample, routes=None), spec)
    assert len(with_routes) - len(without) == sample.routes.ids.nbytes + 10
    (back,) = RolloutDumpReader(io.BytesIO(with_routes))
    np.testing.assert_array_equal(back.routes.valid, sample.routes.valid)


def test_reader_rejects_other_format_versions():
    spec = RoutingSpec(1, (1,), 16, 2)
    data = _dump(make_sample(np.random.default_rng(5), 4, spec), spec)
    assert data.startswith(b"R3DUMP\x00\x03")
    with pytest.raises(RolloutDumpError, match="format version 1 is not supported: this reader reads versions 2, 3"):
        RolloutDumpReader(io.BytesIO(b"R3DUMP\x00\x01" + data[8:]))


def _dump(sample, spec):
    buffer = io.BytesIO()
    with RolloutDumpWriter(buffer, num_experts=spec.num_experts, topk=spec.topk,
                           layer_numbers=spec.model_moe_layers) as w:
        w.write(sample)
    return buffer.getvalue()


def test_synthetic_dump_tool_writes_valid_routed_samples(tmp_path):
    from tools.synthetic_rollout_dump import main

    path = str(tmp_path / "synthetic.r3dump")
    main(["--out", path, "--num-samples", "5", "--num-layers", "4", "--moe-layer-freq", "0,1,1,1",
          "--num-experts", "16", "--moe-router-topk", "4", "--vocab-size", "100", "--routed-fraction", "0.5"])
    with RolloutDumpReader(path) as reader:
        assert reader.layer_numbers == (2, 3, 4)
        samples = list(reader)
    assert len(samples) == 5
    for sample in samples:
        assert 9 <= len(sample.token_ids) <= 40 and sample.token_ids.max() < 100
        assert not sample.routes.valid[-1] and not sample.loss_mask[0]
        ids = sample.routes.ids[sample.routes.valid]
        assert (np.sort(ids, axis=2)[..., 1:] != np.sort(ids, axis=2)[..., :-1]).all()


# Index, footer and random access.

SPEC = RoutingSpec(num_layers=4, model_moe_layers=(2, 4), num_experts=16, topk=2)


def _samples(n, seed=6):
    rng = np.random.default_rng(seed)
    return [make_sample(rng, int(t), SPEC, with_routes=i % 4 != 3, index=i)
            for i, t in enumerate(rng.integers(0, 30, n))]


def _dump_of(samples, finish=True):
    """The bytes of a dump of ``samples``; without ``finish`` the writer dies before its footer."""
    buffer = io.BytesIO()
    w = RolloutDumpWriter(buffer, num_experts=SPEC.num_experts, topk=SPEC.topk, layer_numbers=SPEC.model_moe_layers)
    for s in samples:
        w.write(s)
    if finish:
        w.close()
    return buffer.getvalue()


def _record_sizes(data, index):
    return [16 + index.body_length(i) for i in range(len(index))]


def test_footer_gives_index_and_stats_from_the_end_of_the_file():
    samples = _samples(9)
    data = _dump_of(samples)
    f = CountingFile(data)
    reader = RolloutDumpReader(f)
    index, stats = reader.index, reader.stats
    assert index.from_footer and len(reader) == 9
    np.testing.assert_array_equal(index.num_tokens, [len(s.token_ids) for s in samples])
    assert sum(_record_sizes(data, index)) == index.end - index.offsets[0]
    ids = np.concatenate([s.token_ids for s in samples])
    assert stats == RolloutDumpStats(9, max(len(s.token_ids) for s in samples), int(ids.min()), int(ids.max()))
    # The header, then the index record and trailer: no record was read.
    assert f.bytes_read == index.offsets[0] + len(data) - index.end


def test_a_dump_whose_writer_died_is_indexed_by_scanning_record_heads():
    samples = _samples(9)
    finished = RolloutDumpReader(io.BytesIO(_dump_of(samples)))
    data = _dump_of(samples, finish=False)
    f = CountingFile(data)
    reader = RolloutDumpReader(f)
    index = reader.index
    assert not index.from_footer
    np.testing.assert_array_equal(index.offsets, finished.index.offsets)
    np.testing.assert_array_equal(index.num_tokens, finished.index.num_tokens)
    assert index.end == len(data)
    # The header, the last 16 bytes (no footer there), then record heads only: bodies are sought over.
    assert f.bytes_read == index.offsets[0] + 16 + 9 * (16 + 12)
    before = f.bytes_read
    assert reader.stats == finished.stats
    # Stats: a second scan that also reads the token ids (metadata is sought over).
    assert f.bytes_read - before == 9 * (16 + 12) + 4 * sum(len(s.token_ids) for s in samples)
    # Random access and streaming agree with the finished dump.
    assert_same(reader.read(4), samples[4])
    assert len(list(reader)) == 9


def test_writer_leaving_by_an_exception_writes_no_footer(tmp_path):
    path = tmp_path / "died.r3dump"
    with pytest.raises(KeyboardInterrupt):
        with RolloutDumpWriter(path, num_experts=16, topk=2, layer_numbers=(2, 4)) as w:
            for s in _samples(3):
                w.write(s)
            raise KeyboardInterrupt
    with RolloutDumpReader(path) as reader:
        assert not reader.index.from_footer and len(reader) == 3


@pytest.mark.parametrize("cut", ["record", "index", "trailer"])
def test_truncated_dumps(cut):
    samples = _samples(5)
    data = _dump_of(samples)
    finished = RolloutDumpReader(io.BytesIO(data)).index
    end = {"record": int(finished.offsets[4]) + 20, "index": finished.end + 10, "trailer": len(data) - 3}[cut]
    truncated = data[:end]
    if cut == "record":
        with pytest.raises(RolloutDumpError, match="record 4: truncated"):
            RolloutDumpReader(io.BytesIO(truncated)).index
        reader = RolloutDumpReader(io.BytesIO(truncated), allow_truncated_tail=True)
        assert len(reader) == 4 and reader.index.end == finished.offsets[4]
    else:  # a footer cut short is no footer: every record is whole
        reader = RolloutDumpReader(io.BytesIO(truncated))
        assert not reader.index.from_footer and len(reader) == 5
    assert_same(reader.read(3), samples[3])
    assert reader.stats.num_samples == len(reader)


def test_random_access_equals_sequential_read_and_reads_one_record():
    samples = _samples(12)
    data = _dump_of(samples)
    f = CountingFile(data)
    reader = RolloutDumpReader(f)
    sequential = list(reader)
    sizes = _record_sizes(data, reader.index)
    for i in np.random.default_rng(7).permutation(12):
        before = f.bytes_read
        sample = reader.read(int(i))
        assert f.bytes_read - before == sizes[i]
        assert_same(sample, sequential[i])
        assert_same(sample, samples[i])
    with pytest.raises(IndexError, match="record 12 is outside"):
        reader.read(12)


def test_random_access_checks_the_crc_of_the_record_read():
    data = bytearray(_dump_of(_samples(3)))
    index = RolloutDumpReader(io.BytesIO(bytes(data))).index
    data[int(index.offsets[1]) + 16 + 13] ^= 0xFF
    reader = RolloutDumpReader(io.BytesIO(bytes(data)))
    reader.read(0), reader.read(2)
    with pytest.raises(RolloutDumpError, match="record 1: CRC mismatch"):
        reader.read(1)


def test_version_2_dumps_read_by_scanning():
    samples = _samples(4)
    data = _dump_of(samples, finish=False)
    reader = RolloutDumpReader(io.BytesIO(b"R3DUMP\x00\x02" + data[8:]))
    assert reader.version == 2 and not reader.index.from_footer and len(reader) == 4
    for a, b in zip(samples, reader):
        assert_same(a, b)


def test_corrupt_footer_is_an_error():
    data = bytearray(_dump_of(_samples(3)))
    index_at = RolloutDumpReader(io.BytesIO(bytes(data))).index.end
    data[index_at + 20] ^= 0xFF
    with pytest.raises(RolloutDumpError, match="corrupt footer: CRC mismatch"):
        RolloutDumpReader(io.BytesIO(bytes(data))).index


# Refusing a dump that does not fit the model.

FITS = dict(num_experts=16, topk=2, model_moe_layers=(2, 4), vocab_size=150000, seq_length=30)


def test_a_dump_that_fits_passes_and_its_stats_come_from_the_footer():
    data = _dump_of(_samples(6))
    f = CountingFile(data)
    reader = RolloutDumpReader(f)
    stats = check_dump_fits(reader, **FITS)
    assert stats.num_samples == 6
    assert f.bytes_read == reader.index.offsets[0] + len(data) - reader.index.end  # no record read


@pytest.mark.parametrize("finish", [True, False], ids=["footer", "scan"])
@pytest.mark.parametrize("field, change, message", [
    ("model_moe_layers", (1, 2, 3, 4),
     r"MoE layers: the dump holds routes for MoE layers \(2, 4\), the model's MoE layers are \(1, 2, 3, 4\)"),
    ("num_experts", 32, "experts: the dump holds routes over 16 experts, the model's --num-experts is 32"),
    ("topk", 4, "top-k: the dump holds 2 experts per token, the model's --moe-router-topk is 4"),
    ("vocab_size", 1000, "vocab: the dump holds token id 2400, the model's --vocab-size is 1000"),
    ("seq_length", 20, "seq-length: sample 2 has 25 tokens, the model's --seq-length is 20"),
])
def test_a_dump_that_does_not_fit_is_refused_naming_the_field(tmp_path, finish, field, change, message):
    samples = [RolloutSample(np.arange(n, dtype=np.int32) * 100, np.ones(n, bool))
               for n in (3, 15, 25, 16)]
    path = tmp_path / "x.r3dump"
    path.write_bytes(_dump_of(samples, finish=finish))
    with pytest.raises(RolloutDumpError, match=f"rollout dump {path} does not fit the model: {message}"):
        check_dump_fits(str(path), **{**FITS, "vocab_size": 2500, field: change})


def test_empty_and_negative_token_dumps_are_refused():
    with pytest.raises(RolloutDumpError, match="samples: the dump holds no samples"):
        check_dump_fits(RolloutDumpReader(io.BytesIO(_dump_of([]))), **FITS)
    negative = RolloutSample(np.array([5, -1], np.int32), np.ones(2, bool))
    with pytest.raises(SampleValueError, match=r"sample 0: token_ids\[1\] = -1 is outside \[0, 2\*\*31\)"):
        _dump_of([negative])
    with unchecked_writer():  # a dump written elsewhere
        data = _dump_of([negative])
    with pytest.raises(RolloutDumpError, match="vocab: the dump holds token id -1, token ids are >= 0"):
        check_dump_fits(RolloutDumpReader(io.BytesIO(data)), **FITS)
    both = dict(FITS, topk=3, seq_length=1)
    with pytest.raises(RolloutDumpError, match="top-k: .*; seq-length: sample 0 has 2 tokens"):
        check_dump_fits(RolloutDumpReader(io.BytesIO(data)), **both)
