"""bench.step: its kernel profile (--profile-device), the table a missed MFU target is read from, its
records, and its graphed passes at two expert ranks.

The benchmark itself times a GPU; its CPU smoke run (``--device cpu``) goes through the same code
path with operators in place of kernels, which is what runs here. On two GPUs, the graphed pass at
EP=2 with the static-shape allgather dispatcher gives the eager pass's gradients bit for bit for new
batches, and the benchmark's process ends after it (a graph holding NCCL's collectives keeps the
communicator from being destroyed until the graph is).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state

from bench import kernel_table
from bench.step import compute_ms, flat_gradient_buffers, timed_pass
from tests.support.launcher import run_workers

ROOT = Path(__file__).resolve().parents[1]


def test_gradients_accumulate_in_place_into_the_flat_buffers_that_one_call_zeroes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3, bias=False).to(torch.float64))
    model[0].bias.requires_grad_(False)
    reference = [torch.zeros_like(p) for p in model.parameters()]
    buffers = flat_gradient_buffers(list(model.parameters()))
    assert [b.dtype for b in buffers] == [torch.float32, torch.float64] and model[0].bias.grad is None
    for _ in range(2):  # two microbatches: the second adds to the first
        x = torch.randn(4, 6)
        out = model[1](model[0](x).to(torch.float64)).square().sum()
        grads = torch.autograd.grad(out, [p for p in model.parameters() if p.requires_grad])
        for ref, grad in zip([r for r, p in zip(reference, model.parameters()) if p.requires_grad], grads):
            ref += grad
        model[1](model[0](x).to(torch.float64)).square().sum().backward()
    assert torch.equal(buffers[0], torch.cat([model[0].weight.grad.flatten()]))
    assert torch.allclose(model[0].weight.grad, reference[0]) and torch.allclose(model[1].weight.grad, reference[2])
    assert model[0].weight.grad.data_ptr() == buffers[0].data_ptr()  # still the view: accumulated in place
    for buffer in buffers:
        buffer.zero_()
    assert not model[0].weight.grad.any() and not model[1].weight.grad.any()


def test_device_compute_leaves_out_nccl_whose_kernels_wait_for_peers():
    kernels = [("ncclDevKernel_SendRecv", 16, 40.0), ("nvjet_tst_128x256", 96, 25.5), ("flash_fwd", 8, 4.5)]
    assert compute_ms(kernels) == 30.0


def test_the_kernel_table_gives_each_kernels_share_of_all_kernels_time():
    kernels = [("gemm|" + "x" * 200, 3, 6.0), ("`attn`", 2, 3.0), ("norm", 1, 1.0)]
    lines = kernel_table("one `replay` pass", kernels, top=2, on_gpu=True)
    assert lines[0] == ("Where one `replay` pass spends its time: the 2 largest of its 3 kernels by their own "
                        "device time (NCCL's included), of 10.00 ms summed over all of them.")
    rows = [line for line in lines if line.startswith("| `")]
    assert len(rows) == 2
    name, calls, ms, share = (cell.strip() for cell in rows[0].strip("|").split("|"))
    assert name.startswith("`gemm/xxx") and name.endswith("...`") and len(name) == 102
    assert (calls, ms, share) == ("3", "6.00", "60.0%")
    assert rows[1] == "| `'attn'` | 2 | 3.00 | 30.0% |"


# A tiny model of bench.step's shape.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--seq-length", "128",
        "--micro-batch-size", "2", "--microbatches", "2", "--vocab-size", "128"]
STATIC_ALLGATHER = ["--moe-grouped-gemm-impl", "torch", "--moe-token-dispatcher-type", "allgather",
                    "--moe-allgather-static-shapes"]


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _cpu_run(tmp_path, *flags) -> str:
    """A one-pass CPU run of bench.step on a tiny model; its markdown report."""
    out = tmp_path / "step.md"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    run = subprocess.run(
        [sys.executable, "-m", "bench.step", "--device", "cpu", *TINY, "--rounds", "1", "--steps", "1", "--warmup", "1",
         *flags, "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out.read_text()


def test_a_cpu_run_reports_each_variants_largest_operators_most_first(tmp_path):
    report = _cpu_run(tmp_path, "--variants", "replay", "--profile-device", "4")
    assert "alltoall dispatcher" in report
    for variant in ("live", "upstream", "replay"):
        head = f"Where one `{variant}` pass spends its time: the 4 largest of its "
        assert report.count(head) == 1
        header, table = report.split(head)[1].split("\n\n")[:2]
        total = float(header.split(", of ")[-1].removesuffix(" ms summed over all of them."))
        rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in table.splitlines()[2:]]
        assert len(rows) == 4
        ms = [float(row[2]) for row in rows]
        assert ms == sorted(ms, reverse=True) and ms[-1] > 0 and sum(ms) <= total
        # each share is of the sum over all operators (figures rounded to 0.01 ms and 0.1%)
        assert all(abs(float(row[3].removesuffix("%")) - 100 * m / total) <= 0.1 for row, m in zip(rows, ms))
        assert all(row[0].startswith("`") and int(row[1]) >= 1 for row in rows)


def test_the_allgather_dispatcher_runs_and_skips_the_host_split_variants_with_the_cores_reason(tmp_path):
    report = _cpu_run(tmp_path, "--moe-token-dispatcher-type", "allgather", "--variants", "replay,replay+host-splits")
    assert "allgather dispatcher" in report
    assert ("Skipped the replay+host-splits variants: moe_token_dispatcher_type='allgather' takes no host counts "
            "(only 'alltoall' does).") in report
    rows = [row.split("|")[1].strip() for row in report.splitlines() if row.startswith("| ")]
    assert rows[1:] == ["live", "upstream", "replay"]  # the header first


def test_the_step_table_puts_runs_in_one_table_by_shape_then_ep_and_reads_the_targets(tmp_path):
    from bench.step_table import main as table_main, targets

    _cpu_run(tmp_path, "--variants", "replay")  # writes step.md and, beside it, step.json
    record = json.loads((tmp_path / "step.json").read_text())
    assert record["ep"] == 1 and (record["seq_length"], record["microbatches"]) == (128, 2)
    assert list(record["variants"]) == ["live", "upstream", "replay"]
    replay = record["variants"]["replay"]
    assert replay["pass_ms"] > 0 and replay["device_ms"] is None  # no device time on a CPU
    assert replay["vs_live"] == pytest.approx(replay["pass_ms"] / record["variants"]["live"]["pass_ms"])
    # a second run at another shape and EP, made up from the first: the table orders by shape, then EP
    bigger = dict(record, ep=2, seq_length=256, command="torchrun --nproc-per-node 2 -m bench.step ...")
    (tmp_path / "bigger.json").write_text(json.dumps(bigger))
    out = tmp_path / "table.md"
    table_main([str(tmp_path / "bigger.json"), str(tmp_path / "step.json"), "--out", str(out)])
    rows = [line.split("|")[1:4] for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["2 x 128", "1", "live"], ["", "1", "upstream"], ["", "1", "replay"],
        ["2 x 256", "2", "live"], ["", "2", "upstream"], ["", "2", "replay"]]
    assert "- `torchrun --nproc-per-node 2 -m bench.step ...`" in out.read_text()
    # the targets, from figures where a GPU measured them
    f = dict(replay, device_ms=100.0, issue_over_device=0.4, of_peak=0.31, vs_live=0.99, vs_upstream=0.96)
    lines = targets([dict(record, variants={"replay": f}), dict(bigger, variants={"replay": dict(f, of_peak=0.2)})])
    assert lines == ["- host issue <= 0.5 x device: met by every row",
                     "- MFU >= 30% of the bf16 peak: missed by 2 x 256 EP=2 replay (20.0%)",
                     "- replay <= 1.00 x live: met by every row",
                     "- replay <= 0.95 x upstream: missed by 2 x 128 EP=1 replay (0.960), 2 x 256 EP=2 replay (0.960)"]
    with pytest.raises(SystemExit, match="not a bench.step record"):
        table_main([str(tmp_path / "step.md")])


def _graph_reason_worker(flags):
    """Why bench.step's pass at EP=2 (no DDP: the benchmark times the pass alone) is not one graph, or None."""
    from megatron.core import tensor_parallel

    from bench import step
    from megatron_r3.rl.trainer.update_graphs import layout_reason

    args = step.parse_args([*TINY, "--device", "cpu", "--ep", "2", *flags])
    device = step.initialize(args)
    try:
        model, _ = step.build_model(args, device)
        tensor_parallel.get_cuda_rng_tracker().use_cudagraphable_rng = True  # as bench.step makes it on a GPU
        return layout_reason([model])
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("flags, reason", [
    (STATIC_ALLGATHER, None),
    (["--moe-grouped-gemm-impl", "torch"], "several expert ranks: the dispatcher reads its token counts on the host"),
], ids=["static-allgather", "alltoall"])
def test_the_pass_at_two_expert_ranks_is_one_graph_where_the_dispatch_keeps_its_counts_on_the_device(flags, reason):
    for got in run_workers(_graph_reason_worker, 2, flags, backend="gloo"):
        assert (got is None) if reason is None else (reason in got), got


def _graphed_pass_worker(variant):
    """bench.step's eager and graphed ``variant`` passes over three batches of the captured shape (full rows:
    every batch has one shape): whether each graph replay gave the eager pass's gradients bit for bit."""
    import torch.distributed as dist

    from bench import step
    from megatron_r3.routing_replay import chunk_moe_layers

    args = step.parse_args([*TINY, "--ep", "2", "--data", "full", *STATIC_ALLGATHER])
    device = step.initialize(args)
    try:
        model, config = step.build_model(args, device)
        layers = tuple(chunk_moe_layers(model))
        rank = dist.get_rank()
        update_pass = step.UpdatePass(args, model, config, device, step.make_samples(args, layers, seed=rank))
        checks = []
        for batch in range(3):  # the first batch's graph, captured by settle, replays the next two
            update_pass.samples = step.make_samples(args, layers, seed=10 * (batch + 1) + rank)
            grads = []
            for name in (variant, variant + "+graph"):
                update_pass.settle(name)
                update_pass(name, update_pass.plan(name))
                torch.cuda.synchronize()
                grads.append(torch.cat([buffer.float() for buffer in update_pass.grad_buffers]))
            checks.append((torch.equal(*grads), bool(grads[0].abs().sum() > 0)))
        captures = update_pass.graphs.captures
        update_pass.graphs.reset()
        return captures, checks
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["replay", "live"])
def test_the_graphed_pass_at_ep2_gives_the_eager_gradients_bit_for_bit(variant):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert run_workers(_graphed_pass_worker, 2, variant, backend="nccl") == [(1, [(True, True)] * 3)] * 2


@pytest.mark.gpu
def test_a_graphed_run_at_ep2_ends(tmp_path):
    """The benchmark's own process, graphed at EP=2, reports and exits (no hang in NCCL's teardown)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "step.md"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", _free_port(),
         "-m", "bench.step", *TINY, "--ep", "2", *STATIC_ALLGATHER, "--variants", "replay+graph", "--rounds", "1",
         "--steps", "1", "--warmup", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [row.split("|")[1].strip() for row in out.read_text().splitlines() if row.startswith("| ")]
    assert rows[1:] == ["live", "upstream", "replay+graph"]


def test_a_timed_pass_starts_after_every_rank_has_planned_and_leaves_the_wait_out():
    events = []

    class Pass:
        def plan(self, variant):
            events.append(("plan", variant))
            return "batch"

        def __call__(self, variant, batch):
            events.append(("pass", batch))
            return 0.001

    def late_peer():  # the barrier returns once the slowest rank has planned: here 0.3 s later
        events.append(("align",))
        time.sleep(0.3)

    prepare_s, issue_s, pass_s = timed_pass(Pass(), "replay", lambda: events.append(("sync",)), late_peer)
    assert events == [("sync",), ("plan", "replay"), ("align",), ("pass", "batch"), ("sync",)]
    assert issue_s == 0.001 and prepare_s < 0.3 and pass_s < 0.3  # the peer's lateness is in neither
