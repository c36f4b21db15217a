"""A test without the ``gpu`` marker sees a machine without GPUs from before its class's
``setup_method`` (which seeds Megatron's RNG tracker) on, and its workers start on gloo."""

import torch

from tests.support.launcher import default_backend


class TestSetupMethodSeesTheCpu:
    def setup_method(self, method):
        self.cuda_available_in_setup = torch.cuda.is_available()
        self.accelerator_in_setup = torch.accelerator.current_accelerator()
        self.cuda_check_patched = torch.cuda.is_available.__name__ == "<lambda>"

    def test_setup_method_runs_with_the_cpu_view(self):
        assert self.cuda_check_patched
        assert not self.cuda_available_in_setup and self.accelerator_in_setup is None

    def test_workers_start_on_gloo(self):
        assert default_backend(1) == default_backend(2) == "gloo"
