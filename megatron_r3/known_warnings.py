"""Warnings that Megatron-Core and TransformerEngine print on every start and that say nothing a
user of this project can act on, filtered by message and category so that the rest stay visible.

Each entry is a fallback this project chooses on purpose (torch's norms and optimizers where
neither Apex nor TransformerEngine is installed: Apex is not on PyPI, and TE runs on GPUs only),
a module this project does not use (absl logging, JAX's TE extension on a node with JAX), or a
notice about options this project never sets (the default CUDA-graph scope, the experimental
MIMO config). Other warnings, Megatron's GPTModel deprecation notice included, still show.
"""

import warnings

# (category, start of the message as a regular expression)
KNOWN_WARNINGS = (
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back to"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm"),
    (UserWarning, r"absl\.logging is not installed"),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_modules"),
    (UserWarning, r"MimoModelConfig is experimental"),
    (RuntimeWarning, r"Detected a Jax installation but could not find the shared object file for the "
                     r"Transformer Engine Jax extension"),
)


def filter_known_warnings() -> None:
    """Ignore the :data:`KNOWN_WARNINGS` in this process (call it before importing Megatron)."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
