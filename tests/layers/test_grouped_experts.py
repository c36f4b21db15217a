"""megatron_r3.layers.grouped_experts: SequentialMLP's experts run as grouped GEMMs.

The grouped forward must give what ``SequentialMLP.forward`` gives on the same module
(outputs and every gradient), for any split of the tokens over the experts (empty
experts included), gated or not, fp32 or bf16, and a whole model built with
``--moe-grouped-gemm`` must train like the same model without it, under expert
parallelism too. What it does not cover (fp32 on a GPU included) runs ``SequentialMLP.forward``.
"""

import contextlib
import dataclasses
import importlib.abc
import importlib.util
import sys
import types

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_r3.layers import grouped_experts
from megatron_r3.layers.grouped_experts import GroupedGemmExperts, grouped_mm_runs
from megatron_r3.rl.profiling.host_syncs import counted_host_syncs
from tests.support.batches import layout_microbatches, make_sequences
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt

MODEL = TinyMoE(hidden_size=32, moe_ffn_hidden_size=32, num_experts=4)


@contextlib.contextmanager
def _counting_grouped_matmul(calls: list):
    """Counts the grouped experts' grouped GEMMs (``torch.nn.functional.grouped_mm``) in the block."""
    original = grouped_experts.grouped_matmul

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    grouped_experts.grouped_matmul = counting
    try:
        yield
    finally:
        grouped_experts.grouped_matmul = original


@contextlib.contextmanager
def _counting_scaled_swiglu(calls: list):
    """Counts the grouped experts' fused activations (TE's scaled SwiGLU) in the block."""
    original = grouped_experts.ScaledSwiGLU

    class Counting(original):
        @staticmethod
        def forward(ctx, x, probs):
            calls.append(1)
            return original.forward(ctx, x, probs)

    grouped_experts.ScaledSwiGLU = Counting
    try:
        yield
    finally:
        grouped_experts.ScaledSwiGLU = original


def _experts(chunk):
    return [m for m in chunk.modules() if isinstance(m, SequentialMLP)]


def _module_worker(flags, fields, dtype, splits):
    """The first MoE layer's experts, through the grouped and the sequential forward."""
    device = init_parallel(Layout())
    try:
        _, (chunk,) = build_gpt(Layout(), MODEL, seed=1, device=device, flags=flags, **fields)
        experts = _experts(chunk)[0]
        assert isinstance(experts, GroupedGemmExperts)
        gen = torch.Generator().manual_seed(7)
        # A forward-only pass asks first (the built-in rollout engine's under no_grad, Megatron's inference
        # engine's under inference_mode): it still runs grouped, and so do the training passes after it.
        hidden = torch.randn(8, MODEL.hidden_size, generator=gen).to(device, dtype)
        for forward_only in (torch.no_grad, torch.inference_mode):
            grouped_mm_runs.cache_clear()
            with forward_only():
                assert grouped_mm_runs(device.type, dtype)
                calls = []
                with _counting_grouped_matmul(calls):
                    experts(hidden, torch.tensor([2, 2, 0, 4]), torch.ones(8, device=device))
                assert len(calls) == 2
        results = []
        for split in splits:
            hidden = torch.randn(sum(split), MODEL.hidden_size, generator=gen).to(device, dtype).requires_grad_()
            probs = torch.rand(sum(split), generator=gen).to(device).requires_grad_()
            grad_out = torch.randn(sum(split), MODEL.hidden_size, generator=gen).to(device, dtype)
            outs = {"fused_swiglu": {}}
            for name, forward in (("grouped", GroupedGemmExperts.forward), ("sequential", SequentialMLP.forward)):
                for p in experts.parameters():
                    p.grad = None
                calls, fused = [], []
                with _counting_grouped_matmul(calls), _counting_scaled_swiglu(fused):
                    out, bias = forward(experts, hidden, torch.tensor(split), probs)
                assert bias is None
                grads = torch.autograd.grad(out, [hidden, probs, *experts.parameters()], grad_out)
                outs[name] = (out.detach().cpu(), [g.detach().cpu() for g in grads], len(calls))
                outs["fused_swiglu"][name] = len(fused)
            if dtype != torch.float32:  # the same module and inputs in fp32, sequentially: what both round
                experts.float()
                for p in experts.parameters():
                    p.grad = None
                args = hidden.detach().float().requires_grad_(), probs.detach().clone().requires_grad_()
                out, _ = SequentialMLP.forward(experts, args[0], torch.tensor(split), args[1])
                grads = torch.autograd.grad(out, [*args, *experts.parameters()], grad_out.float())
                outs["reference"] = (out.detach().cpu(), [g.detach().cpu() for g in grads])
                experts.to(dtype)
            results.append(outs)
        return results
    finally:
        parallel_state.destroy_model_parallel()


SPLITS = [[3, 0, 5, 2], [0, 0, 0, 9], [4, 4, 4, 4], [1, 7, 0, 0]]


def _relative_error(got, reference):
    return ((got.float() - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def _assert_as_accurate_as_the_sequential_forward(outs):
    """bf16: the grouped forward's output and gradients are as close to the fp32 reference as the sequential
    forward's, within one bf16 rounding (2^-8): the two sum in different orders, and a fused activation rounds
    fewer times than an unfused one, so neither is the other's reference."""
    (out, grads, _), (want, want_grads, _), (ref, ref_grads) = outs["grouped"], outs["sequential"], outs["reference"]
    for i, (got, seq, reference) in enumerate(zip([out, *grads], [want, *want_grads], [ref, *ref_grads])):
        error, seq_error = _relative_error(got, reference), _relative_error(seq, reference)
        assert error <= 2 * seq_error + 2 ** -8, (i, error, seq_error)


@pytest.mark.parametrize("flags, fields, dtype", [
    ([], {}, torch.float32),
    (["--swiglu"], {}, torch.float32),
    (["--bf16"], {}, torch.bfloat16),
    (["--bf16", "--swiglu"], {}, torch.bfloat16),
], ids=["gelu-fp32", "swiglu-fp32", "gelu-bf16", "swiglu-bf16"])
def test_grouped_forward_equals_the_sequential_one(flags, fields, dtype):
    (results,) = run_workers(_module_worker, 1, ["--moe-grouped-gemm", *flags], fields, dtype, SPLITS)
    for outs in results:
        (out, grads, grouped_calls), (want, want_grads, sequential_calls) = outs["grouped"], outs["sequential"]
        assert (grouped_calls, sequential_calls) == (2, 0)
        if dtype == torch.float32:
            torch.testing.assert_close(out, want)
            for got, expected in zip(grads, want_grads):
                torch.testing.assert_close(got, expected)
        else:
            _assert_as_accurate_as_the_sequential_forward(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [[], ["--swiglu"]], ids=["gelu", "swiglu"])
def test_grouped_forward_on_a_gpu_matches_the_sequential_one(flags):
    """Host token counts (pinned, copied asynchronously) and CUDA grouped GEMMs in bf16: as accurate as the
    sequential forward, outputs and every gradient (the probabilities' too); SwiGLU and the probabilities as TE's
    scaled SwiGLU kernels, once per grouped forward, where TE is installed (`make install` installs it on CUDA
    machines)."""
    (results,) = run_workers(_module_worker, 1, ["--moe-grouped-gemm", "--bf16", *flags], {}, torch.bfloat16, SPLITS,
                             backend="nccl")
    fused = 1 if flags and importlib.util.find_spec("transformer_engine_torch") else 0
    for outs in results:
        assert outs["grouped"][2] == 2
        assert (outs["fused_swiglu"]["grouped"], outs["fused_swiglu"]["sequential"]) == (fused, 0)
        _assert_as_accurate_as_the_sequential_forward(outs)


def _fp32_worker():
    """Whether the fp32 experts take device counts, and their grouped GEMMs in one forward."""
    device = init_parallel(Layout())
    try:
        _, (chunk,) = build_gpt(Layout(), MODEL, seed=1, device=device, flags=["--moe-grouped-gemm"])
        experts = _experts(chunk)[0]
        hidden = torch.randn(8, MODEL.hidden_size, device=device)
        calls = []
        with torch.no_grad(), _counting_grouped_matmul(calls):
            experts(hidden, torch.tensor([2, 2, 0, 4]), torch.ones(8, device=device))
        return experts.takes_device_tokens_per_expert, len(calls)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("backend, want", [("gloo", (True, 2)), pytest.param("nccl", (False, 0), marks=pytest.mark.gpu)],
                         ids=["cpu", "gpu"])
def test_fp32_experts_run_grouped_on_the_cpu_and_sequential_on_a_gpu(backend, want):
    """torch's fp32 grouped GEMM on CUDA reads its offsets back to the host (a sync per GEMM), which
    ``SequentialMLP`` with host counts does not; on the CPU the offsets are on the host already."""
    assert run_workers(_fp32_worker, 1, backend=backend) == [want]


def _training_worker(layout, grouped):
    """Logits and every gradient of one forward-backward over two microbatches, routing live."""
    device = init_parallel(layout)
    try:
        flags = ["--moe-grouped-gemm" if grouped else "--no-moe-grouped-gemm"]
        _, (chunk,) = build_gpt(layout, MODEL, seed=3, device=device, flags=flags)
        assert all(isinstance(e, GroupedGemmExperts) == grouped for e in _experts(chunk))
        calls = []
        with _counting_grouped_matmul(calls):
            losses = []
            for mb in layout_microbatches(layout, make_sequences([9, 16, 5, 12], MODEL.vocab_size, seed=4), 2, device):
                loss = chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None, labels=mb.labels,
                             packed_seq_params=mb.packed_seq_params)
                loss.float().sum().backward()
                losses.append(loss.detach())
        grads = {name: p.grad.detach().clone() for name, p in chunk.named_parameters() if p.grad is not None}
        return losses, grads, len(calls)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("layout", [Layout(packed=True), Layout(ep=2, dp=2, packed=True),
                                    Layout(tp=2, sp=True, packed=True)],
                         ids=lambda layout: layout.name)
def test_a_model_with_grouped_experts_trains_like_one_without(layout):
    grouped = run_workers(_training_worker, layout.world_size, layout, True)
    sequential = run_workers(_training_worker, layout.world_size, layout, False)
    for (losses, grads, calls), (want_losses, want_grads, _) in zip(grouped, sequential):
        # Two grouped GEMMs per MoE layer and microbatch, forward; none where the experts are
        # tensor-parallel (their linear layers all-reduce: SequentialMLP's forward runs).
        assert calls == (0 if layout.tp > 1 else 2 * len(MODEL.moe_layers) * len(losses))
        for got, want in zip(losses, want_losses):
            torch.testing.assert_close(got, want)
        assert grads.keys() == want_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], msg=name)


def _state_dict_worker():
    init_parallel(Layout())
    try:
        _, (grouped,) = build_gpt(Layout(), MODEL, seed=5, flags=["--moe-grouped-gemm"])
        _, (sequential,) = build_gpt(Layout(), MODEL, seed=6)
        sequential.load_state_dict(grouped.state_dict())
        return (list(grouped.state_dict()), list(sequential.state_dict()),
                sorted(grouped.sharded_state_dict()), sorted(sequential.sharded_state_dict()),
                all(torch.equal(a, b) for a, b in zip(grouped.parameters(), sequential.parameters())))
    finally:
        parallel_state.destroy_model_parallel()


def test_grouped_experts_keep_sequential_mlps_parameters_and_checkpoint_keys():
    ((keys, want_keys, sharded, want_sharded, loaded),) = run_workers(_state_dict_worker, 1)
    assert keys == want_keys and sharded == want_sharded and loaded


def _sync_worker(grouped, forward_only, bf16):
    """The host's waits for the device (sync-debug syncs and explicit waits) in a live pass, after a first one."""
    layout = Layout(packed=True)
    device = init_parallel(layout)
    try:
        flags = [*(["--bf16"] if bf16 else []), "--moe-grouped-gemm" if grouped else "--no-moe-grouped-gemm"]
        _, (chunk,) = build_gpt(layout, MODEL, seed=3, device=device, flags=flags)
        microbatches = layout_microbatches(layout, make_sequences([9, 16, 5, 12], MODEL.vocab_size, seed=4), 2, device)

        def step(mb):  # logits, not Megatron's loss: its cross-entropy masks targets by boolean indexing (a sync)
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                logits = chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None,
                               packed_seq_params=mb.packed_seq_params)
                if not forward_only:
                    logits.float().square().sum().backward()

        step(microbatches[0])
        torch.cuda.synchronize()
        counts = {}
        with counted_host_syncs(counts):
            step(microbatches[1])
        return counts
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@pytest.mark.parametrize("forward_only", [True, False], ids=["forward", "forward-backward"])
def test_live_routing_through_grouped_experts_does_not_sync_the_device(forward_only):
    """One rank holds every expert: the dispatcher leaves the counts on the device (the series' dispatcher
    patch), and the bf16 grouped GEMMs read them there."""
    assert run_workers(_sync_worker, 1, True, forward_only, True, backend="nccl") == [{"sync_debug": 0, "waits": 0}]
    # Negative controls: SequentialMLP splits on host counts, and so do fp32 experts on a GPU; the dispatcher
    # or the experts read them back (tolist), once per MoE layer.
    for grouped, bf16 in ((False, True), (True, False)):
        (counts,) = run_workers(_sync_worker, 1, grouped, forward_only, bf16, backend="nccl")
        assert counts["waits"] + counts["sync_debug"] >= len(MODEL.moe_layers), (grouped, bf16)


def _dispatch_worker(layout, flags, bias):
    init_parallel(layout)
    try:
        _, (chunk,) = build_gpt(layout, dataclasses.replace(MODEL, add_bias_linear=bias), flags=flags)
        return [m.token_dispatcher.counts_stay_on_device for m in chunk.modules() if hasattr(m, "token_dispatcher")]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("layout, flags, bias, on_device", [
    (Layout(), ["--moe-grouped-gemm"], False, True),
    # Experts that need host counts read them back themselves (SequentialMLP: tokens_per_expert.tolist()).
    (Layout(), ["--no-moe-grouped-gemm"], False, True),
    (Layout(), ["--moe-grouped-gemm"], True, True),  # biases run SequentialMLP.forward
    (Layout(ep=2, dp=2), ["--moe-grouped-gemm"], False, False),  # the all-to-all needs host split sizes
], ids=["grouped", "sequential", "bias", "ep2"])
def test_the_dispatcher_leaves_counts_on_the_device_on_one_expert_rank(layout, flags, bias, on_device):
    for per_layer in run_workers(_dispatch_worker, layout.world_size, layout, flags, bias):
        assert per_layer == [on_device] * len(MODEL.moe_layers)


class _ReferenceScaledSwiGLU:
    """TE's scaled SwiGLU kernels' contract in torch (fp32 math, one rounding at the store), for the CPU."""

    calls = []

    @classmethod
    def scaled_swiglu(cls, x, scales, quantizer, interleave):
        cls.calls.append(("forward", x.dtype, scales.dtype))
        gate, linear = x.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * linear * scales.float()[:, None]).to(x.dtype)

    @classmethod
    def scaled_dswiglu(cls, grad, x, scales, quantizer, interleave, compute_scale_grad):
        cls.calls.append(("backward", x.dtype, scales.dtype))
        gate, linear = x.float().chunk(2, dim=-1)
        g, s = grad.float(), scales.float()[:, None]
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_x = torch.cat([g * s * linear * sig * (1 + gate * (1 - sig)), g * s * silu], dim=-1).to(x.dtype)
        grad_scales = (g * silu * linear).sum(-1).to(scales.dtype) if compute_scale_grad else None
        return grad_x, grad_scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_swiglu_gives_the_activations_value_and_gradients(monkeypatch, dtype):
    """ScaledSwiGLU hands TE's kernels the probabilities in the activations' dtype, as TE's own operation does,
    and returns the gradients of the activations and of the probabilities in their own dtypes: through it,
    output and both gradients equal SwiGLU times the probability under autograd (a kernel's contract played by
    torch here; the GPU test runs TE's)."""
    monkeypatch.setattr(grouped_experts, "te_scaled_swiglu", lambda device_type, dtype: _ReferenceScaledSwiGLU)
    _ReferenceScaledSwiGLU.calls = []
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 2 * 6, generator=gen).to(dtype).requires_grad_()  # an odd row count
    probs = torch.rand(11, generator=gen).requires_grad_()
    grad_out = torch.randn(11, 6, generator=gen).to(dtype)
    out = grouped_experts.ScaledSwiGLU.apply(x, probs)
    grads = torch.autograd.grad(out, [x, probs], grad_out)
    assert _ReferenceScaledSwiGLU.calls == [("forward", dtype, dtype), ("backward", dtype, dtype)]
    assert (out.dtype, grads[0].dtype, grads[1].dtype) == (dtype, dtype, torch.float32)

    x64, p64 = x.detach().double().requires_grad_(), probs.detach().to(dtype).double().requires_grad_()
    gate, linear = x64.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * linear * p64[:, None]
    want_grads = torch.autograd.grad(want, [x64, p64], grad_out.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.double(), want, **tol)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, **tol)


class _SwappedHalves(_ReferenceScaledSwiGLU):
    """A kernel that gates the second half: right on inputs whose halves are equal, wrong otherwise."""

    @classmethod
    def scaled_swiglu(cls, x, scales, quantizer, interleave):
        return super().scaled_swiglu(torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1), scales, quantizer, interleave)


class _NoScaleGradient(_ReferenceScaledSwiGLU):
    @classmethod
    def scaled_dswiglu(cls, grad, x, scales, quantizer, interleave, compute_scale_grad):
        grad_x, grad_scales = super().scaled_dswiglu(grad, x, scales, quantizer, interleave, compute_scale_grad)
        return grad_x, torch.zeros_like(grad_scales)


class _Raises(_ReferenceScaledSwiGLU):
    @classmethod
    def scaled_swiglu(cls, x, scales, quantizer, interleave):
        raise RuntimeError("no kernel image is available for execution on the device")


class _StandInTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """TE's packages on the CPU: ``transformer_engine_torch`` (the extension, with ``kernels``) imports only once
    ``transformer_engine.pytorch`` has, as TE's extension loads only after TE's package loaded its core library;
    ``core_loads=False``: that library does not load (OSError, as ctypes raises)."""

    NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch")

    def __init__(self, kernels, core_loads=True):
        self.kernels, self.core_loads = kernels, core_loads

    def find_spec(self, name, path=None, target=None):
        if name in self.NAMES:
            return importlib.util.spec_from_loader(name, self, is_package=name == "transformer_engine")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "transformer_engine.pytorch" and not self.core_loads:
            raise OSError("libtransformer_engine.so: undefined symbol")
        if module.__name__ == "transformer_engine_torch":
            if "transformer_engine.pytorch" not in sys.modules:
                raise ImportError("libtransformer_engine.so: cannot open shared object file")
            module.scaled_swiglu, module.scaled_dswiglu = self.kernels.scaled_swiglu, self.kernels.scaled_dswiglu


@pytest.fixture
def stand_in_te(monkeypatch):
    """Installs ``_StandInTE(kernels)`` (None: TE not installed) for a test; TE's real modules come back after it."""
    saved = {name: sys.modules.pop(name) for name in _StandInTE.NAMES if name in sys.modules}

    def install(kernels, core_loads=True):
        if kernels is None:
            for name in _StandInTE.NAMES:
                sys.modules[name] = None  # its import raises ImportError
        else:
            monkeypatch.setattr(sys, "meta_path", [_StandInTE(kernels, core_loads), *sys.meta_path])

    grouped_experts.te_scaled_swiglu.cache_clear()
    try:
        yield install
    finally:
        grouped_experts.te_scaled_swiglu.cache_clear()
        for name in _StandInTE.NAMES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


@pytest.mark.parametrize("kernels, used", [(_ReferenceScaledSwiGLU, True), (_SwappedHalves, False),
                                           (_NoScaleGradient, False), (_Raises, False), (None, False)],
                         ids=["right", "swapped-halves", "no-scale-gradient", "raises", "not-installed"])
def test_te_scaled_swiglu_is_used_only_where_it_gives_swiglu_times_the_scale(stand_in_te, kernels, used):
    """The probe loads TE's extension as TE does (its package first: a model of local layers has not imported TE,
    and the extension alone does not load), runs its kernels once on random inputs, forward and backward,
    against autograd: kernels that do not run, or compute something else, leave the grouped experts on the
    unfused activation (played here on the CPU by stand-ins for TE; under no_grad, as a rollout engine's first
    pass asks)."""
    stand_in_te(kernels)
    with torch.no_grad():
        assert (grouped_experts.te_scaled_swiglu("cpu", torch.bfloat16) is not None) == used


def test_a_te_whose_library_does_not_load_leaves_the_activation_unfused(stand_in_te):
    """A TE installation whose core library does not load is one without the fused activation, not an error in a
    model that did not ask for TE's layers."""
    stand_in_te(_ReferenceScaledSwiGLU, core_loads=False)
    assert grouped_experts.te_scaled_swiglu("cpu", torch.bfloat16) is None
