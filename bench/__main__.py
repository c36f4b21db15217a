"""Routing packing benchmark: CUDA kernel vs torch reference vs device copy bandwidth.

    python -m bench --out docs/benchmarks.md        # or: make bench BENCH_ARGS="--out docs/benchmarks.md"

Times, side by side in one run and on the same inputs, the gather (replay)
kernel, the pure-torch reference, and a device copy that moves the same number
of bytes (read + write) as the kernel (the faster of ``copy_`` and an
elementwise kernel). Device times replay a
CUDA graph of 20 calls (no Python or launch overhead) and take the median over
``--iters`` replays after ``--warmup`` calls; per-call times issue calls back
to back from Python, as a training loop does. "% of copy BW" is kernel bytes
per second over copy bytes per second. Also checks that the replay path (upload, pack, a router-style forward
and backward) runs under ``torch.cuda.set_sync_debug_mode("error")``, and
reports bytes per routing entry on host and device.

``--device cpu`` times the C++ kernel instead (a smoke test of this script;
the numbers in docs/benchmarks.md come from a GPU).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np
import torch

import megatron_r3
from megatron_r3.dataplane.device.packing import gather_routes, gather_routes_reference
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.device.transport import RouteUploader
from megatron_r3.dataplane.routes import RolloutRoutes


def timed(fn, device, warmup, iters, reps=20):
    """Device seconds per fn() call: median over iters of a CUDA graph replaying fn reps times.

    Replaying a captured graph keeps the GPU fed, so the figure is the work's own
    device time, free of Python and launch overhead (see :func:`timed_eager` for that).
    On the CPU it is the median wall time of single calls.
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(samples)


def timed_eager(fn, device, warmup, iters):
    """Wall seconds per call of fn() issued back to back from Python: what a training loop pays."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def case(device, tokens, layers, topk, cp, num_experts, seq_len, warmup, iters):
    """One benchmark point: rank 0 of CP=cp on a packed (THD) microbatch of `tokens` tokens."""
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    plan = RoutingPlan.build(RankLayout(cp_size=cp, cp_rank=0), lens, source_layer_numbers=range(1, layers + 1),
                             layer_numbers=range(1, layers + 1), qkv_format="thd")
    gen = torch.Generator(device=device).manual_seed(0)
    id_dtype = torch.uint8 if num_experts <= 256 else torch.int16
    ids = torch.randint(0, num_experts, (tokens, layers, topk), generator=gen, device=device).to(id_dtype)
    valid = torch.rand(tokens, generator=gen, device=device) < 0.98
    tok = torch.from_numpy(plan.token_index).to(device)
    lay = torch.from_numpy(plan.layer_index).to(device)
    out = torch.empty((layers, len(plan.token_index), topk), dtype=torch.int64, device=device)

    entries = out.numel()
    # Validity is one byte per local token, not one per (token, layer) row.
    moved = entries * (8 + ids.element_size()) + len(plan.token_index) + 4 * (tok.numel() + lay.numel())
    copy_src = torch.zeros(moved // 16, dtype=torch.int64, device=device)  # moved/2 bytes read, moved/2 written
    copy_dst = torch.empty_like(copy_src)

    expected = gather_routes_reference(ids, valid, tok, lay)
    gather_routes(ids, valid, tok, lay, out=out)
    assert torch.equal(out, expected), "kernel disagrees with the reference"
    del expected

    kernel = lambda: gather_routes(ids, valid, tok, lay, out=out)  # noqa: E731
    reference = lambda: gather_routes_reference(ids, valid, tok, lay)  # noqa: E731
    t_kernel = timed(kernel, device, warmup, iters)
    t_ref = timed(reference, device, max(2, warmup // 4), max(5, iters // 4))
    # The copy baseline is the faster of a memcpy (copy_, which a graph may hand to a copy engine) and an
    # elementwise kernel moving the same bytes on the SMs, as the packing kernel does.
    t_copy = min(timed(lambda: copy_dst.copy_(copy_src), device, warmup, iters),
                 timed(lambda: torch.bitwise_not(copy_src, out=copy_dst), device, warmup, iters))
    return dict(tokens=tokens, layers=layers, topk=topk, cp=cp, local_tokens=len(plan.token_index),
                entries=entries, moved=moved, t_kernel=t_kernel, t_ref=t_ref, t_copy=t_copy,
                wall_kernel=timed_eager(kernel, device, warmup, iters),
                wall_ref=timed_eager(reference, device, max(2, warmup // 4), max(5, iters // 4)))


def upload_case(device, tokens, layers, topk, seq_len, iters):
    """RouteUploader on a microbatch: host time of upload() and end-to-end latency to a packed result."""
    rng = np.random.default_rng(0)
    lens = [seq_len] * (tokens // seq_len)
    numbers = tuple(range(1, layers + 1))
    samples = [RolloutRoutes(rng.integers(0, 256, (n, layers, topk), dtype=np.uint8),
                             np.ones(n, np.bool_), 256, numbers) for n in lens]
    plans = [RoutingPlan.build(RankLayout(), lens, source_layer_numbers=numbers, layer_numbers=numbers,
                               qkv_format="thd")]
    uploader = RouteUploader(device)
    host, total = [], []
    for i in range(iters + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        packed = uploader.upload(samples, plans)
        t1 = time.perf_counter()
        packed[0].wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 3:
            host.append(t1 - t0)
            total.append(t2 - t0)
    nbytes = sum(s.nbytes for s in samples)
    return dict(tokens=tokens, layers=layers, topk=topk, nbytes=nbytes, host=statistics.median(host),
                total=statistics.median(total))


def sync_free_replay(device) -> str:
    """Runs upload + pack + a router-style forward/backward under sync debug mode 'error'."""
    if device.type != "cuda":
        return "skipped (needs CUDA)"
    rng = np.random.default_rng(0)
    layers, topk, experts = 8, 8, 128
    lens = [4096, 1000, 3001]
    samples = [RolloutRoutes(rng.integers(0, experts, (n, layers, topk)).astype(np.uint8),
                             rng.random(n) < 0.95, experts, tuple(range(1, layers + 1))) for n in lens]
    plans = [RoutingPlan.build(RankLayout(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=1),
                               lens, source_layer_numbers=range(1, layers + 1), layer_numbers=chunk, qkv_format="thd")
             for chunk in (range(1, 5), range(5, 9))]
    uploader = RouteUploader(device)
    uploader.upload(samples, plans)[0].wait()
    torch.cuda.synchronize()
    weight = torch.randn(64, experts, device=device, requires_grad=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            for packed in uploader.upload(samples, plans):
                expert_ids = packed.wait()
                probs = torch.softmax(torch.randn(expert_ids.shape[1], 64, device=device) @ weight, dim=-1)
                picked = torch.gather(probs, 1, expert_ids[0].clamp(min=0))
                torch.where(expert_ids[0] >= 0, picked, torch.zeros_like(picked)).sum().backward()
    except RuntimeError as err:
        return f"FAILED: {err}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return "passed (5 microbatches x 2 chunks: upload, pack, forward, backward; no device->host sync)"


def report(rows, upload, args, device, sync_result) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    command = "python -m bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Benchmarks",
        "",
        "Generated by `bench/__main__.py`; do not edit by hand.",
        "",
        f"- Device: **{name}** (torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"megatron_r3 kernels {megatron_r3.kernel_info()})",
        f"- Command: `{command}`",
        f"- Timing: device time = CUDA events around a CUDA graph of 20 calls, median of {args.iters} replays "
        f"after {args.warmup} warm-up calls (reference: a quarter of both); per call = wall time of calls issued "
        "back to back from Python, launch overhead included." if device.type == "cuda"
        else "- Timing: perf_counter (CPU smoke run).",
        "",
        "## Routing packing: gather (replay), uint8 ids in, int64 `expert_ids` out",
        "",
        "Rank 0 of a CP group on a packed (THD) microbatch of sequences of "
        f"{args.seq_len} tokens; `local tokens` is what that rank's routers see. *Moved* is the bytes the kernel "
        "must read and write (ids, validity, index maps in; int64 out); the copy baseline is the faster of a "
        "device-to-device `copy_` and an elementwise kernel (`bitwise_not`) moving the same bytes (half read, "
        "half written). *% of copy BW* = copy time / "
        "kernel time; *speedup* = reference time / kernel time. The reference (`gather_routes_reference`) is a "
        "vectorised op chain (gather, widen, mask, transpose); in device time no kernel can beat it by more than "
        "*reference / copy*, which bounds the attainable device-time speedup. The *per call* columns add what "
        "the host pays to issue each path.",
        "",
        "| tokens | layers | top-k | CP | local tokens | moved (MB) | kernel (ms) | kernel (GB/s) | copy (ms) | "
        "copy (GB/s) | % of copy BW | reference (ms) | speedup | reference / copy | kernel per call (ms) | "
        "reference per call (ms) | per-call speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['layers']} | {r['topk']} | {r['cp']} | {r['local_tokens']} | "
            f"{r['moved'] / 1e6:.1f} | {r['t_kernel'] * 1e3:.4f} | {r['moved'] / r['t_kernel'] / 1e9:.0f} | "
            f"{r['t_copy'] * 1e3:.4f} | {r['moved'] / r['t_copy'] / 1e9:.0f} | "
            f"{100 * r['t_copy'] / r['t_kernel']:.0f}% | {r['t_ref'] * 1e3:.3f} | {r['t_ref'] / r['t_kernel']:.1f}x | "
            f"{r['t_ref'] / r['t_copy']:.1f}x | {r['wall_kernel'] * 1e3:.4f} | {r['wall_ref'] * 1e3:.3f} | "
            f"{r['wall_ref'] / r['wall_kernel']:.1f}x |"
        )
    lines += [
        "",
        "## Transport: `RouteUploader.upload` (pinned staging, one async H2D on a side stream, pack)",
        "",
        f"One microbatch of {upload['tokens']} tokens x {upload['layers']} layers x top-{upload['topk']} "
        f"({upload['nbytes'] / 1e6:.1f} MB compact). *Host time* is what the training loop spends inside "
        "`upload()` (filling the pinned buffer, launching); *end to end* adds the copy and the kernel, which run "
        f"on the side stream and overlap with compute. Median of {args.upload_iters}, wall clock.",
        "",
        "| compact bytes (MB) | host time in upload() (ms) | end to end (ms) | end-to-end GB/s |",
        "|---:|---:|---:|---:|",
        f"| {upload['nbytes'] / 1e6:.1f} | {upload['host'] * 1e3:.3f} | {upload['total'] * 1e3:.3f} | "
        f"{upload['nbytes'] / upload['total'] / 1e9:.1f} |",
    ]
    layers, k = rows[0]["layers"], rows[0]["topk"]  # the main point
    validity = 1 / (layers * k)  # per-token validity: 1 byte per token, shared by its layers x top-k entries
    lines += [
        "",
        "## Bytes per routing entry (one expert id of one token at one MoE layer)",
        "",
        f"At the main point, {layers} MoE layers x top-{k}; per-token validity: 1 byte per token, "
        f"1 / ({layers} x {k}) bytes per entry.",
        "",
        f"| where | layout | bytes / entry ({layers} layers, top-{k}) |",
        "|---|---|---:|",
        f"| host (`RolloutRoutes`, <= 256 experts) | uint8 ids + one bool per token | {1 + validity:.3f} |",
        f"| host (`RolloutRoutes`, > 256 experts) | int16 ids + one bool per token | {2 + validity:.3f} |",
        f"| host -> device copy and device source | the same compact bytes, one pinned copy per microbatch "
        f"| {1 + validity:.3f} (int16: {2 + validity:.3f}) |",
        "| device, router input (`expert_ids`) | int64, only this rank's tokens and layers | 8 |",
        "| for comparison: int32 on the host | | 4 |",
        "",
        "## No device->host synchronisation in the replay path",
        "",
        f"`torch.cuda.set_sync_debug_mode(\"error\")` around upload, pack, forward and backward: **{sync_result}**",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/bench/benchmarks.md", help="markdown report path")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=4096, help="length of each packed sequence")
    parser.add_argument("--upload-iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="main point and a short sweep only")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine (or --device cpu for a smoke run)")
    if device.type == "cuda" and not megatron_r3.kernel_info()["cuda"]:
        parser.error("megatron_r3 was built without CUDA kernels: `make install` on a machine with nvcc")

    if device.type == "cuda":
        main_point = [(65536, 48, 8, 1)]
        sweep = [(t, 48, 8, 1) for t in (4096, 16384, 131072)]
        sweep += [(65536, l, 8, 1) for l in (12, 24, 94)]
        sweep += [(65536, 48, 8, cp) for cp in (2, 4, 8)]
        sweep += [(16384, 24, 8, 1), (65536, 48, 4, 1), (65536, 48, 2, 1)]
    else:
        main_point = [(4096, 8, 8, 1)]
        sweep = [(4096, 8, 8, cp) for cp in (2, 4, 8)]
    if args.quick:
        sweep = sweep[:2] + [p for p in sweep if p[3] > 1][:3]
    rows = []
    for tokens, layers, topk, cp in main_point + sweep:
        rows.append(case(device, tokens, layers, topk, cp, 256, args.seq_len, args.warmup, args.iters))
        r = rows[-1]
        print(f"tokens={tokens} layers={layers} topk={topk} cp={cp}: kernel {r['t_kernel'] * 1e3:.4f} ms, "
              f"copy {r['t_copy'] * 1e3:.4f} ms ({100 * r['t_copy'] / r['t_kernel']:.0f}% of copy BW), "
              f"reference {r['t_ref'] * 1e3:.3f} ms ({r['t_ref'] / r['t_kernel']:.0f}x)", flush=True)
    upload = upload_case(device, *((65536, 48, 8) if device.type == "cuda" else (8192, 8, 8)), args.seq_len,
                         args.upload_iters)
    print(f"upload: host {upload['host'] * 1e3:.3f} ms, end to end {upload['total'] * 1e3:.3f} ms", flush=True)
    text = report(rows, upload, args, device, sync_free_replay(device))
    print()
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
