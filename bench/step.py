"""The trainer's update pass: host syncs and time with live routing, upstream replay and ours.

    python -m bench.step --data rollout --out build/bench/loop-ep1.md        # 1 GPU: the loop's data
    python -m bench.step --data full --out build/bench/step-ep1.md           # every token routed
    torchrun --nproc-per-node 2 -m bench.step --ep 2 --data rollout --out build/bench/loop-ep2.md

The same MoE GPT (the launcher's model: every layer MoE, the alltoall dispatcher or
``--moe-token-dispatcher-type allgather``, grouped
experts, bf16; by default 8 layers of a Qwen3-30B-A3B-like shape: hidden 2048, 32 heads in 4
query groups, 128 experts top-8 by softmax with SwiGLU FFNs of 768, and TransformerEngine's layers where
TE is installed, ``--transformer-impl``; or a HybridModel of ``--hybrid-layer-pattern``) runs the trainer's update pass (forward and backward of
``--microbatches`` packed THD rows through Megatron's schedule, the clipped policy-gradient
loss) on the same samples, prepared by the loop's microbatch pipeline
(:mod:`megatron_r3.dataplane.device.microbatch_pipeline`, one microbatch ahead), several ways:

* ``live``: the router decides (no replay);
* ``upstream``: upstream ``RouterReplay`` replays the same routes (global action and data);
* ``replay``: ``MoERouting`` replays them (split sizes on the device, as upstream);
* ``replay+host-splits``: as ``replay``, with the host token counts of the expert
  tensor-and-model-parallel group (one exchange per microbatch, in the timed pass): the
  alltoall dispatcher's sync-free path, with its per-expert device check of the counts;
* ``replay+host-splits-unchecked``: the same without that check, to price it;
* ``replay-live-tail`` (``--data rollout`` only): the positions no loss can see routed
  live instead of given filler routes, as the loop did before: Megatron's path;
* ``live+graph``, ``replay+graph``: ``live`` and ``replay`` with the whole pass (every
  microbatch, forward and backward) one CUDA graph, Megatron's ``FullCudaGraphWrapper``
  (:mod:`megatron_r3.rl.trainer.update_graphs`; device token counts, as a graph needs), where
  the layout allows (grouped experts that keep their token counts on the device:
  ``--moe-grouped-gemm-impl torch``; at EP > 1 also a dispatcher that does:
  ``--moe-token-dispatcher-type allgather --moe-allgather-static-shapes``; the benchmark's pass
  has no DDP reduction); skipped, with the reason, elsewhere. One graph per
  process: a graphed variant whose graph another replaced is captured again, untimed, and every
  variant timed after a capture in the same round first runs one pass untimed (a capture empties
  the allocator's cache). Every variant runs on the trainer's stream and zeroes its gradients in
  place before its pass, as the trainer does.

``--data full``: every sample fills ``seq_length / micro_batch_size`` tokens and every
token has a route. ``--data rollout``: what an RL loop trains on: a prompt and a
completion per sample (85 to 100% of that length), no route for each sample's final token,
padding at the end of each row. Every variant but ``live`` replays the same routes; the
positions no loss can see get filler routes (also for ``upstream``, which cannot replay a
missing route).

For each it reports the host syncs of one pass (``torch.cuda.set_sync_debug_mode``
warnings, plus event/stream/device synchronisations made from Python), the pass time (the
median over ``--rounds`` interleaved rounds of each round's mean over ``--steps`` passes,
with the min and max), the host's preparation of the batch before the pass (``prepare``:
rows, CP placement, routing plans, filler routes, staged routes, host token counts with their
exchange; :mod:`megatron_r3.dataplane.device.batch_plan`; not part of the pass time), the
host's issue time of the pass (until it returns, before the device finishes), the device's
compute time of one pass (its kernels, NCCL's excluded) and their ratio, the peak memory the
allocator held during one pass (from its start: the weights, gradients and the pass's activations), and
the model FLOP rate against the card's bf16 peak. Garbage collection is off inside each timed region,
and at EP > 1 the ranks meet at a barrier before each timed pass (rank 0's times are reported).

Both shapes of docs/benchmarks.md ("The update pass bound by the GPU"): the default (2 rows of
8192 tokens per rank) and ``--seq-length 16384 --microbatches 4``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_routing import host_counts_unsupported
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from bench import cell, host_profile, kernel_table, kernel_times, publish_report
from megatron_r3.dataplane.device.batch_plan import PlannedBatch
from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange
from megatron_r3.dataplane.device.microbatch_pipeline import MicrobatchPipeline
from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.device.plan import RankLayout
from megatron_r3.dataplane.formats.output_files import atomic_output
from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl import arguments
from megatron_r3.rl.model import factory as model_factory
from megatron_r3.rl.model.passes import run_pass
from megatron_r3.rl.profiling.host_syncs import counted_host_syncs
from megatron_r3.rl.trainer.policy_trainer import PolicyUpdateSettings, PolicyLoss
from megatron_r3.rl.trainer.training_stack import on_training_stream
from megatron_r3.rl.trainer.update_graphs import UpdatePassGraphs
from megatron_r3.routing_replay import chunk_moe_layers

GRAPHED = "+graph"
VARIANTS = ("live", "upstream", "replay", "replay+host-splits", "replay+host-splits-unchecked",
            "live" + GRAPHED, "replay" + GRAPHED)
ROLLOUT_VARIANTS = VARIANTS + ("replay-live-tail",)


def _base(variant: str) -> str:
    """The variant without its CUDA graph."""
    return variant.removesuffix(GRAPHED)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a count of kernels, 0 or more, got {value}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=("rollout", "full"), default="rollout")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (= world size)")
    parser.add_argument("--num-layers", type=int, default=8, help="layers of the GPTModel (each attention and MoE)")
    parser.add_argument("--hybrid-layer-pattern", default=None,
                        help="a HybridModel of these layers instead (the launcher's flag: '*' attention, 'E' MoE, "
                             "'-' MLP); '*E' repeated --num-layers times is the GPTModel's stack")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=32)
    parser.add_argument("--num-query-groups", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--moe-router-topk", type=int, default=8)
    parser.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax",
                        help="the routers' score function (default softmax, Qwen3's; the launcher's GPU default "
                             "is sigmoid)")
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=768)
    parser.add_argument("--no-swiglu", dest="swiglu", action="store_false", help="GeLU experts instead of SwiGLU")
    parser.add_argument("--seq-length", type=int, default=8192, help="length of a packed row")
    parser.add_argument("--micro-batch-size", type=int, default=6, help="samples per row")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                        help="the layers (default: TransformerEngine's where installed, as the launcher)")
    parser.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall",
                        help="the launcher's flag: allgather moves every token to every expert rank, in shapes "
                             "that do not depend on the routes")
    parser.add_argument("--moe-allgather-static-shapes", action="store_true",
                        help="the launcher's flag: the allgather dispatcher's permutation sized for the most rows, "
                             "its token counts on the device (no host sync at any EP size)")
    parser.add_argument("--moe-permute-fusion", action="store_true", help="TE's fused token permutation")
    rope = parser.add_mutually_exclusive_group()
    rope.add_argument("--apply-rope-fusion", dest="apply_rope_fusion", action="store_true", default=None,
                      help="TE's fused rotary embedding (default with TE's layers, as the launcher)")
    rope.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false", default=None,
                      help="the unfused rotary embedding with TE's layers")
    parser.add_argument("--moe-router-fusion", action="store_true",
                        help="TE's fused top-k and score function (replayed microbatches take the unfused path)")
    parser.add_argument("--moe-grouped-gemm-impl", choices=("transformer_engine", "torch"), default=None,
                        help="who runs the grouped experts with TE's layers (the launcher's flag)")
    parser.add_argument("--profile-host", type=int, default=0, metavar="N",
                        help="print the N functions the host spends most time in (their own time, cProfile) during "
                             "one pass of each variant, and who called the first five, to find what a host-bound pass "
                             "waits on")
    parser.add_argument("--profile-device", type=_count, default=0, metavar="N",
                        help="add to the report the N kernels with the most device time over one pass of each "
                             "variant (torch's profiler; on a CPU run, the N operators with the most CPU time), "
                             "to see where a device-bound pass spends its time")
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset of the variants (default: all; live and upstream always run)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="passes per variant per round")
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
    # Graph-safe on a GPU: Megatron's full-iteration graph registers the tracker's generators.
    tensor_parallel.model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=device.type == "cuda")
    return device


def build_model(args, device):
    """The launcher's model for these sizes (bf16, every layer MoE, replay-capable)."""
    layers = (["--num-layers", str(args.num_layers)] if args.hybrid_layer_pattern is None
              else ["--hybrid-layer-pattern", args.hybrid_layer_pattern])
    flags = arguments.parse_args([
        *layers, "--hidden-size", str(args.hidden_size),
        "--ffn-hidden-size", str(4 * args.hidden_size), "--num-attention-heads", str(args.num_attention_heads),
        "--num-query-groups", str(args.num_query_groups),
        "--num-experts", str(args.num_experts), "--moe-router-topk", str(args.moe_router_topk),
        "--moe-router-score-function", args.moe_router_score_function,
        "--moe-ffn-hidden-size", str(args.moe_ffn_hidden_size), "--vocab-size", str(args.vocab_size),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--expert-model-parallel-size", str(args.ep), "--bf16", "--moe-enable-routing-replay",
        "--moe-token-dispatcher-type", args.moe_token_dispatcher_type,
        *(["--moe-allgather-static-shapes"] if args.moe_allgather_static_shapes else []),
        "--init-method-std", "0.02",
        *(["--swiglu"] if args.swiglu else []),
        *(["--transformer-impl", args.transformer_impl] if args.transformer_impl else []),
        *(["--moe-permute-fusion"] if args.moe_permute_fusion else []),
        *{True: ["--apply-rope-fusion"], False: ["--no-rope-fusion"], None: []}[args.apply_rope_fusion],
        *(["--moe-router-fusion"] if args.moe_router_fusion else []),
        *(["--moe-grouped-gemm-impl", args.moe_grouped_gemm_impl] if args.moe_grouped_gemm_impl else []),
    ])
    settings = arguments.model_settings(flags)
    config = model_factory.transformer_config(settings, device)
    (model,) = model_factory.build_model(settings, config, device)
    return model, config


def make_samples(args, layer_numbers, seed) -> list[RolloutSample]:
    """This rank's samples: full rows of routed tokens, or rollout-shaped ones (see the module doc)."""
    gen = np.random.default_rng(seed)
    width = args.seq_length // args.micro_batch_size
    samples = []
    for _ in range(args.microbatches * args.micro_batch_size):
        length = width if args.data == "full" else int(gen.integers(int(0.85 * width), width + 1))
        prompt = 0 if args.data == "full" else min(256, length // 4)
        scores = gen.random((length, len(layer_numbers), args.num_experts), dtype=np.float32)
        ids = np.argpartition(scores, args.moe_router_topk, axis=-1)[..., :args.moe_router_topk]
        valid = np.ones(length, bool)
        if args.data == "rollout":
            valid[-1] = False  # the final sampled token never ran through the engine
        samples.append(RolloutSample(
            token_ids=gen.integers(0, args.vocab_size, length),
            loss_mask=np.arange(length) >= max(prompt, 1),
            logprobs=-gen.random(length).astype(np.float32),
            routes=RolloutRoutes.from_ids(ids, num_experts=args.num_experts, layer_numbers=layer_numbers,
                                          valid=valid)))
    return samples


def flat_gradient_buffers(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """One zeroed buffer per dtype holding the gradient of every parameter that takes one, each ``.grad`` a view of
    it (as Megatron's DDP keeps its gradient buffers): autograd accumulates into the views in place."""
    buffers = []
    trained = [param for param in params if param.requires_grad]
    for dtype in sorted({param.dtype for param in trained}, key=str):
        group = [param for param in trained if param.dtype == dtype]
        buffer = torch.zeros(sum(param.numel() for param in group), dtype=dtype, device=group[0].device)
        offset = 0
        for param in group:
            param.grad = buffer[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
        buffers.append(buffer)
    return buffers


class UpdatePass:
    """One variant's update pass over the same samples: :meth:`plan` (the host's preparation, once per
    batch) and the pass itself (returns its host issue time)."""

    def __init__(self, args, model, config, device, samples):
        self.model, self.config, self.samples = model, config, samples
        # Every variant's gradients are zeroed in place before its pass, as the trainer zeroes DDP's
        # buffers: the graphs accumulate into the tensors they captured, so no variant may drop them, and
        # an eager pass that starts from no gradient would skip the add a graphed one makes. As in DDP the
        # gradients are views of one buffer per dtype, zeroed in one call each (a zero_ per parameter, 1067
        # calls a pass at EP=2, took 8-12 ms of its host issue under cProfile).
        self.grad_buffers = flat_gradient_buffers(list(model.parameters()))
        self.device = device
        spec = RoutingSpec.from_config(config, args.hybrid_layer_pattern)
        rows = RowLayout(RankLayout.of_this_rank(config.sequence_parallel), config,
                         args.seq_length, args.micro_batch_size, device, args.hybrid_layer_pattern)
        exchange = ExpertCountExchange(parallel_state.get_expert_tensor_and_model_parallel_group(),
                                       args.num_experts)
        self.pipelines = {"device": MicrobatchPipeline(rows, spec), "host": MicrobatchPipeline(rows, spec, exchange)}
        gen = np.random.default_rng(7)
        self.advantages = gen.standard_normal(len(samples))
        self.loss = PolicyLoss(PolicyUpdateSettings("r3", compare=False, clip_ratio=0.2, temperature=1.0))
        # Megatron's full-iteration graph of the whole pass (one per process: graphed variants take turns).
        self.graphs = UpdatePassGraphs([model], self.loss)
        self._graphed = None  # the variant the graph holds

    def plan(self, variant: str) -> PlannedBatch:
        """The host's preparation of the variant's batch: rows, plans, fillers, staged routes, host counts."""
        pipeline = self.pipelines["host" if variant.startswith("replay+host-splits") else "device"]
        return pipeline.plan(self.samples, self.advantages, rollout_routes=_base(variant) != "live",
                             fillers=variant != "replay-live-tail")

    def settle(self, variant: str) -> bool:
        """Before any pass of a graphed variant: where the graph is another variant's (or none), capture this
        one's: the wrapper's first pass runs eagerly, its second captures. Whether it captured."""
        if not variant.endswith(GRAPHED) or self._graphed == variant:
            return False
        self.graphs.reset()
        self._graphed = variant
        for _ in range(2):
            self(variant, self.plan(variant))
        return True

    def __call__(self, variant: str, batch: PlannedBatch) -> float:
        start = time.perf_counter()
        self.config.moe_check_host_tokens_per_expert = variant != "replay+host-splits-unchecked"
        pipeline = self.pipelines["host" if variant.startswith("replay+host-splits") else "device"]
        routes = _base(variant) != "live"
        then = _to_router_replay if variant == "upstream" else None
        microbatches = pipeline.prepare(batch, rollout_routes=routes, fillers=variant != "replay-live-tail",
                                        then=then)
        if variant.endswith(GRAPHED) and self._graphed != variant:
            raise RuntimeError(f"bench.step: settle({variant!r}) before its passes")
        # The trainer's stream for every variant: autograd runs a parameter's gradient accumulation on the
        # stream its first backward ran on, and a capture cannot accumulate on another.
        with on_training_stream(self.device):
            for buffer in self.grad_buffers:
                buffer.zero_()
            if variant.endswith(GRAPHED):
                self.graphs.run(microbatches)
                return time.perf_counter() - start
            if variant == "upstream":
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            try:
                run_pass([self.model], microbatches, self.loss, replay=routes and variant != "upstream",
                         forward_only=False)
            finally:
                if variant == "upstream":
                    RouterReplay.clear_global_router_replay_action()
                    RouterReplay.clear_global_indices()  # its backward list grows otherwise
        return time.perf_counter() - start


def timed_pass(update_pass: UpdatePass, variant: str, sync, align) -> tuple[float, float, float]:
    """One timed pass of ``variant``: the host's preparation, the pass's host issue and the pass itself
    (until the device is done), in seconds. Every rank starts the pass together (``align``: a barrier at
    EP > 1, as Megatron's ``forward-backward`` timer starts by default, ``barrier_with_L1_time``): a rank
    that starts late holds the others at the pass's first collective, and that wait is the harness's (its
    collection, its preparation), not the pass's."""
    sync()
    gc.collect()
    gc.disable()  # as Python's timeit does: no collection inside a timed region
    try:
        start = time.perf_counter()
        batch = update_pass.plan(variant)
        prepare_s = time.perf_counter() - start
        align()
        start = time.perf_counter()
        issue_s = update_pass(variant, batch)
        sync()
        return prepare_s, issue_s, time.perf_counter() - start
    finally:
        gc.enable()


def _to_router_replay(items) -> None:
    """Upstream's API: the microbatch's routes, one [tokens, k] tensor per router, set globally.

    A microbatch is prepared after the previous one's forward was issued, so its routes are
    in place when its own forward runs.
    """
    (item,) = items
    RouterReplay.set_replay_data(list(item.routes.wait()))


def model_flops(args, sample_lens) -> float:
    """Model FLOPs of one update pass (forward and backward: 3x the forward's matrix products) over
    samples of ``sample_lens`` tokens, padding not counted; causal attention within each sample."""
    h, heads, groups = args.hidden_size, args.num_attention_heads, args.num_query_groups
    head_dim = h // heads
    q, kv = heads * head_dim, groups * head_dim
    gated = 2 if args.swiglu else 1
    per_token = {"*": 2 * h * (q + 2 * kv) + 2 * q * h,
                 "E": 2 * h * args.num_experts + args.moe_router_topk * (
                     2 * h * gated * args.moe_ffn_hidden_size + 2 * args.moe_ffn_hidden_size * h),
                 "-": 2 * h * gated * 4 * h + 2 * 4 * h * h}
    layers = layer_symbols(args)
    tokens = sum(sample_lens)
    attention = sum(4 * q * n * (n + 1) / 2 for n in sample_lens)
    forward = (tokens * (sum(per_token[symbol] for symbol in layers) + 2 * h * args.vocab_size)
               + layers.count("*") * attention)
    return 3 * forward


def layer_symbols(args) -> str:
    """The model's layers as hybrid symbols: a GPT layer is attention then MoE (``*E``)."""
    if args.hybrid_layer_pattern is None:
        return "*E" * args.num_layers
    return args.hybrid_layer_pattern.replace("|", "")


def experts_class(model) -> str:
    """The class that runs the experts of the model's MoE layers (TEGroupedMLP, GroupedGemmExperts, ...)."""
    return next(type(m.experts).__name__ for m in model.modules() if isinstance(m, MoELayer))


def model_description(args) -> str:
    """The model, for the report."""
    if args.hybrid_layer_pattern is None:
        return f"GPTModel of {args.num_layers} MoE layers"
    return f"HybridModel `{args.hybrid_layer_pattern}` ({layer_symbols(args).count('E')} MoE layers)"


# Dense bf16 tensor-core peak by the vendor's datasheet (SXM parts; without sparsity).
BF16_PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}


def bf16_peak(device) -> tuple[float, float]:
    """(datasheet peak or nan, measured: the median of a large bf16 matrix product) in FLOP/s."""
    name = torch.cuda.get_device_name(device)
    datasheet = next((v for k, v in BF16_PEAK_FLOPS.items() if k in name), float("nan"))
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return datasheet, 2 * n ** 3 / statistics.median(times)


def compute_ms(kernels: list[tuple[str, int, float]]) -> float:
    """Device compute time: every kernel's but NCCL's (a collective's kernel also counts the time
    it waits for its peers)."""
    return sum(ms for name, _, ms in kernels if "nccl" not in name.lower())


def main(argv=None):
    args = parse_args(argv)
    device = initialize(args)
    rank = dist.get_rank()
    model, config = build_model(args, device)
    samples = make_samples(args, tuple(chunk_moe_layers(model)), seed=100 + rank)
    update_pass = UpdatePass(args, model, config, device, samples)
    variants = ROLLOUT_VARIANTS if args.data == "rollout" else VARIANTS
    if args.variants:
        chosen = set(args.variants.split(",")) | {"live", "upstream"}
        unknown = chosen - set(variants)
        if unknown:
            raise SystemExit(f"bench.step: unknown --variants {sorted(unknown)}; choose from {variants}")
        variants = tuple(v for v in variants if v in chosen)
    skipped = []
    why = host_counts_unsupported(config)
    if why is not None:  # the core refuses host counts here: those variants cannot run
        skipped.append(f"Skipped the replay+host-splits variants: {why}.")
        variants = tuple(v for v in variants if not v.startswith("replay+host-splits"))
    why_eager = update_pass.graphs.why_eager
    if why_eager is not None:  # Megatron's full-iteration graph does not apply to this layout
        skipped.append(f"Skipped the {GRAPHED} variants (the pass runs eagerly): {why_eager}.")
        variants = tuple(v for v in variants if not v.endswith(GRAPHED))
    for line in skipped:
        print(f"bench.step: {line}", file=sys.stderr)
    flops = model_flops(args, [len(s.token_ids) for s in samples])
    tokens = sum(len(s.token_ids) for s in samples)
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    align = dist.barrier if dist.get_world_size() > 1 else (lambda: None)

    def run(variant):
        return update_pass(variant, update_pass.plan(variant))

    for variant in variants:
        update_pass.settle(variant)
        for _ in range(args.warmup):
            run(variant)
        sync()
    syncs, peak_memory = {}, {}
    for variant in variants:
        update_pass.settle(variant)
        batch = update_pass.plan(variant)
        counts = {}
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
            with counted_host_syncs(counts):
                update_pass(variant, batch)
            sync()
            peak_memory[variant] = torch.cuda.max_memory_allocated(device)
        syncs[variant] = counts
    device_ms, kernels = {}, {}
    for variant in variants if on_gpu or args.profile_device else ():
        update_pass.settle(variant)
        kernels[variant] = kernel_times(partial(update_pass, variant, update_pass.plan(variant)), on_gpu)
        if on_gpu:
            device_ms[variant] = compute_ms(kernels[variant])
    if args.profile_host:
        for variant in variants:
            update_pass.settle(variant)
            for what, fn in (("prepare", partial(update_pass.plan, variant)),
                             ("pass", partial(update_pass, variant, update_pass.plan(variant)))):
                own, callers = host_profile(fn, args.profile_host)
                sync()
                if rank == 0:
                    print(f"--- host profile of one `{variant}` {what} ---\n{own}\n{callers}", flush=True)

    per_round = {v: [] for v in variants}
    issue = {v: [] for v in variants}
    prepare = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        captured = False
        for variant in order:
            # a graphed variant whose graph another one replaced is captured again; a capture empties the
            # allocator's cache, so a variant timed after one first runs a pass untimed to fill it again
            captured = update_pass.settle(variant) or captured
            if captured:
                run(variant)
                sync()
            times = []
            for _ in range(args.steps):
                prepare_s, issue_s, pass_s = timed_pass(update_pass, variant, sync, align)
                prepare[variant].append(prepare_s)
                issue[variant].append(issue_s)
                times.append(pass_s)
            per_round[variant].append(statistics.mean(times))
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{v} {1e3 * per_round[v][-1]:.2f} ms" for v in variants), flush=True)

    peak = bf16_peak(device) if on_gpu else (float("nan"), float("nan"))
    if rank == 0:
        figures = variant_figures(args, variants, syncs, per_round, issue, prepare, device_ms, peak_memory, flops,
                                  tokens, peak)
        report = render(args, device, config, experts_class(model), figures, flops, tokens, peak, skipped)
        if args.profile_device:
            report += "\n" + "\n".join(line for v in variants for line in kernel_table(
                f"one `{v}` pass", kernels[v], args.profile_device, on_gpu))
        publish_report(report, args.out)
        if args.out:  # the figures for bench.step_table, which puts several runs in one table
            write_record(Path(args.out).with_suffix(".json"), {
                "command": report_command(args), "device": device_name(device), "ep": args.ep,
                "seq_length": args.seq_length, "microbatches": args.microbatches, "variants": figures})
    # A graph that captured NCCL's collectives (the allgathers at EP > 1) keeps its communicator from being
    # destroyed until the graph is: drop it first.
    update_pass.graphs.reset()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def variant_figures(args, variants, syncs, per_round, issue, prepare, device_ms, peak_memory, flops, tokens,
                    peak) -> dict[str, dict]:
    """Each variant's figures of the report, by name (milliseconds, GiB, fractions; None where not measured)."""
    median = {v: statistics.median(per_round[v]) for v in variants}
    figures = {}
    for v in variants:
        rate = flops / median[v]
        device = device_ms.get(v)
        issue_ms = 1e3 * statistics.median(issue[v])
        figures[v] = {
            "sync_debug": syncs[v].get("sync_debug"), "waits": syncs[v].get("waits"),
            "pass_ms": 1e3 * median[v], "min_ms": 1e3 * min(per_round[v]), "max_ms": 1e3 * max(per_round[v]),
            "prepare_ms": 1e3 * statistics.median(prepare[v]), "host_issue_ms": issue_ms, "device_ms": device,
            "issue_over_device": issue_ms / device if device else None,
            "peak_memory_gib": peak_memory[v] / 2**30 if v in peak_memory else None,
            "tflops": rate / 1e12, "of_peak": rate / peak[0] if peak[0] == peak[0] else None,
            "tokens_per_s": args.ep * tokens / median[v],
            "vs_upstream": median[v] / median["upstream"], "vs_live": median[v] / median["live"],
        }
    return figures


def report_command(args) -> str:
    command = "torchrun --nproc-per-node {} -m bench.step ".format(args.ep) if args.ep > 1 else "python -m bench.step "
    return command + shlex.join(sys.argv[1:])


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def write_record(path: Path, record: dict) -> None:
    with atomic_output(str(path), overwrite=True) as temporary, open(temporary, "w") as f:
        json.dump(record, f, indent=1)


def render(args, device, config, experts, figures, flops, tokens, peak, skipped) -> str:
    data = ("rollout-shaped samples (final token without a route, padded rows)" if args.data == "rollout"
            else "full rows, every token routed")
    lines = [
        f"### Update pass, {args.data} data, EP={args.ep} ({args.ep} x {device_name(device)}, torch "
        f"{torch.__version__}, {datetime.date.today().isoformat()})",
        "",
        f"`{report_command(args)}`",
        "",
        f"Model: {model_description(args)}, hidden {args.hidden_size}, {args.num_attention_heads} heads in "
        f"{args.num_query_groups} query groups, {args.num_experts} experts top-{args.moe_router_topk} "
        f"({args.num_experts // args.ep} local), moe ffn {args.moe_ffn_hidden_size} "
        f"({'SwiGLU' if args.swiglu else 'GeLU'}), vocab {args.vocab_size}, bf16, "
        f"{config.moe_token_dispatcher_type} dispatcher"
        f"{' (static shapes)' if args.moe_allgather_static_shapes else ''}, layers "
        f"`{config.transformer_impl}`{', permute fusion' if config.moe_permute_fusion else ''}"
        f"{', router fusion' if config.moe_router_fusion else ''}"
        f"{', rope fusion' if config.apply_rope_fusion else ''}, experts `{experts}`; "
        f"{args.microbatches} microbatches per rank, each a row of {args.seq_length} tokens holding "
        f"{args.micro_batch_size} samples: {data}. {args.rounds} rounds x {args.steps} passes per variant. "
        f"Model FLOPs per pass and rank: {flops / 1e12:.2f} TFLOP over {tokens} tokens (3x the forward's "
        f"matrix products, causal attention within each sample, padding not counted); bf16 peak "
        f"{peak[0] / 1e12:.0f} TFLOP/s (datasheet, dense), {peak[1] / 1e12:.0f} TFLOP/s measured "
        f"(an 8192^3 matrix product).",
        "",
        "| variant | sync-debug syncs / pass | event/stream waits / pass | pass ms (median) | min..max | "
        "prepare ms | host issue ms | device compute ms | host issue / device | peak memory GiB | "
        "model TFLOP/s per GPU | of bf16 peak | tokens/s (all ranks) | vs upstream | vs live |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, f in figures.items():
        lines.append(
            f"| {v} | {cell(f['sync_debug'], 'd')} | {cell(f['waits'], 'd')} | {f['pass_ms']:.2f} | "
            f"{f['min_ms']:.2f}..{f['max_ms']:.2f} | {f['prepare_ms']:.2f} | {f['host_issue_ms']:.2f} | "
            f"{cell(f['device_ms'], '.2f')} | {cell(f['issue_over_device'], '.2f')} | "
            f"{cell(f['peak_memory_gib'], '.1f')} | {f['tflops']:.1f} | {cell(f['of_peak'], '.1%')} | "
            f"{f['tokens_per_s']:.0f} | {f['vs_upstream']:.3f} | {f['vs_live']:.3f} |"
        )
    lines += ["", *skipped]
    if "replay" in figures:
        lines.append(f"Host issue time, `replay` vs `upstream`: "
                     f"{figures['replay']['host_issue_ms'] / figures['upstream']['host_issue_ms']:.3f}.")
    if {"replay+host-splits", "replay+host-splits-unchecked"} <= figures.keys():
        checked, unchecked = (figures[v]["pass_ms"] for v in ("replay+host-splits", "replay+host-splits-unchecked"))
        lines.append(f"Per-expert check of the host counts: {checked / unchecked - 1:+.2%} of the pass.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
