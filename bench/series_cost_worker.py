"""One side of bench/series_cost.py: times Megatron's MoELayer forward + backward on one GPU.

Run as a script by ``bench/series_cost.py`` with a bundle side's root first on ``sys.path``
(``tools/upstream_tests.py``'s ``side_environment``), so ``megatron.core`` is that side's tree.
It imports nothing from this project and uses only APIs both megatron-core trees have (0.19.2
and Megatron-LM main, pristine and patched): what a user who never enables replay runs.

    python bench/series_cost_worker.py '<json settings>'

Prints progress lines and, last, one line ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

RESULT_PREFIX = "RESULT "


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _where():
    """What megatron.core this process imports: path and version (no CUDA needed)."""
    import megatron.core
    from megatron.core import package_info

    return {"megatron_core": os.path.dirname(megatron.core.__file__), "version": package_info.__version__}


def _te_version():
    try:
        import transformer_engine
    except ImportError:
        return None
    return getattr(transformer_engine, "__version__", "unknown")


def build_layer(settings):
    """Megatron's MoELayer from the tree's own layer spec: alltoall, dropless, bf16, EP 1, TP 1."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_submodules,
        get_gpt_layer_with_transformer_engine_submodules,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = settings["spec"]
    if spec == "auto":
        spec = "te" if _te_version() else "local"
    hidden = settings["hidden"]
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 128),
        num_moe_experts=settings["experts"],
        moe_router_topk=settings["topk"],
        moe_ffn_hidden_size=settings["moe_ffn_hidden"],
        ffn_hidden_size=settings["moe_ffn_hidden"],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_grouped_gemm=settings["grouped_gemm"],
        moe_router_fusion=settings["router_fusion"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    make = (get_gpt_layer_with_transformer_engine_submodules if spec == "te"
            else get_gpt_layer_local_submodules)
    submodules = get_submodules(make(num_experts=settings["experts"],
                                     moe_grouped_gemm=settings["grouped_gemm"]).mlp)
    model_parallel_cuda_manual_seed(settings["seed"])
    layer = MoELayer(config, submodules).cuda()
    return layer, spec


def run(settings):
    import torch
    from megatron.core import parallel_state

    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                         world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(settings["seed"])
    layer, spec = build_layer(settings)
    gen = torch.Generator(device="cuda").manual_seed(settings["seed"])
    shape = (settings["tokens"], 1, settings["hidden"])
    x = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    grad = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    def step():
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    device_ms, host_ms = [], []
    for i in range(settings["warmup"] + settings["iters"]):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        issued = time.perf_counter() - t0  # the host returns here; the GPU may still be working
        end.synchronize()
        if i >= settings["warmup"]:
            device_ms.append(start.elapsed_time(end))
            host_ms.append(issued * 1e3)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    te = _te_version()
    return {**_where(), "spec": spec, "experts_class": type(layer.experts).__name__,
            "torch": torch.__version__, "transformer_engine": te,
            "device": torch.cuda.get_device_name(), "device_ms": device_ms, "host_ms": host_ms}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    settings = json.loads(argv[0])
    result = _where() if settings.get("probe") else run(settings)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
