"""The ``megatron_on_cpu`` fixture is in place before a test class's ``setup_method``, which
seeds Megatron's RNG tracker (on a GPU node the states must be the CPU generator's)."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("megatron_on_cpu")


class TestSetupMethodSeesTheCpu:
    def setup_method(self, method):
        self.cuda_available_in_setup = torch.cuda.is_available()
        self.accelerator_in_setup = torch.accelerator.current_accelerator()
        self.cuda_check_patched = torch.cuda.is_available.__name__ == "<lambda>"

    def test_setup_method_runs_with_the_cpu_view(self):
        assert self.cuda_check_patched
        assert not self.cuda_available_in_setup and self.accelerator_in_setup is None
