"""A LayerNorm / RMSNorm in plain torch that works with sequence parallelism."""

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) usable with sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``: under SP each
    tensor-parallel rank normalises a different slice of the sequence, so the
    gradients of the (replicated) norm parameters are partial sums that must be
    all-reduced across the TP group. This module marks its parameters with
    ``sequence_parallel = config.sequence_parallel``, the attribute Megatron's
    ``finalize_model_grads`` looks for to do that all-reduce, like the Apex and
    TransformerEngine norms do.

    The constructor takes the arguments Megatron passes to any norm in a layer spec.

    Args:
        config: The transformer config; ``normalization`` picks LayerNorm or RMSNorm,
            ``layernorm_zero_centered_gamma`` stores the weight as ``gamma - 1``.
        hidden_size: Size of the normalised (last) dimension.
        eps: Added to the variance (or mean square) for numerical stability.
        persist_layer_norm: Accepted for spec compatibility; has no effect here.
        zero_centered_gamma: Accepted for spec compatibility; the config decides.
        normalization: Accepted for spec compatibility; the config decides.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"SequenceParallelNorm supports LayerNorm and RMSNorm, not {config.normalization!r}"
            )
        self.normalization = config.normalization
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        params = [self.weight]
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
            params.append(self.bias)
        else:
            self.bias = None
        for param in params:
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
