"""A small 2-rank gloo harness for the routing-replay tests (EP and pipeline schedules).

The parent computes a single-rank reference (weights, per-token losses, gradients) with the
same forced routes; each rank builds its share of the model, loads the reference weights by
global layer number (and global expert index), runs Megatron's schedule with a forward step
that passes each microbatch's MoERouting, and checks routes, losses and gradients.
"""

import re
import socket
import traceback
from contextlib import ExitStack

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_r3.routing_replay import moe_routing_for_chunk
from tests.support.cpu_rng import install_cpu_rng
from tests.support.replay import VOCAB, capture_routes, make_config, routes_as_map


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(fn, world_size, *args):
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; re-raise the first failure."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def _entry(rank, fn, world_size, port, args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def loss_func(output_tensor):
    """Mean per-token loss; the per-token losses ride along for the checks."""
    return output_tensor.float().mean(), {"per_token": output_tensor.detach().clone()}


def reference_run(config_kwargs, microbatches, forward_only=False, seed=7):
    """Single-rank reference: weights, per-token losses and grads over the microbatches.

    Gradients follow the schedules' convention: each microbatch's mean loss / count.
    """
    from tests.support.replay import make_model
    from megatron.core.transformer.moe.moe_routing import MoERouting

    model = make_model(make_config(**config_kwargs), seed=seed)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    per_token = []
    for mb in microbatches:
        routing = MoERouting(mb["layer_numbers"], expert_ids=mb["expert_ids"])
        out = model(
            mb["tokens"], mb["position_ids"], None, labels=mb["labels"], moe_routing=routing
        )
        per_token.append(out.detach().clone())
        if not forward_only:
            (out.float().mean() / len(microbatches)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"state": state, "per_token": per_token, "grads": grads}


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def global_name(chunk, name, num_local_experts, ep_rank):
    """Map a chunk-local parameter name to the single-rank model's name."""
    match = _LAYER.match(name)
    if match:
        layer = chunk.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
    match = _EXPERT.search(name)
    if match:
        expert = ep_rank * num_local_experts + int(match.group(1))
        name = name[: match.start()] + f".local_experts.{expert}." + name[match.end():]
    return name


def build_chunks(config):
    """This rank's model chunks (one per virtual stage)."""
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        chunks.append(
            GPTModel(
                config,
                get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=stage),
                vocab_size=VOCAB,
                max_sequence_length=64,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=vp is None, vp_stage=stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=vp is None, vp_stage=stage
                ),
                vp_stage=stage,
            )
        )
    return chunks


def run_layout(rank, case, ref_path):
    """One rank of a layout: schedule the microbatches with replay and check everything."""
    ref = torch.load(ref_path, weights_only=False)
    pp, vp, ep = case.get("pp", 1), case.get("vp"), case.get("ep", 1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
    )
    install_cpu_rng()
    config = make_config(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32 if pp > 1 else None,
        # gloo matches a pair's messages by posting order: batched isend/irecv between the
        # two ranks of a PP2 ring can cross; the unbatched path orders them even/odd.
        batch_p2p_comm=False,
        expert_model_parallel_size=ep,
        **case["config"],
    )
    chunks = build_chunks(config)
    num_local_experts = config.num_moe_experts // ep
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for chunk in chunks:
        names = {
            n: global_name(chunk, n, num_local_experts, ep_rank) for n in chunk.state_dict()
        }
        chunk.load_state_dict({n: ref["state"][g] for n, g in names.items()})

    # With EP the two ranks are data parallel: each takes its own microbatches.
    microbatches = ref["microbatches"][rank] if ep > 1 else ref["microbatches"]
    recordings = []

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        routing = moe_routing_for_chunk(model, mb["expert_ids"], mb["layer_numbers"])
        recordings.append((mb["index"], routing))
        first = model.pre_process
        output = model(
            mb["tokens"] if first else None,
            mb["position_ids"] if first else None,
            None,
            labels=mb["labels"] if model.post_process else None,
            moe_routing=routing,
        )
        return output, loss_func

    def iterators():
        items = [dict(mb, index=i) for i, mb in enumerate(microbatches)]
        if vp:
            return [iter(items) for _ in chunks]
        return iter(items)

    forward_backward = get_forward_backward_func()
    with ExitStack() as stack:
        per_chunk = [stack.enter_context(capture_routes(chunk)) for chunk in chunks]
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators(),
            model=chunks if vp else chunks[0],
            num_microbatches=len(microbatches),
            seq_length=microbatches[0]["tokens"].shape[1],
            micro_batch_size=microbatches[0]["tokens"].shape[0],
            forward_only=case.get("forward_only", False),
        )

    seen = {n: maps for chunk_seen in per_chunk for n, maps in chunk_seen.items()}
    check_routes(seen, recordings, microbatches, case)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        want = ref["per_token"][rank] if ep > 1 else ref["per_token"]
        assert len(losses) == len(want)
        for got, expected in zip(losses, want):
            torch.testing.assert_close(got["per_token"], expected, rtol=1e-5, atol=1e-6)
    if not case.get("forward_only", False):
        check_grads(chunks, ref, rank, ep, num_local_experts, ep_rank)


def check_routes(seen, recordings, microbatches, case):
    """Every MoE layer on this rank took exactly the forced routes, microbatch by microbatch."""
    layers = sorted({n for _, routing in recordings for n in routing.layer_numbers})
    assert layers == sorted(seen), (layers, sorted(seen))
    recomputed = case["config"].get("recompute_granularity") is not None
    for layer_number in layers:
        # Microbatches in the order this layer's chunk ran their forwards.
        order = [i for i, r in recordings if layer_number in r.layer_numbers]
        forced = {}
        for index in order:
            mb = microbatches[index]
            row = list(mb["layer_numbers"]).index(layer_number)
            ids = mb["expert_ids"][row]
            routed = (ids >= 0).all(dim=-1)  # rows of -1 are left to the live router
            forced[index] = (routes_as_map(ids.clamp(min=0))[routed], routed)
        # Each router call (forward, and recompute in backward) is one microbatch's routes.
        calls = []
        for routing_map in seen[layer_number]:
            match = [i for i in order if torch.equal(routing_map[forced[i][1]], forced[i][0])]
            assert match, f"layer {layer_number}: a router call took routes nobody forced"
            calls.append(match[0])
        want_calls = 2 if recomputed and not case.get("forward_only") else 1
        assert sorted(calls) == sorted(order * want_calls), (layer_number, calls, order)
        firsts = [i for n, i in enumerate(calls) if i not in calls[:n]]
        assert firsts == order, (layer_number, firsts, order)
    if case.get("check_recording", True):
        for index, routing in recordings:
            mb = microbatches[index]
            rows = [list(mb["layer_numbers"]).index(n) for n in routing.layer_numbers]
            recorded, ids = routing.recorded_expert_ids(), mb["expert_ids"][rows]
            routed = (ids >= 0).all(dim=-1)
            assert torch.equal(recorded[routed], ids[routed])
            assert bool((recorded >= 0).all()), "a -1 row was recorded without a live route"



def check_grads(chunks, ref, rank, ep, num_local_experts, ep_rank):
    """Grads equal the reference; with EP, expert grads sum both ranks' microbatches."""
    wrong = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            gname = global_name(chunk, name, num_local_experts, ep_rank)
            if ep > 1:
                if ".local_experts." in name:
                    want = ref["grads"][0][gname] + ref["grads"][1][gname]
                else:
                    want = ref["grads"][rank][gname]
            else:
                want = ref["grads"][gname]
            assert param.grad is not None, name
            if not torch.allclose(param.grad, want, rtol=1e-4, atol=1e-6):
                err = (param.grad - want).abs().max().item()
                wrong.append(f"{gname} (max abs diff {err:.3g})")
    assert not wrong, f"rank {rank}: gradients differ from the single-rank run: {wrong}"
