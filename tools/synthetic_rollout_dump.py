"""Write a synthetic rollout dump: random samples with loss masks, rollout log-probs and routes.

    python tools/synthetic_rollout_dump.py --out rollouts.r3dump --num-samples 64 \\
        --num-layers 4 --moe-layer-freq 0,1,0,1 --num-experts 8 --moe-router-topk 2 --vocab-size 1024

For smoke-testing ``launch/pretrain_gpt_r3.py`` on a new machine or layout
without a rollout engine. Each sample is a prompt (the first third, not trained
on) and a response with a random reward in [0, 1] (``meta["reward"]``); every
token but the last (which an engine never runs) gets distinct random experts at
every MoE layer, unless ``--routed-fraction`` leaves some tokens without a route.

The dump is written under a temporary name next to ``--out`` and renamed once
complete; an existing ``--out`` is refused unless ``--overwrite`` is given, and
an error (one line, exit status 1) leaves no file behind.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence, Union

import numpy as np

from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
from megatron_r3.dataplane.formats.output_files import atomic_output
from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.layers.moe_layers import model_moe_layers, parse_moe_layer_freq


def write_synthetic_dump(
    path: str,
    *,
    num_samples: int,
    num_layers: int,
    moe_layer_freq: Union[int, Sequence[int]],
    num_experts: int,
    topk: int,
    vocab_size: int,
    min_len: int = 9,
    max_len: int = 40,
    routed_fraction: float = 1.0,
    seed: int = 0,
    overwrite: bool = False,
) -> str:
    """Writes the dump and returns ``path``; lengths are uniform in ``[min_len, max_len]``.

    ``path`` is written through :func:`megatron_r3.dataplane.formats.output_files.atomic_output`: an
    existing file is refused unless ``overwrite``.
    """
    if not 2 <= min_len <= max_len:
        raise ValueError(f"--min-len {min_len} and --max-len {max_len} must satisfy 2 <= min <= max "
                         f"(a sample needs a token to train on)")
    if num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
    if vocab_size < 1:
        raise ValueError(f"--vocab-size must be >= 1, got {vocab_size}")
    if not 0 <= routed_fraction <= 1:
        raise ValueError(f"--routed-fraction must lie in [0, 1], got {routed_fraction}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"--moe-router-topk {topk} must lie in [1, --num-experts {num_experts}]")
    rng = np.random.default_rng(seed)
    layers = model_moe_layers(num_layers, moe_layer_freq)
    with atomic_output(path, overwrite=overwrite) as partial, RolloutDumpWriter(
            partial, num_experts=num_experts, topk=topk, layer_numbers=layers) as writer:
        for _ in range(num_samples):
            n = int(rng.integers(min_len, max_len + 1))
            ids = np.argsort(rng.random((n, len(layers), num_experts), dtype=np.float32), axis=2)[:, :, :topk]
            valid = rng.random(n) < routed_fraction
            valid[-1] = False
            routes = RolloutRoutes.from_ids(ids, num_experts=num_experts, layer_numbers=layers, valid=valid)
            writer.write(RolloutSample(
                token_ids=rng.integers(0, vocab_size, n),
                loss_mask=np.arange(n) >= n // 3,
                logprobs=-rng.random(n).astype(np.float32),
                routes=routes,
                meta={"reward": float(rng.random())},
            ))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the rollout dump to write (see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--moe-layer-freq", default="1", help="an int, or one 0/1 per layer, comma-separated")
    parser.add_argument("--num-experts", type=int, required=True)
    parser.add_argument("--moe-router-topk", type=int, required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--min-len", type=int, default=9)
    parser.add_argument("--max-len", type=int, default=40)
    parser.add_argument("--routed-fraction", type=float, default=1.0, help="tokens that get a route")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        write_synthetic_dump(
            args.out, num_samples=args.num_samples, num_layers=args.num_layers,
            moe_layer_freq=parse_moe_layer_freq(args.moe_layer_freq),
            num_experts=args.num_experts, topk=args.moe_router_topk, vocab_size=args.vocab_size,
            min_len=args.min_len, max_len=args.max_len, routed_fraction=args.routed_fraction, seed=args.seed,
            overwrite=args.overwrite,
        )
    except (ValueError, OSError) as error:  # bad flags, an --out that exists, a folder that cannot be written
        print(f"synthetic_rollout_dump: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.num_samples} samples to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
