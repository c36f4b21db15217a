import os

import pytest
import torch


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
    """The pristine megatron-core 0.16.1 sdist that make install fetched."""
    path = os.path.join(os.path.dirname(__file__), "..", "build", "megatron_core-0.16.1.tar.gz")
    assert os.path.isfile(path), "run `make install` first: it keeps the sdist in build/"
    return os.path.abspath(path)
