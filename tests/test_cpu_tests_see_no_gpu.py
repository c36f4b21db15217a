"""A test without the ``gpu`` marker sees a machine without GPUs from its first setup step on: the
module-scoped fixtures it starts and its class's ``setup_method`` (which seeds Megatron's RNG
tracker) included, and its workers start on gloo."""

import pytest
import torch

from tests.support.launcher import default_backend


def _cpu_view() -> dict:
    return {"patched": torch.cuda.is_available.__name__ == "<lambda>", "cuda": torch.cuda.is_available(),
            "accelerator": torch.accelerator.current_accelerator(), "backend": default_backend(2)}


CPU_VIEW = {"patched": True, "cuda": False, "accelerator": None, "backend": "gloo"}


@pytest.fixture(scope="module")
def seen_by_a_module_fixture():
    # As the layout tests' single-rank references: started by the first test that asks for it.
    return _cpu_view()


def test_a_module_fixture_runs_with_the_cpu_view(seen_by_a_module_fixture):
    assert seen_by_a_module_fixture == CPU_VIEW


class TestSetupMethodSeesTheCpu:
    def setup_method(self, method):
        self.seen_in_setup = _cpu_view()

    def test_setup_method_runs_with_the_cpu_view(self):
        assert self.seen_in_setup == CPU_VIEW

    def test_workers_start_on_gloo(self):
        assert default_backend(1) == default_backend(2) == "gloo"
