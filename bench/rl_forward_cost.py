"""What a packed bin's routing replay adds to one forward of Megatron-LM's RL loop, in one process.

    MEGATRON=<checkout with both series> python -m bench.rl_forward_cost --out build/bench/rl-forward-cost.md
    python -m bench.rl_forward_cost --routing-replay <path to megatron/rl/routing_replay.py> --device cpu

The Megatron-LM series' ``megatron/rl/routing_replay.py`` builds, in every microbatch, the bin's ``MoERouting``
(``BinReplay.moe_routing``) that ``get_logprobs`` hands to the model. This benchmark takes that module from a
checkout and a GPTModel of the example's MoE shape (``launch/train_rl_r3.sh``: 32 experts top-4, hidden 512,
SwiGLU experts of 128, every layer MoE, softmax router with the aux loss, local layer specs) and runs, on the
same tokens, a forward routing live and a forward replaying a bin where every token has a route, the route the
model's own routers pick (so both send the same tokens to the same experts, as in the RL loop):

* the aten ops each issues (``torch.profiler``), and which ops replay adds and removes: with every token routed
  the routers take the precomputed-indices path, so a gather replaces each layer's top-k;
* the time to build the bin's ``MoERouting``;
* the forward's time, routing live and replaying, interleaved (the order swaps every pair), without grad (the
  log-prob passes) and with grad and backward (the training pass); on a GPU each timing ends in a device sync;
* on a GPU, the host syncs each forward makes (``torch.cuda.set_sync_debug_mode``), by the source line that
  makes them: a sync stops the host from queueing ahead of the device, which costs most where the device is
  shared or the host is slow, so a replayed forward should make no more than a live one.

It measures replay's own work in a forward, not the RL loop's step: the step time is ``bench.megatron_rl``'s.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from bench import publish_report


def load_routing_replay(path: Path):
    """The series' ``megatron/rl/routing_replay.py`` as a module (it imports only megatron.core)."""
    spec = importlib.util.spec_from_file_location("megatron_rl_routing_replay", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def sync_sites(fn, device) -> "collections.Counter | None":
    """The host syncs ``fn`` makes on a CUDA device, counted by the Python line that makes each (None on CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return count_sync_warnings(caught)


def count_sync_warnings(caught) -> collections.Counter:
    """``warnings.WarningMessage``s of the sync debug mode, counted by ``<parent folder>/<file>:<line>``."""
    return collections.Counter(
        f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
        for w in caught if "synchroniz" in str(w.message))


def build_model(args, device):
    """A GPTModel of the example's MoE shape on one rank, replay-capable."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=8, num_query_groups=2,
        ffn_hidden_size=3 * args.hidden_size, num_moe_experts=args.num_experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, normalization="RMSNorm",
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        moe_enable_routing_replay=True, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        moe_token_dispatcher_type="alltoall")
    torch.manual_seed(7)
    model = GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False),
                     vocab_size=args.vocab_size, max_sequence_length=args.tokens)
    return model.to(device)


class Chunk(torch.nn.Module):
    """Stands for the DDP / Float16Module wrapper the RL loop hands ``BinReplay.moe_routing``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def own_routes_bin(rr, model, tokens, positions, layers, device):
    """A bin whose every position replays the route the model's own routers pick for it (recorded in a live
    forward), as in the RL loop, where the trainer's router agrees with the engine's routes 99% of the time:
    both forwards then send the same tokens to the same experts, and only replay's own work differs."""
    from megatron.core.transformer.moe.moe_routing import MoERouting

    recording = MoERouting(layer_numbers=layers, record=True)
    with torch.no_grad():
        model(tokens, positions, None, extra_block_kwargs={"moe_routing": recording})
    ids = recording.recorded_expert_ids().permute(1, 0, 2).cpu().numpy()  # [tokens, layers, topk]
    every = np.ones(len(ids), dtype=bool)
    routes = rr.BinRoutes(ids=ids.astype(np.uint8), valid=every, recorded=every, every_token_routed=True, live=0)
    return rr.BinReplay(routes, layers, device)


def difference(live: collections.Counter, replay: collections.Counter) -> str:
    """What replay adds to live's counts (aten ops, sync sites) and what it removes, most first."""
    more, fewer = replay - live, live - replay
    return ("replay adds " + (", ".join(f"{name} x{n}" for name, n in more.most_common()) or "nothing")
            + "; removes " + (", ".join(f"{name} x{n}" for name, n in fewer.most_common()) or "nothing"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--routing-replay", type=Path,
                        help="the series' megatron/rl/routing_replay.py (default: $MEGATRON/megatron/rl/...)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1024, help="positions of the bin (the example's SEQ_LEN)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--forwards", type=int, default=200, help="timed forwards a side and mode (interleaved)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    path = args.routing_replay
    if path is None:
        if "MEGATRON" not in os.environ:
            parser.error("give --routing-replay, or set MEGATRON to a Megatron-LM checkout with both series")
        path = Path(os.environ["MEGATRON"]) / "megatron" / "rl" / "routing_replay.py"
    if not path.is_file():
        parser.error(f"{path}: no such file (the Megatron-LM series writes megatron/rl/routing_replay.py)")
    rr = load_routing_replay(path)
    device = torch.device(args.device)
    model = build_model(args, device)
    chunk = Chunk(model)
    layers = tuple(rr.chunk_moe_layers(chunk))
    tokens = torch.randint(0, args.vocab_size, (1, args.tokens), device=device)
    positions = torch.arange(args.tokens, device=device).unsqueeze(0)
    model.eval()
    replay = own_routes_bin(rr, model, tokens, positions, layers, device)

    def forward(side: str, grad: bool) -> None:
        kwargs = {}
        if side == "replay":
            kwargs["extra_block_kwargs"] = {"moe_routing": replay.moe_routing(chunk, None, None)}
        model.train(grad)
        with torch.set_grad_enabled(grad):
            out = model(tokens, positions, None, **kwargs)
            if grad:
                out.float().sum().backward()

    def synced(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    rows, changes, syncs = [], [], []
    for grad in (False, True):
        mode = "with grad and backward" if grad else "without grad"
        ops, sites = {}, {}
        for side in ("live", "replay"):
            for _ in range(3):  # warm-up: first-call compilation and allocation
                forward(side, grad)
            with torch.profiler.profile() as profile:
                forward(side, grad)
            ops[side] = collections.Counter(e.name for e in profile.events() if e.name.startswith("aten::"))
            sites[side] = sync_sites(lambda: forward(side, grad), device)
        if sites["live"] is not None:
            syncs.append(f"- {mode}: live {sum(sites['live'].values())}, replay {sum(sites['replay'].values())}; "
                         + difference(sites["live"], sites["replay"]))
            syncs.extend(f"  - {side}: " + (", ".join(f"{site} x{n}" for site, n in sorted(sites[side].items())) or "none")
                         for side in ("live", "replay"))
        times = {"live": [], "replay": []}
        for index in range(args.forwards):
            for side in (("live", "replay") if index % 2 else ("replay", "live")):
                times[side].append(synced(lambda: forward(side, grad)))
        live_ms, replay_ms = (1e3 * statistics.median(times[s]) for s in ("live", "replay"))
        rows.append(f"| {mode} | {sum(ops['live'].values())} | {sum(ops['replay'].values())} | {live_ms:.2f} | "
                    f"{replay_ms:.2f} | {replay_ms / live_ms:.3f} |")
        changes.append(f"- {mode}: " + difference(ops["live"], ops["replay"]))
    build = [synced(lambda: replay.moe_routing(chunk, None, None)) for _ in range(args.forwards)]
    shape = (f"{args.num_layers} MoE layers, hidden {args.hidden_size}, {args.num_experts} experts top-{args.topk}, "
             f"SwiGLU experts of {args.moe_ffn_hidden_size}, a bin of {args.tokens} tokens")
    report = "\n".join([
        f"## A bin's routing replay in one forward ({device.type}, torch {torch.__version__})", "",
        f"`python -m bench.rl_forward_cost {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
        f"{shape}; the series' module from {path}. Median of {args.forwards} forwards a side, interleaved.", "",
        "| forward | aten ops live | aten ops replay | ms live | ms replay | replay / live |",
        "| --- | ---: | ---: | ---: | ---: | ---: |", *rows, "", *changes, "",
        *(["Host syncs in one forward (`torch.cuda.set_sync_debug_mode`), by the line that makes them:", "",
           *syncs, ""] if syncs else []),
        f"Building the bin's `MoERouting`: median {1e6 * statistics.median(build):.0f} us.", ""])
    publish_report(report, args.out)


if __name__ == "__main__":
    main()
