"""Training-step benchmark: host syncs and step time with and without host split sizes under replay.

    python -m bench.step --out build/bench/step-ep1.md                       # 1 GPU
    torchrun --nproc-per-node 2 -m bench.step --ep 2 --out build/bench/step-ep2.md

The same MoE GPT (every layer MoE, alltoall dispatcher, ``SequentialMLP`` experts,
bf16) and the same data run one training step (forward and backward of
``--microbatches`` microbatches through Megatron's schedule) four ways:

* ``live``: the router decides (no replay);
* ``upstream``: upstream ``RouterReplay`` replays the routes (global action and list);
* ``replay``: ``MoERouting`` replays the same routes (``every_token_routed=True``);
* ``replay+host-splits``: as ``replay``, and each microbatch also carries the host token
  counts of the expert tensor-and-model-parallel group (counted from the host routes and
  exchanged once per microbatch, inside the timed step, through
  ``megatron_r3.prefetch.PreparedMicrobatches``): the alltoall dispatcher's sync-free path,
  with its per-expert check of the counts (an asynchronous device assert, on by default);
* ``replay+host-splits-unchecked``: the same without that check, to price it.

For each it reports the host syncs of one step (``torch.cuda.set_sync_debug_mode``
warnings, plus event/stream/device synchronisations made from Python) and the step
time: the median over ``--rounds`` interleaved rounds (each round runs every variant
``--steps`` times, in rotated order) of the round's mean, with the min and max. It also
prints the host's issue time (when the step call returns, before the device finishes)
and the device's compute time of one step (its kernels, NCCL's excluded; profiler), so
that one can see whether the
configuration is one where host syncs matter: they cost most when the two are alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import statistics
import sys
import time
import warnings
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from launch import pretrain_gpt_r3 as launcher
from megatron_r3.expert_counts import ExpertCountExchange, local_expert_counts
from megatron_r3.host_syncs import counted_host_syncs
from megatron_r3.plan import RankLayout, RoutingPlan
from megatron_r3.prefetch import PreparedMicrobatches
from megatron_r3.routes import RolloutRoutes, concat_routes
from megatron_r3.routing_replay import moe_layer_numbers, moe_routing_for_chunk
from megatron_r3.transport import RouteUploader

VARIANTS = ("live", "upstream", "replay", "replay+host-splits", "replay+host-splits-unchecked")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (= world size)")
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--moe-router-topk", type=int, default=2)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (gloo)")
    parser.add_argument("--out", default=None, help="markdown report path (rank 0)")
    return parser.parse_args(argv)


def initialize(args) -> torch.device:
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python -m bench.step`: one rank
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    if dist.get_world_size() != args.ep:
        raise SystemExit(f"bench.step: world size {dist.get_world_size()} must equal --ep {args.ep}")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return device


def build_model(args, device) -> GPTModel:
    """The launcher's model for these sizes (bf16, alltoall, every layer MoE, replay-capable)."""
    flags = launcher.parse_args([
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--ffn-hidden-size", str(4 * args.hidden_size), "--num-attention-heads", str(args.num_attention_heads),
        "--num-experts", str(args.num_experts), "--moe-router-topk", str(args.moe_router_topk),
        "--moe-ffn-hidden-size", str(args.moe_ffn_hidden_size), "--vocab-size", str(args.vocab_size),
        "--seq-length", str(args.seq_length), "--expert-model-parallel-size", str(args.ep), "--bf16",
        "--moe-enable-routing-replay", "--init-method-std", "0.02",
    ])
    (model,) = launcher.build_model(flags, launcher.transformer_config(flags, device), device)
    return model


class Data:
    """This rank's microbatches: tokens, and routes on the host and (packed) on the device."""

    def __init__(self, args, model, device, seed):
        gen = torch.Generator().manual_seed(seed)
        self.layer_numbers = tuple(moe_layer_numbers(model))
        self.num_experts = args.num_experts
        lens = [args.seq_length] * args.micro_batch_size
        self.plan = RoutingPlan.build(RankLayout(), lens, source_layer_numbers=self.layer_numbers,
                                      layer_numbers=self.layer_numbers, qkv_format="bshd")
        uploader = RouteUploader(device)
        self.microbatches = []
        for _ in range(args.microbatches):
            tokens = torch.randint(args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=gen)
            samples = []
            for _ in range(args.micro_batch_size):
                scores = torch.rand(args.seq_length, len(self.layer_numbers), args.num_experts, generator=gen)
                ids = scores.topk(args.moe_router_topk, dim=-1).indices
                samples.append(RolloutRoutes.from_ids(ids, num_experts=args.num_experts,
                                                      layer_numbers=self.layer_numbers))
            (packed,) = uploader.upload(samples, [self.plan])
            expert_ids = packed.wait()
            self.microbatches.append({
                "tokens": tokens[:, :-1].to(device),
                "labels": tokens[:, 1:].to(device),
                "position_ids": torch.arange(args.seq_length).repeat(args.micro_batch_size, 1).to(device),
                "expert_ids": expert_ids,
                # Upstream RouterReplay wants a [tokens, k] tensor per layer, in instance order.
                "per_layer": [expert_ids[i] for i in range(len(self.layer_numbers))],
                "host_routes": concat_routes(samples),
            })
        if device.type == "cuda":
            torch.cuda.synchronize()


def forward_step(data_iterator, model, variant):
    item = next(data_iterator)
    mb = item["microbatch"]
    routing = None
    if variant == "upstream":
        RouterReplay.set_replay_data(mb["per_layer"])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    elif variant != "live":
        routing = moe_routing_for_chunk(model, mb["expert_ids"], every_token_routed=True,
                                        host_tokens_per_expert=item.get("host_counts"))
    loss = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"],
                 extra_block_kwargs={"moe_routing": routing})
    if variant == "upstream":
        RouterReplay.clear_global_router_replay_action()

    def loss_func(per_token_loss):
        total = per_token_loss.float().sum()
        return total, torch.ones((), dtype=torch.int, device=total.device), {"loss": total.detach()}

    return loss, loss_func


def run_step(variant, model, data, exchange, args):
    """One training step; returns the seconds until the call returned (host issue time)."""
    start = time.perf_counter()
    model.config.moe_check_host_tokens_per_expert = variant != "replay+host-splits-unchecked"
    model.zero_grad(set_to_none=True)

    def prepare(index):
        item = {"microbatch": data.microbatches[index]}
        if variant.startswith("replay+host-splits"):
            ids, valid = data.microbatches[index]["host_routes"]
            local = local_expert_counts(ids, valid, data.plan, data.num_experts)
            (item["host_counts"],) = exchange.gather([local], [data.plan.num_local_layers])
        return [item]

    prepared = PreparedMicrobatches(args.microbatches, prepare)
    with prepared.installed(model.config):
        get_forward_backward_func()(
            forward_step_func=partial(forward_step, variant=variant),
            data_iterator=prepared.data_iterator(),
            model=[model],
            num_microbatches=args.microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
    issued = time.perf_counter() - start
    if variant == "upstream":
        RouterReplay.clear_global_indices()  # its backward list grows otherwise
    return issued


def kernel_ms(fn) -> float:
    """Device compute time of one call of fn, in ms: its kernels' time (profiler), NCCL's
    excluded (a collective's kernel also counts the time it waits for its peers)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.self_device_time_total > 0 and "nccl" not in e.key.lower())
    return total_us / 1e3


def main(argv=None):
    args = parse_args(argv)
    device = initialize(args)
    rank = dist.get_rank()
    model = build_model(args, device)
    data = Data(args, model, device, seed=100 + rank)
    exchange = ExpertCountExchange(parallel_state.get_expert_tensor_and_model_parallel_group(), args.num_experts)
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    step = {v: partial(run_step, v, model, data, exchange, args) for v in VARIANTS}

    for variant in VARIANTS:
        for _ in range(args.warmup):
            step[variant]()
        sync()
    syncs = {}
    for variant in VARIANTS:
        counts = {}
        if on_gpu:
            with counted_host_syncs(counts):
                step[variant]()
            sync()
        syncs[variant] = counts
    device_ms = {v: kernel_ms(step[v]) for v in VARIANTS} if on_gpu else {}

    per_round = {v: [] for v in VARIANTS}
    issue = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            times = []
            for _ in range(args.steps):
                sync()
                start = time.perf_counter()
                issue[variant].append(step[variant]())
                sync()
                times.append(time.perf_counter() - start)
            per_round[variant].append(statistics.mean(times))
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{v} {1e3 * per_round[v][-1]:.2f} ms" for v in VARIANTS), flush=True)

    if rank == 0:
        report = render(args, device, syncs, per_round, issue, device_ms)
        print(report)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                f.write(report)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def render(args, device, syncs, per_round, issue, device_ms) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    command = "torchrun --nproc-per-node {} -m bench.step ".format(args.ep) if args.ep > 1 else "python -m bench.step "
    command += shlex.join(sys.argv[1:])
    median = {v: statistics.median(per_round[v]) for v in VARIANTS}
    lines = [
        f"### Training step, EP={args.ep} ({args.ep} x {name}, torch {torch.__version__}, "
        f"{datetime.date.today().isoformat()})",
        "",
        f"`{command}`",
        "",
        f"Model: {args.num_layers} MoE layers, hidden {args.hidden_size}, {args.num_experts} experts top-"
        f"{args.moe_router_topk} ({args.num_experts // args.ep} local), moe ffn {args.moe_ffn_hidden_size}, "
        f"bf16; {args.microbatches} microbatches of {args.micro_batch_size} x {args.seq_length} tokens per "
        f"rank. {args.rounds} rounds x {args.steps} steps per variant.",
        "",
        "| variant | sync-debug syncs / step | event/stream waits / step | step ms (median) | min..max | "
        "host issue ms | device compute ms | vs upstream | vs live |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        lines.append(
            f"| {v} | {syncs[v].get('sync_debug', '-')} | {syncs[v].get('waits', '-')} | {1e3 * median[v]:.2f} | "
            f"{1e3 * min(per_round[v]):.2f}..{1e3 * max(per_round[v]):.2f} | "
            f"{1e3 * statistics.median(issue[v]):.2f} | "
            f"{device_ms.get(v, float('nan')):.2f} | {median[v] / median['upstream']:.3f} | "
            f"{median[v] / median['live']:.3f} |"
        )
    issue_median = {v: statistics.median(issue[v]) for v in VARIANTS}
    lines += [
        "",
        f"Host issue time, `replay` vs `upstream`: {issue_median['replay'] / issue_median['upstream']:.3f}. "
        f"Per-expert check of the host counts: "
        f"{median['replay+host-splits'] / median['replay+host-splits-unchecked'] - 1:+.2%} of the step.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
