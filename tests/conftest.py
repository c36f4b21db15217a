import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from patch_series import SDIST_NAME  # noqa: E402  (the base sdist has one name, in the tool)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; run by `make test` when a GPU is present")
    config.addinivalue_line("markers", "slow: multi-process layout tests")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def megatron_sdist(tmp_path_factory):
    """The pristine megatron-core sdist that make install fetched."""
    path = os.path.join(os.path.dirname(__file__), "..", "build", SDIST_NAME)
    assert os.path.isfile(path), "run `make install` first: it keeps the sdist in build/"
    return os.path.abspath(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test without the ``gpu`` marker runs as on a machine without GPUs, on a GPU node too.

    Megatron in this process then computes on the CPU (where a GPU is visible, its current
    device, ``get_current_device``, would be the GPU and its buffers would land there), the
    test's workers start on gloo (``default_backend``) and its checks (tolerances, device
    placement) are the ones a CPU run verifies, as in CI; GPU behaviour is what gpu-marked tests
    check. The view covers the test's whole setup: the module- and session-scoped fixtures it
    starts (the layout tests' single-rank references, which on 2 x H200 ran on NCCL while the
    layouts ran on gloo, 3e-4 apart) and its class's ``setup_method`` (Megatron's RNG tracker,
    seeded there, holds CPU generator states).
    """
    if item.get_closest_marker("gpu") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
        yield
