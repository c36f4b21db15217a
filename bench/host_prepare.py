"""The host's preparation of an update pass's microbatches, before and after the batch plan (CPU only).

    python -m bench.host_prepare --out build/bench/host-prepare.md

Until the batch plan (:mod:`megatron_r3.dataplane.device.batch_plan`) the host prepared each
microbatch inside the pass (``tests/support/prepare_reference.py``, the preparation of commit
cd9be66): the row packed sample by sample, the context-parallel placement computed with torch
on the host for the row and again for every chunk's plan, the host token counts counted one
MoE layer at a time. Now it is prepared once per batch, before the pass, vectorised with
numpy, and the pass only hands each microbatch's staged buffers to the device. This times
the host-side functions alone, old and new side by side on the same samples (the step
benchmark's rollout-shaped ones: 85-100% of a row's share per sample, a 256-token prompt, no
route for the final token), at the shapes of docs/benchmarks.md: 2 rows of 8192 and 4 rows of
16384 tokens per rank, 6 samples a row, 8 MoE layers of 128 experts top-8. Each figure is the
median over ``--repeats`` interleaved repeats of one batch's total, in ms. The old functions
run torch's small CPU kernels, which go through its intra-op thread pool; they are also timed
with that pool at one thread (``torch.set_num_threads(1)`` inside the benchmark only), which
shows how much of their time is the pool's.

Rows: the row packing (``pack_rollout_microbatch`` on the CPU against ``pack_rollout_row``),
the CP placement (torch's ``zigzag_placement`` on the host against numpy's), the routing plans
of one chunk, the host token counts of one chunk, and the whole preparation of a replaying
pass with host counts (the routes with their fillers, staged for the device now; without the
gather kernel, which runs on the device), and what of it runs inside the pass: all of it
before, the copy of each row after (a clone here, an asynchronous copy on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from bench import publish_report
from bench.step import make_samples
from megatron_r3.dataplane.device.batch_plan import PlannedBatch
from megatron_r3.dataplane.device.expert_counts import local_expert_counts
from megatron_r3.dataplane.device.filler_routes import filler_expert_ids, with_fillers
from megatron_r3.dataplane.device.microbatches import RowLayout, pack_rollout_row
from megatron_r3.dataplane.device.plan import RankLayout
from megatron_r3.dataplane.routes import RolloutRoutes, concat_routes
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.layers.context_parallel import zigzag_placement, zigzag_placement_host
from tests.support import prepare_reference as old

SHAPES = ((8192, 2), (16384, 4))  # (row length, rows per rank)


class LocalCounts:
    """The exchange of a group of one: each microbatch's own counts (as ``ExpertCountExchange`` at one rank)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def gather_batch(self, local, num_layers):
        return [[None if c is None else torch.from_numpy(c)[None] for c in chunks] for chunks in local]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.host_prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=8, help="MoE layers (every layer MoE)")
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--moe-router-topk", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=6, help="samples per row")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="context-parallel sizes (rank 0 of each)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="markdown report path")
    return parser.parse_args(argv)


def one_shape(args, seq_length: int, rows_per_rank: int, cp: int) -> dict[str, tuple[float, float]]:
    """Per timed function, (old ms, old ms with torch on one thread, new ms): the median over the repeats of
    one batch's total."""
    spec = RoutingSpec(args.num_layers, tuple(range(1, args.num_layers + 1)), args.num_experts, args.moe_router_topk)
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=64, num_attention_heads=4,
                               num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk)
    rank = RankLayout(cp_size=cp)
    rows = RowLayout(rank, config, seq_length, args.micro_batch_size, torch.device("cpu"))
    shape = SimpleNamespace(seq_length=seq_length, micro_batch_size=args.micro_batch_size, microbatches=rows_per_rank,
                            data="rollout", num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                            vocab_size=8192)
    samples = make_samples(shape, spec.model_moe_layers, seed=seq_length + cp)
    advantages = np.random.default_rng(1).standard_normal(len(samples))
    size = args.micro_batch_size
    groups = [samples[i:i + size] for i in range(0, len(samples), size)]
    new_rows = [pack_rollout_row(group, rank, seq_length) for group in groups]
    old_rows = [old.pack_rollout_microbatch(group, rank, seq_length) for group in groups]
    cus = [np.concatenate([[0], np.cumsum(row.padded_lens)]) for row in new_rows]
    old_plans = [old.chunk_plans(rows, row, spec.model_moe_layers)[0] for row in old_rows]
    new_plans = [rows.row_plans(row, spec.model_moe_layers)[0] for row in new_rows]

    def old_routes(group, plan):
        routes, next_filler = with_fillers([s.routes for s in group], [s.loss_mask for s in group])
        padding = plan.num_padding_rows
        ids = filler_expert_ids(padding, next_filler, len(spec.model_moe_layers), spec.topk, spec.num_experts)
        routes.append(RolloutRoutes(ids, np.ones(padding, bool), spec.num_experts, spec.model_moe_layers))
        return concat_routes(routes)

    sources = [old_routes(group, plan) for group, plan in zip(groups, old_plans)]
    batch = PlannedBatch(samples, advantages, rows, spec, LocalCounts(spec.num_experts))
    staged = batch.rollout_routes(fillers=True)

    def old_whole():  # the preparation of a replaying pass, as the pass did it (the gather left out)
        for group in groups:
            row = old.pack_rollout_microbatch(group, rank, seq_length, None)
            plan = old.chunk_plans(rows, row, spec.model_moe_layers)[0]
            ids, valid = old_routes(group, plan)
            old.local_expert_counts(ids, valid, plan.with_padding_rows(), spec.num_experts)

    def new_whole():
        PlannedBatch(samples, advantages, rows, spec, LocalCounts(spec.num_experts)).rollout_routes(fillers=True)

    def new_in_pass():  # what is left inside the pass: the row's copy (a clone here; an async copy on a GPU)
        for mb in batch.microbatches:
            mb.row.to_device(torch.device("cpu"))

    timed = {
        "row packing": (lambda: [old.pack_rollout_microbatch(g, rank, seq_length, None) for g in groups],
                        lambda: [pack_rollout_row(g, rank, seq_length) for g in groups]),
        "CP placement (once)": (lambda: [zigzag_placement(torch.from_numpy(cu), cp, 0, seq_length // cp) for cu in cus],
                                lambda: [zigzag_placement_host(np.diff(cu), cp, 0) for cu in cus]),
        "routing plan of a chunk": (lambda: [old.chunk_plans(rows, row, spec.model_moe_layers) for row in old_rows],
                                    lambda: [rows.row_plans(row, spec.model_moe_layers) for row in new_rows]),
        "host counts of a chunk": (
            lambda: [old.local_expert_counts(ids, valid, plan.with_padding_rows(), spec.num_experts)
                     for (ids, valid), plan in zip(sources, old_plans)],
            lambda: [local_expert_counts(r.staged.ids, r.staged.valid, r.staged.plans[0], spec.num_experts)
                     for r in staged]),
        "whole preparation": (old_whole, new_whole),
        "inside the pass": (old_whole, new_in_pass),
    }
    # The counts agree (the tests prove every field equal).
    for (ids, valid), plan, r in zip(sources, old_plans, staged):
        want = old.local_expert_counts(ids, valid, plan.with_padding_rows(), spec.num_experts)
        assert np.array_equal(want, r.host_tokens_per_expert[0][0].numpy())
    threads = torch.get_num_threads()
    times = {name: ([], [], []) for name in timed}
    for _ in range(args.repeats):
        for name, (before, after) in timed.items():
            for fn, out, pool in ((before, times[name][0], threads), (before, times[name][1], 1),
                                  (after, times[name][2], threads)):
                torch.set_num_threads(pool)
                try:
                    start = time.perf_counter()
                    fn()
                    out.append(1e3 * (time.perf_counter() - start))
                finally:
                    torch.set_num_threads(threads)
    return {name: tuple(statistics.median(t) for t in runs) for name, runs in times.items()}


def main(argv=None):
    args = parse_args(argv)
    lines = [
        f"### Host preparation of an update pass, before and after the batch plan ({datetime.date.today().isoformat()})",
        "",
        f"`{shlex.join(['python', '-m', 'bench.host_prepare', *(sys.argv[1:] if argv is None else argv)])}`",
        "",
        f"Host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores seen, torch "
        f"{torch.__version__} with {torch.get_num_threads()} intra-op threads, numpy {np.__version__}. "
        f"{args.num_layers} MoE layers, {args.num_experts} experts top-{args.moe_router_topk}, "
        f"{args.micro_batch_size} samples a row; rank 0 of each CP size; median of {args.repeats} repeats, "
        f"ms per batch (all its rows).",
        "",
        "| rows per rank | CP | function | before (per microbatch, in the pass) ms | before, torch on 1 thread ms | "
        "after (per batch, before the pass) ms | speed-up |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for seq_length, count in SHAPES:
        for cp in args.cp:
            for name, (before, one_thread, after) in one_shape(args, seq_length, count, cp).items():
                lines.append(f"| {count} x {seq_length} | {cp} | {name} | {before:.2f} | {one_thread:.2f} | "
                             f"{after:.2f} | {before / after:.1f}x |")
            print(f"{count} x {seq_length}, CP {cp}: done", flush=True)
    publish_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
