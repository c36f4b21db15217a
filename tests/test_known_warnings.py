"""megatron_r3.known_warnings: the start-up warnings the project knows are harmless are hidden, others show."""

import warnings

import pytest

from megatron_r3.known_warnings import filter_known_warnings

# The messages as Megatron-Core 0.19.2 and TransformerEngine 2.20.2 print them.
KNOWN = [
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."),
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to local implementations of "
                  "multi_tensor_applier and multi_tensor_scale"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "absl.logging is not installed. Using logging.getLogger(__name__) instead."),
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer."),
    (UserWarning, "MimoModelConfig is experimental and still under active development."),
    (RuntimeWarning, "Detected a Jax installation but could not find the shared object file for the Transformer "
                     "Engine Jax extension library."),
]


def _shown(category, message):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_warnings()
        warnings.warn(message, category)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("category,message", KNOWN, ids=[m[:30] for _, m in KNOWN])
def test_a_known_warning_is_hidden(category, message):
    assert _shown(category, message) == []


@pytest.mark.parametrize("category,message", [
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"[::-1]),
    (DeprecationWarning, "Apex is not installed. Falling back to Torch Norm"),  # another category
    (UserWarning, "moe_router_fusion is set but TE is too old"),
])
def test_other_warnings_still_show(category, message):
    assert _shown(category, message) == [message]
