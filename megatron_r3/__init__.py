"""megatron-r3: rollout routing replay as a first-class feature of Megatron-Core MoE training."""

__version__ = "0.1.0"


def kernel_info() -> dict:
    """Which compiled kernels this install has: {'cpu': bool, 'cuda': bool}."""
    import torch  # noqa: F401  (loads libc10, which _C links against)

    try:
        from megatron_r3 import _C
    except ImportError:
        return {"cpu": False, "cuda": False}
    return {"cpu": True, "cuda": bool(getattr(_C, "WITH_CUDA", False))}
