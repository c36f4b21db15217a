"""Train a Megatron GPT MoE on a rollout dump, with rollout routing replay (R3).

    torchrun --nproc-per-node 8 launch/pretrain_gpt_r3.py --rollout-dump rollouts.r3dump \\
        --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 \\
        --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 512 --moe-layer-freq 0,1,1,1,1,1,1,1 \\
        --vocab-size 32768 --seq-length 8192 --micro-batch-size 4 --global-batch-size 64 \\
        --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 \\
        --train-iters 100 --lr 1e-5 --bf16 --moe-enable-routing-replay

Each iteration reads ``--global-batch-size`` samples from the dump
(``megatron_r3.rollout_dump``, read again from the start when it runs out), and
data-parallel rank ``d`` trains on its share in microbatches of
``--micro-batch-size`` samples packed into one ``--seq-length`` row (THD). With
``--moe-enable-routing-replay`` every MoE router uses the experts the rollout
engine chose for each token (tokens without a route are routed live); the routes
travel through ``RouteUploader`` (pinned buffer, asynchronous copy, packing
kernel) to the ``MoERouting`` input of every model chunk on every pipeline stage.

The loss is the next-token cross-entropy on the dump's loss mask, averaged over
the iteration's trained tokens; the optimizer is AdamW. Every ``--log-interval``
iterations the last rank prints the loss and how far the trainer's log-probs are
from the rollout engine's (mean |logp_train - logp_rollout|, the k3 KL estimate,
and the fraction of tokens whose ratio lies outside [1/2, 2]): replay is what
brings these down.

Layers come from ``megatron_r3.layer_specs`` (no TransformerEngine needed). The
model is freshly initialised from ``--seed``; loading checkpoints is not supported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.grads import reduce_grads
from megatron_r3.layer_specs import get_gpt_decoder_block_r3_spec
from megatron_r3.moe_layers import PipelineSplit, moe_layer_numbers, parse_moe_layer_freq
from megatron_r3.plan import RankLayout, chunk_plans
from megatron_r3.rollout_batch import (
    RolloutMicrobatch,
    logprob_mismatch_metrics,
    logprob_mismatch_sums,
    pack_rollout_microbatch,
)
from megatron_r3.rollout_dump import RolloutSample, check_dump_fits
from megatron_r3.rollout_shards import DataParallelDumpShard
from megatron_r3.routes import RolloutRoutes
from megatron_r3.routing_replay import add_routing_replay_args, moe_routing_for_chunk, routing_replay_config_kwargs
from megatron_r3.transport import PackedRoutes, RouteUploader


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Megatron-style flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="pretrain_gpt_r3.py")
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--ffn-hidden-size", type=int, required=True)
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention groups")
    model.add_argument("--num-experts", type=int, required=True)
    model.add_argument("--moe-router-topk", type=int, required=True)
    model.add_argument("--moe-ffn-hidden-size", type=int, required=True)
    model.add_argument("--moe-layer-freq", default="1",
                       help="every Nth layer is MoE (an int), or one 0/1 per layer, comma-separated")
    model.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    model.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall")
    model.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="RMSNorm")
    model.add_argument("--vocab-size", type=int, required=True, help="divisible by the TP size")
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    model.add_argument("--bf16", action="store_true", help="bf16 parameters and activations (default fp32)")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parallel.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--context-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1)
    parallel.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    parallel.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    parallel.add_argument("--recompute-num-layers", type=int, default=1)

    training = parser.add_argument_group("training")
    training.add_argument("--rollout-dump", required=True, help="rollout dump file (megatron_r3.rollout_dump)")
    training.add_argument("--micro-batch-size", type=int, default=1, help="samples packed per microbatch")
    training.add_argument("--global-batch-size", type=int, default=None,
                          help="samples per iteration over all data-parallel ranks (default: one microbatch each)")
    training.add_argument("--seq-length", type=int, required=True, help="length of a packed microbatch row")
    training.add_argument("--train-iters", type=int, required=True)
    training.add_argument("--lr", type=float, default=1e-5)
    training.add_argument("--weight-decay", type=float, default=0.0)
    training.add_argument("--seed", type=int, default=1234)
    training.add_argument("--log-interval", type=int, default=1)
    add_routing_replay_args(parser)
    return parser.parse_args(argv)


def layer_freq(args: argparse.Namespace):
    """``--moe-layer-freq`` as Megatron's ``moe_layer_freq`` (an int or a per-layer list)."""
    return parse_moe_layer_freq(args.moe_layer_freq)


def transformer_config(args: argparse.Namespace, device: torch.device) -> TransformerConfig:
    """The model's ``TransformerConfig`` from the flags."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    recompute = {}
    if args.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective")
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        normalization=args.normalization,
        add_bias_linear=False,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_layer_freq=layer_freq(args),
        moe_router_score_function=args.moe_router_score_function,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.num_virtual_stages_per_pipeline_rank,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # The loss is a sum over tokens; the step divides by the iteration's token count.
        calculate_per_token_loss=True,
        # gloo (CPU) pairs batched sends and receives by order and swaps them when both go to
        # the same peer (PP=2); separate isend/irecv are right on every backend.
        batch_p2p_comm=device.type == "cuda",
        **recompute,
        **routing_replay_config_kwargs(args),
    )


def init_model_parallel(args: argparse.Namespace) -> None:
    """Megatron's parallel state for the flags, on an initialised default process group."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.num_virtual_stages_per_pipeline_rank,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )


def initialize(args: argparse.Namespace) -> torch.device:
    """Process group from torchrun's environment (NCCL), parallel state and RNG."""
    if not torch.cuda.is_available():
        sys.exit("pretrain_gpt_r3.py: no CUDA device; start it with torchrun on GPU nodes")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    init_model_parallel(args)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return device


def build_model(args: argparse.Namespace, config: TransformerConfig, device: torch.device) -> list[GPTModel]:
    """This rank's model chunks, one per virtual pipeline stage."""
    if args.vocab_size % args.tensor_model_parallel_size:
        raise ValueError(f"--vocab-size {args.vocab_size} must be divisible by the TP size "
                         f"{args.tensor_model_parallel_size}")
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp) if vp else [None]:
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_decoder_block_r3_spec(config, vp_stage=vp_stage),
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings or args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        ).to(device))
    return chunks


def rank_layout(config: TransformerConfig) -> RankLayout:
    """This rank's place in the layout, as the routing plans need it."""
    return RankLayout(
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        sequence_parallel=config.sequence_parallel,
        cp_size=parallel_state.get_context_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )


def check_dump(path: str, args: argparse.Namespace) -> None:
    """Refuses, before training, a dump that does not fit the model (routes, vocab, sample lengths)."""
    check_dump_fits(path, num_experts=args.num_experts, topk=args.moe_router_topk,
                    moe_layer_numbers=_layer_numbers(args), vocab_size=args.vocab_size, seq_length=args.seq_length)


@dataclass
class _Microbatch:
    """A packed microbatch and, with replay, its routes for one model chunk."""

    batch: RolloutMicrobatch
    routes: Optional[PackedRoutes] = None


def _forward_step(data_iterator, model):
    item: _Microbatch = next(data_iterator)
    batch = item.batch
    routing = None
    if item.routes is not None:
        routing = moe_routing_for_chunk(model, item.routes.wait(), item.routes.layer_numbers, values_checked=True)
    per_token_loss = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                           packed_seq_params=batch.packed_seq_params, moe_routing=routing)
    return per_token_loss, partial(_loss_func, batch)


def _loss_func(batch: RolloutMicrobatch, per_token_loss: torch.Tensor):
    mask = batch.loss_mask
    loss = (per_token_loss.float() * mask).sum()
    sums = logprob_mismatch_sums(-per_token_loss.detach().float(), batch.rollout_logprobs, mask)
    # Tokens and mismatch sums, then the loss sum: what the schedule keeps per microbatch.
    return loss, mask.sum().to(torch.int), {"sums": torch.cat([sums, loss.detach().double().reshape(1)])}


def train(
    args: argparse.Namespace,
    config: TransformerConfig,
    chunks: list[GPTModel],
    device: torch.device,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """The training loop; returns each iteration's metrics (loss and log-prob mismatch)."""
    check_dump(args.rollout_dump, args)
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    global_batch = args.global_batch_size or args.micro_batch_size * dp_size
    if global_batch % (args.micro_batch_size * dp_size):
        raise ValueError(f"--global-batch-size {global_batch} must be a multiple of --micro-batch-size x DP "
                         f"= {args.micro_batch_size * dp_size}")
    per_rank = global_batch // dp_size
    rank = rank_layout(config)
    split = PipelineSplit.from_config(config)
    replay = config.moe_enable_routing_replay
    uploader = RouteUploader(device) if replay else None
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.95))
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    shard = DataParallelDumpShard(args.rollout_dump, dp_rank, dp_size, global_batch)
    history = []
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        samples = shard.next_batch()
        per_chunk = [[] for _ in chunks]
        for first in range(0, per_rank, args.micro_batch_size):
            group = samples[first:first + args.micro_batch_size]
            batch = pack_rollout_microbatch(group, rank, args.seq_length, device)
            routes = [None] * len(chunks)
            if replay:
                plans = chunk_plans(rank, batch.sample_lens, source_layer_numbers=_layer_numbers(args),
                                    split=split, qkv_format="thd", padded_lens=batch.padded_lens)
                routes = uploader.upload([_routes_of(s, args) for s in group], plans)
            for i, chunk_routes in enumerate(routes):
                per_chunk[i].append(_Microbatch(batch, chunk_routes))

        optimizer.zero_grad(set_to_none=True)
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=[iter(m) for m in per_chunk] if len(chunks) > 1 else iter(per_chunk[0]),
            model=chunks,
            num_microbatches=len(per_chunk[0]),
            seq_length=args.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        # Tokens, mismatch sums and loss sum: each CP/DP rank holds its own tokens on the last
        # pipeline stage (other stages add zeros), and every TP rank the same values.
        totals = torch.zeros(5, dtype=torch.float64, device=device)
        for out in outputs:
            totals += out["sums"].to(device)
        dist.all_reduce(totals)
        totals /= parallel_state.get_tensor_model_parallel_world_size()
        tokens = max(float(totals[0]), 1.0)
        reduce_grads(chunks, config)
        for chunk in chunks:
            for param in chunk.parameters():
                param.grad.div_(tokens)
        optimizer.step()

        metrics = {"iteration": iteration, "loss": float(totals[4]) / tokens, "tokens": int(totals[0]),
                   **logprob_mismatch_metrics(totals[:4]),
                   "elapsed_ms": 1e3 * (time.perf_counter() - start)}
        history.append(metrics)
        if last_rank and iteration % args.log_interval == 0:
            log(f" iteration {iteration:6d}/{args.train_iters} | loss {metrics['loss']:.6f} | tokens "
                f"{metrics['tokens']} | logp abs diff {metrics['logp_abs_diff']:.6f} | k3 KL "
                f"{metrics['k3_kl']:.6f} | ratio outside [1/2, 2] {metrics['ratio_outside_frac']:.6f} | "
                f"elapsed {metrics['elapsed_ms']:.1f} ms")
    shard.close()
    return history


def _layer_numbers(args: argparse.Namespace) -> tuple[int, ...]:
    return moe_layer_numbers(args.num_layers, layer_freq(args))


def _routes_of(sample: RolloutSample, args: argparse.Namespace) -> RolloutRoutes:
    """A sample's routes; a sample the dump has none for is routed live."""
    if sample.routes is not None:
        return sample.routes
    return RolloutRoutes.empty(len(sample.token_ids), num_experts=args.num_experts, topk=args.moe_router_topk,
                               layer_numbers=_layer_numbers(args))


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    device = initialize(args)
    config = transformer_config(args, device)
    chunks = build_model(args, config, device)
    train(args, config, chunks, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
