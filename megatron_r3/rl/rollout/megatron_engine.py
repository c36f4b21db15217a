"""Megatron's own inference engine as the loop's rollout engine (``--rollout-engine megatron``).

The loop's built-in engine (:mod:`megatron_r3.rl.rollout.engine`) has no KV cache: each
generation step runs the whole prefix again. This one generates with megatron-core's
``DynamicInferenceEngine``: a paged KV cache (``DynamicInferenceContext``), prefill of every
prompt in one step, then decode steps of one token per request. The model is the same bf16
chunk the built-in engine runs, on the policy's lagging weights
(:class:`~megatron_r3.rl.rollout.weight_lag.LaggedWeights` copies into its parameters in place).

With ``num_cuda_graphs`` its steps replay Megatron's CUDA graphs, captured on its first steps:
the model must then be built with ``cuda_graph_impl="local"`` under a graph-safe RNG tracker
(:mod:`megatron_r3.rl.rollout.engine_choice` builds it so where graphs apply).

Routes come from the engine itself: with ``moe_enable_routing_replay`` every router records
its top-k through ``RouterReplay``, the engine stores them per KV block and rebuilds a
finished request's ``routing_indices`` (``[total_tokens - 1, MoE layers, topk]``, int16 for
up to 32768 experts); :func:`~megatron_r3.dataplane.engines.adapters.from_megatron_inference` turns them
into the sample's routes, none for the final sampled token. Log-probs are the engine's
``processed_logprobs`` (of ``softmax(logits / temperature)``, what the trainer compares
with) for every generated token; prompt positions get 0, as no loss sees them.

Megatron's recording reads the process-wide ``RouterReplay.global_router_replay_instances``,
which also holds the routers of the policy and of the weight snapshots (built for
``moe_enable_routing_replay`` too), and leaves the RECORD action set on them. So the engine
runs with that list narrowed to its own routers and their action cleared afterwards, and
with Megatron's ``InferenceMode`` flag set only while it generates (the trainer's passes
run with it off).

Where it runs: CUDA (the engine allocates its sampling generator, KV cache and attention
metadata on ``torch.cuda.current_device()``), flash-attn >= 2.7.3 (or FA3/FA4: the
dynamic engine's attention, ``Attention.flash_decode_and_prefill``; with FA4 a head dim that is a
multiple of 16), and a model replica
of one GPU with one expert rank (each data-parallel rank runs its own engine).
:func:`megatron_engine_problem` says which of these is missing.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_r3.dataplane.engines.adapters import from_megatron_inference
from megatron_r3.dataplane.sample_checks import check_logprobs
from megatron_r3.dataplane.samples import RolloutSample, RoutingSpec
from megatron_r3.rl.model.factory import ModelSettings
from megatron_r3.rl.rollout.engine import RolloutEngineError, SamplingParams
from megatron_r3.rl.rollout.weight_lag import LaggedWeights

FLASH_ATTN_MIN_VERSION = "2.7.3"  # Attention.forward's assertion for dynamic batching (megatron-core 0.19.2)
FLASH_ATTN_4_MIN_VERSION = "4.0.0b20"  # the flash-attn-4 megatron-core 0.19.2 uses (attention.HAVE_FA4)
BLOCK_SIZE_TOKENS = 256  # the KV cache's block, Megatron's default
# flash-attn-4 loads a paged KV cache whose page is not its key tile (at most 144 tokens, so never
# Megatron's block) without TMA, and that path takes only head dims it need not pad to its multiple
# of 16 (flash-attn-4 4.0.0b36, flash_fwd_sm90.py and flash_fwd_sm100.py: "Paged KV does not support
# irregular head dim").
FLASH_ATTN_4_PAGED_HEAD_DIM_MULTIPLE = 16


def megatron_engine_problem(model: ModelSettings, device: torch.device) -> Optional[str]:
    """Why Megatron's dynamic inference engine cannot generate for ``model`` on ``device``, or None where it can."""
    if device.type != "cuda":
        return (f"it needs CUDA and this run computes on {device.type}: megatron.core.inference allocates its "
                f"sampling generator (TextGenerationController: torch.Generator(device=torch.cuda.current_device()))"
                f", KV cache and attention metadata on the current CUDA device")
    attention = flash_attention_problem()
    if attention is not None:
        return attention
    head_dim = model.hidden_size // model.num_attention_heads
    if flash_attention_4_runs() and head_dim % FLASH_ATTN_4_PAGED_HEAD_DIM_MULTIPLE:
        return (f"its attention runs flash-attn-4 here, whose paged KV cache takes head dims that are multiples of "
                f"{FLASH_ATTN_4_PAGED_HEAD_DIM_MULTIPLE}, and this model's is {head_dim} (--hidden-size "
                f"{model.hidden_size} / --num-attention-heads {model.num_attention_heads})")
    parallel = model.parallel
    layout = {"--tensor-model-parallel-size": parallel.tensor_model_parallel_size,
              "--pipeline-model-parallel-size": parallel.pipeline_model_parallel_size,
              "--context-parallel-size": parallel.context_parallel_size,
              "--expert-model-parallel-size": parallel.expert_model_parallel_size,
              "--num-virtual-stages-per-pipeline-rank": parallel.virtual_pipeline_model_parallel_size or 1}
    split = [f"{flag} {value}" for flag, value in layout.items() if value != 1]
    if split:
        return (f"it generates where a model replica is one GPU with one expert rank (data parallelism only); "
                f"this run has {', '.join(split)}")
    if model.hybrid_layer_pattern is not None:
        # Megatron's hybrid inference context takes the pattern's layer types (KV cache for
        # attention layers only), which this engine does not hand it.
        return (f"its inference context is set up here for a GPTModel, whose every layer has attention; this run "
                f"builds a HybridModel (--hybrid-layer-pattern {model.hybrid_layer_pattern!r})")
    return None


def flash_attention_problem() -> Optional[str]:
    """What the dynamic engine's attention lacks here (flash-attn), or None."""
    from megatron.core.transformer import attention
    from megatron.core.utils import is_fa_min_version

    if attention.HAVE_FA3 or attention.HAVE_FA4:
        return None
    try:
        if is_fa_min_version(FLASH_ATTN_MIN_VERSION):
            return None
        from megatron.core.utils import get_fa_version
        found = f"flash-attn {get_fa_version()} is installed"
    except ImportError:  # get_fa_version imports flash_attn
        found = "flash-attn is not installed"
    flash_attn_4 = unusable_flash_attn_4()
    if flash_attn_4 is not None:
        found += f", and {flash_attn_4}"
    return (f"its attention (Attention.flash_decode_and_prefill) needs flash-attn >= {FLASH_ATTN_MIN_VERSION} "
            f"or flash-attn 3/4, and {found}")


def flash_attention_name() -> str:
    """The flash-attn Megatron-Core's attention runs here (FA4 before FA3 before FA2), with its version."""
    from megatron.core.transformer import attention

    distribution = "flash-attn-4" if attention.HAVE_FA4 else "flash-attn-3" if attention.HAVE_FA3 else "flash-attn"
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return distribution


def flash_attention_4_runs() -> bool:
    """Whether Megatron-Core's attention runs flash-attn-4 here (it prefers it to FA3 and FA2)."""
    from megatron.core.transformer import attention

    return attention.HAVE_FA4


def unusable_flash_attn_4() -> Optional[str]:
    """Why an installed ``flash-attn-4`` is not what Megatron-Core runs (its kernels fail to import, or it
    is older than Megatron-Core asks), or None where none is installed."""
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401  (what Megatron-Core imports)
    except ImportError as e:
        return f"flash-attn-4 {version} is installed but does not import: {e}"
    return f"flash-attn-4 {version} is installed, older than the {FLASH_ATTN_4_MIN_VERSION} Megatron-Core uses"


class TokenIdTokenizer:
    """The engine's tokenizer where there is no text: ids in, ids out (it detokenizes every finished request)."""

    def __init__(self, stop_token: int):
        self.eod = stop_token
        self.bos = None

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return " ".join(map(str, token_ids))


@contextlib.contextmanager
def recording_with(routers: list) -> Iterator[None]:
    """Megatron's router recording narrowed to ``routers`` (the engine's ``RouterReplay`` instances).

    The engine sizes its route buffers and stacks recorded routes over the process-wide list
    of instances, which the policy's and the snapshots' routers are on too; and it leaves the
    RECORD action set on every instance of that list.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay

    everyone = RouterReplay.global_router_replay_instances
    saved = list(everyone)
    everyone[:] = routers
    try:
        yield
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        everyone[:] = saved


def finished_request(record):
    """A ``DynamicInferenceRequestRecord`` as one request: its only one, or Megatron's merge of the pieces a
    suspension or an eviction split it into. A merge builds a new request, deep-copying its sampling
    parameters: 32 merges took 6 ms of a 96 ms default-shape ``generate`` under cProfile, for nothing where
    each record holds one piece."""
    return record.requests[0] if len(record.requests) == 1 else record.merge()


def sample_from_request(request, spec: RoutingSpec, sample: int) -> RolloutSample:
    """A finished ``DynamicInferenceRequest`` as a rollout sample: prompt and generated tokens, the loss
    mask on the completion, the log-prob of each generated token, the routes it recorded."""
    from megatron.core.inference.inference_request import Status

    if request.status != Status.COMPLETED:
        raise RolloutEngineError(f"Megatron's inference engine: sample {sample} ended {request.status.name}, "
                                 f"not COMPLETED (its prompt does not fit the engine's max_sequence_length, or "
                                 f"the KV cache ran out)")
    prompt = np.asarray(request.prompt_tokens.tolist(), dtype=np.int64)
    generated = np.asarray(list(request.generated_tokens), dtype=np.int64)
    tokens = np.concatenate([prompt, generated])
    logprobs = np.zeros(len(tokens), dtype=np.float32)
    generated_logprobs = request.generated_log_probs
    if generated_logprobs is None or len(generated_logprobs) != len(generated):
        raise RolloutEngineError(
            f"Megatron's inference engine: sample {sample} has {len(generated)} generated tokens and "
            f"{'no' if generated_logprobs is None else len(generated_logprobs)} log-probs (ask for them with "
            f"SamplingParams.return_log_probs)")
    logprobs[len(prompt):] = np.asarray(generated_logprobs, dtype=np.float32)
    check_logprobs(logprobs, f"Megatron's inference engine, sample {sample}")
    routes = from_megatron_inference(request.routing_indices, spec, num_tokens=len(tokens), sample=sample)
    return RolloutSample(token_ids=tokens, loss_mask=np.arange(len(tokens)) >= len(prompt), logprobs=logprobs,
                         routes=routes)


class MegatronRolloutEngine:
    """Samples completions with Megatron's ``DynamicInferenceEngine`` on lagging bf16 weights.

    The same interface as :class:`~megatron_r3.rl.rollout.engine.RolloutEngine`
    (:attr:`chunks`, :attr:`weights`, :meth:`generate`).

    Args:
        make_chunks: Builds one model chunk of the engine's kind (bf16, ``moe_enable_routing_replay``): the
            engine's own, and one per weight snapshot.
        policy: The trainer's model chunks, same layout; the engine trails their weights.
        spec: The model's MoE layers, experts and top-k.
        sampling: Temperature, length limit, stop token, seed.
        staleness: Optimizer steps the engine's weights trail the policy's by.
        max_requests: Most prompts one :meth:`generate` call passes.
        max_sequence_length: Most tokens of a prompt and its completion.
        top_k: Megatron's top-k filter before sampling (0: none; 1: greedy).
        num_cuda_graphs: CUDA graphs the engine captures (``InferenceConfig.num_cuda_graphs``); None: eager steps.
    """

    def __init__(
        self,
        make_chunks: Callable[[], Sequence[torch.nn.Module]],
        policy: Sequence[torch.nn.Module],
        spec: RoutingSpec,
        sampling: SamplingParams,
        staleness: int,
        max_requests: int,
        max_sequence_length: int,
        top_k: int = 0,
        num_cuda_graphs: Optional[int] = None,
    ):
        from megatron.core.inference.config import InferenceConfig
        from megatron.core.inference.contexts import DynamicInferenceContext
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )
        from megatron.core.inference.utils import InferenceMode

        self.chunks = list(make_chunks())
        if len(self.chunks) != 1:
            raise ValueError(f"Megatron's inference engine runs one model chunk, got {len(self.chunks)}")
        self.spec, self.sampling, self.top_k = spec, sampling, top_k
        self.num_cuda_graphs = num_cuda_graphs
        self.weights = LaggedWeights(policy, self.chunks, staleness, make_chunks)
        model = self.chunks[0]
        model.eval()
        self._routers = [module.router_replay for module in model.modules()
                         if getattr(module, "router_replay", None) is not None]
        if len(self._routers) != len(spec.model_moe_layers):
            raise ValueError(f"the engine's model has {len(self._routers)} recording routers and "
                             f"{len(spec.model_moe_layers)} MoE layers: build it with moe_enable_routing_replay")
        config = InferenceConfig(
            max_sequence_length=max_sequence_length,
            max_requests=max_requests,
            max_tokens=max_requests * max_sequence_length,  # every prompt's prefill in one step
            block_size_tokens=BLOCK_SIZE_TOKENS,
            buffer_size_gb=_kv_cache_gb(model.config, max_requests, max_sequence_length),
            logprobs_mode="processed_logprobs",
            num_cuda_graphs=num_cuda_graphs,
        )
        with recording_with(self._routers):
            context = DynamicInferenceContext(model_config=model.config, inference_config=config)
            controller = TextGenerationController(GPTInferenceWrapper(model, context),
                                                  tokenizer=TokenIdTokenizer(sampling.stop_token))
            self.engine = DynamicInferenceEngine(controller, context)
        InferenceMode.unset_active()  # set by the engine for as long as it lives; the trainer runs without

    @property
    def graph_owner(self) -> str:
        """What holds the engine's CUDA graphs where it has any (``num_cuda_graphs``), in words: each layer, or the
        whole transformer block."""
        from megatron.core.transformer.enums import InferenceCudaGraphScope

        block = self.chunks[0].config.inference_cuda_graph_scope == InferenceCudaGraphScope.block
        return "of the whole transformer block" if block else "per layer"

    @torch.no_grad()
    def generate(self, prompts: Sequence[np.ndarray], iteration: int) -> list[RolloutSample]:
        """Completes this rank's ``prompts``; one sample per prompt, in order (as ``RolloutEngine.generate``).

        Call :meth:`LaggedWeights.advance` on :attr:`weights` once per iteration first.
        """
        from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams
        from megatron.core.inference.utils import InferenceMode

        params = MegatronSamplingParams(
            temperature=self.sampling.temperature, top_k=self.top_k, top_p=0.0, return_log_probs=True,
            skip_prompt_log_probs=True, num_tokens_to_generate=self.sampling.max_new_tokens,
            termination_id=self.sampling.stop_token)
        # Draws follow from (seed, iteration, data-parallel rank), as the built-in engine's do.
        state = np.random.SeedSequence([self.sampling.seed, iteration, parallel_state.get_data_parallel_rank()])
        self.engine.controller.sampling_rng.manual_seed(int(state.generate_state(1, dtype=np.uint64)[0] >> 1))
        with recording_with(self._routers), InferenceMode.active():
            records = self.engine.generate([[int(t) for t in prompt] for prompt in prompts], params)
        if len(records) != len(prompts):
            raise RolloutEngineError(f"Megatron's inference engine finished {len(records)} of {len(prompts)} "
                                     f"requests")
        return [sample_from_request(finished_request(record), self.spec, i) for i, record in enumerate(records)]


def _kv_cache_gb(config, max_requests: int, max_sequence_length: int) -> float:
    """GiB of KV cache for ``max_requests`` sequences of ``max_sequence_length`` tokens, in whole blocks,
    twice over (the context also keeps a dummy block and rounds its own block size)."""
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    groups = config.num_query_groups or config.num_attention_heads
    bytes_per_token = 2 * config.num_layers * groups * head_dim * config.params_dtype.itemsize  # keys and values
    blocks = max_requests * -(-max_sequence_length // BLOCK_SIZE_TOKENS) + 1
    return 2 * blocks * BLOCK_SIZE_TOKENS * bytes_per_token / 1024**3
