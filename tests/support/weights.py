"""Map a sharded model's parameters to full single-rank tensors, and back.

Every parameter of a sharded GPT is identified by its *full name*: the name it has
in the single-rank model (layer index global, expert index global) plus the slice
of the full tensor this rank holds (tensor- or expert-tensor-parallel dimension).
With that, weights can be generated from a seed for any layout, and gradients
from all ranks can be assembled into full tensors and compared by name.
"""

import dataclasses
import re
import zlib
from typing import Iterable, Optional

import torch
from megatron.core import parallel_state


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which part of a full single-rank tensor one local parameter holds.

    Attributes:
        name: The parameter's name in the single-rank model.
        full_shape: Shape of the full tensor.
        dim: The dimension it is split along, or ``None`` for a full copy.
        index: This rank's chunk along ``dim``.
        count: Number of chunks along ``dim``.
    """

    name: str
    full_shape: tuple
    dim: Optional[int] = None
    index: int = 0
    count: int = 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's slice of the full tensor."""
        if self.dim is None:
            return full
        return full.chunk(self.count, dim=self.dim)[self.index]


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
# TransformerEngine's grouped experts (TEGroupedMLP): one weight (and bias) per local expert.
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def param_shards(chunks: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Parameter, Shard]]:
    """Each parameter of this rank's model chunks with the :class:`Shard` it holds.

    Layer indices become global through ``layer_number`` (so PP, uneven PP and VP
    map correctly); ``local_experts.k`` becomes the global expert
    ``ep_rank * num_local_experts + k``; a parameter Megatron marks
    ``tensor_model_parallel`` is split along its ``partition_dim`` over the TP
    group (the expert-TP group for expert weights).
    """
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    out = []
    for chunk in chunks:
        layer_of = {}
        if hasattr(chunk, "decoder"):
            layer_of = {j: layer.layer_number - 1 for j, layer in enumerate(chunk.decoder.layers)}
        num_local_experts = None
        for name, param in chunk.named_parameters():
            full_name = _LAYER.sub(lambda m: f"decoder.layers.{layer_of[int(m.group(1))]}.", name)
            is_expert = _EXPERT.search(name) is not None
            grouped = _GROUPED_EXPERT.search(name)
            if is_expert:
                num_local_experts = _num_local_experts(chunk, name)
                full_name = _EXPERT.sub(
                    lambda m: f".local_experts.{ep_rank * num_local_experts + int(m.group(1))}.",
                    full_name,
                )
            elif grouped is not None:
                is_expert = True
                num_local_experts = chunk.get_submodule(name[: grouped.start(1)] + ".experts.linear_fc1").num_gemms
                full_name = _GROUPED_EXPERT.sub(
                    lambda m: f"{m.group(1)}{ep_rank * num_local_experts + int(m.group(2))}", full_name
                )
            elif ".experts." in name:
                raise NotImplementedError(f"grouped expert weights are not mapped: {name}")
            out.append((param, _shard_of(param, full_name, is_expert)))
    return out


def _num_local_experts(chunk: torch.nn.Module, name: str) -> int:
    prefix = name[: _EXPERT.search(name).start()]
    return len(chunk.get_submodule(prefix).local_experts)


def _shard_of(param: torch.nn.Parameter, full_name: str, is_expert: bool) -> Shard:
    if is_expert:
        size = parallel_state.get_expert_tensor_parallel_world_size()
        rank = parallel_state.get_expert_tensor_parallel_rank()
    else:
        size = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return Shard(full_name, tuple(param.shape))
    if getattr(param, "partition_stride", 1) != 1:
        raise NotImplementedError(f"strided TP partition of {full_name}")
    dim = param.partition_dim
    full_shape = list(param.shape)
    full_shape[dim] *= size
    return Shard(full_name, tuple(full_shape), dim, rank, size)


def full_init(name: str, shape: tuple, seed: int, router_logit_std: float = 2.0) -> torch.Tensor:
    """The full tensor of parameter ``name``: a pure function of (name, shape, seed).

    Norm weights are ``1 + 0.1 N(0, 1)``; matrices ``N(0, 1/fan_in)``; the word
    embedding ``N(0, 1)``; router weights are scaled so router logits have
    standard deviation about ``router_logit_std`` (large top-k margins, see
    tests/test_layouts.py); biases ``0.1 N(0, 1)``.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    # Megatron's norms (``input_layernorm.weight``) and TE's norms fused into a linear layer
    # (``linear_qkv.layer_norm_weight``).
    if ("layernorm" in name or "layer_norm" in name) and name.endswith("weight"):
        return 1 + 0.1 * noise
    if len(shape) == 1:
        return 0.1 * noise
    if "word_embeddings" in name:
        return noise
    if name.endswith("router.weight"):
        # Normalised inputs have unit-variance entries, so logits ~ N(0, std^2).
        return noise * router_logit_std / shape[1] ** 0.5
    return noise / shape[1] ** 0.5


def init_from_seed(chunks: Iterable[torch.nn.Module], seed: int, router_logit_std: float = 2.0):
    """Set every parameter to its slice of the full tensor :func:`full_init` gives."""
    with torch.no_grad():
        for param, shard in param_shards(chunks):
            full = full_init(shard.name, shard.full_shape, seed, router_logit_std)
            param.copy_(shard.take(full))


def load_full(chunks: Iterable[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Set every parameter to its slice of the full single-rank tensor in ``full``."""
    with torch.no_grad():
        for param, shard in param_shards(chunks):
            param.copy_(shard.take(full[shard.name]))


def grad_shards(chunks: Iterable[torch.nn.Module]) -> list[tuple[Shard, torch.Tensor]]:
    """This rank's gradients (``main_grad``: what Megatron's DDP accumulated and reduced) as
    ``(Shard, grad)`` on the CPU, for :func:`assemble`."""
    return [(shard, param.main_grad.detach().cpu()) for param, shard in param_shards(chunks)]


def param_values(chunks: Iterable[torch.nn.Module]) -> list[tuple[Shard, torch.Tensor]]:
    """This rank's parameters as ``(Shard, value)`` on the CPU, for :func:`assemble`."""
    return [(shard, param.detach().cpu()) for param, shard in param_shards(chunks)]


def assemble(per_rank: Iterable[list[tuple[Shard, torch.Tensor]]], atol: float = 1e-6) -> dict:
    """Full tensors by single-rank name from the shards of every rank.

    Copies of the same slice held by several ranks (replicas across TP, DP, CP)
    must agree within ``atol`` (relative to the tensor's scale): a replica that
    differs means a missing or wrong reduction, and raises.

    Raises:
        AssertionError: replicas disagree, or part of a tensor is missing.
    """
    full, filled = {}, {}
    for shards in per_rank:
        for shard, value in shards:
            if shard.name not in full:
                full[shard.name] = torch.zeros(shard.full_shape, dtype=value.dtype)
                filled[shard.name] = torch.zeros(shard.full_shape, dtype=torch.bool)
            target = shard.take(full[shard.name])
            seen = shard.take(filled[shard.name])
            if seen.any():
                scale = max(1.0, target.abs().max().item())
                err = (target - value).abs().max().item()
                assert err <= atol * scale, f"replicas of {shard.name} differ by {err:.3g}"
            else:
                target.copy_(value)
                seen.fill_(True)
    for name, mask in filled.items():
        assert mask.all(), f"{name}: {int((~mask).sum())} elements held by no rank"
    return full
