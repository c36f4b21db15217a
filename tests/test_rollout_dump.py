"""Rollout dump: round trip, streaming, and loud failures on bad files."""

import dataclasses
import io

import numpy as np
import pytest

from megatron_r3.adapters import RoutingSpec, from_array
from megatron_r3.rollout_dump import RolloutDumpError, RolloutDumpReader, RolloutDumpWriter, RolloutSample
from megatron_r3.validation import RoutingValidationError


def make_sample(rng, n, spec, with_routes=True, with_logprobs=True, index=0):
    routes = None
    if with_routes:
        ids = np.argsort(rng.random((n, len(spec.moe_layer_numbers), spec.num_experts)), axis=2)[:, :, : spec.topk]
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
    spec = RoutingSpec(num_layers=4, moe_layer_numbers=(2, 3, 4), num_experts=num_experts, topk=4)
    rng = np.random.default_rng(num_experts)
    samples = [make_sample(rng, int(n), spec, with_routes=i % 3 != 1, with_logprobs=i % 2 == 0, index=i)
               for i, n in enumerate(rng.integers(0, 50, 12))]
    path = tmp_path / "rollouts.r3d"
    with RolloutDumpWriter(path, num_experts=num_experts, topk=4, layer_numbers=spec.moe_layer_numbers) as w:
        for s in samples:
            w.write(s)
    with RolloutDumpReader(path) as r:
        assert (r.num_experts, r.topk, r.layer_numbers) == (num_experts, 4, (2, 3, 4))
        back = list(r)
    assert len(back) == len(samples)
    for a, b in zip(samples, back):
        assert_same(a, b)


class CountingFile(io.BytesIO):
    def read(self, n=-1):
        data = super().read(n)
        self.bytes_read = getattr(self, "bytes_read", 0) + len(data)
        return data


def test_streaming_reads_one_record_at_a_time():
    spec = RoutingSpec(num_layers=2, moe_layer_numbers=(1, 2), num_experts=64, topk=8)
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
    spec = RoutingSpec(num_layers=2, moe_layer_numbers=(1, 2), num_experts=16, topk=2)
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
    other = RoutingSpec(num_layers=3, moe_layer_numbers=(1, 2, 3), num_experts=16, topk=2)
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
    spec = RoutingSpec(num_layers=3, moe_layer_numbers=(1, 3), num_experts=300, topk=3)
    sample = make_sample(np.random.default_rng(4), 10, spec)
    assert not sample.routes.valid.all()
    with_routes, without = _dump(sample, spec), _dump(dataclasses.replace(sample, routes=None), spec)
    assert len(with_routes) - len(without) == sample.routes.ids.nbytes + 10
    (back,) = RolloutDumpReader(io.BytesIO(with_routes))
    np.testing.assert_array_equal(back.routes.valid, sample.routes.valid)


def test_reader_rejects_other_format_versions():
    spec = RoutingSpec(1, (1,), 16, 2)
    data = _dump(make_sample(np.random.default_rng(5), 4, spec), spec)
    assert data.startswith(b"R3DUMP\x00\x02")
    with pytest.raises(RolloutDumpError, match="format version 1 is not supported: this reader reads version 2"):
        RolloutDumpReader(io.BytesIO(b"R3DUMP\x00\x01" + data[8:]))


def _dump(sample, spec):
    buffer = io.BytesIO()
    with RolloutDumpWriter(buffer, num_experts=spec.num_experts, topk=spec.topk,
                           layer_numbers=spec.moe_layer_numbers) as w:
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
