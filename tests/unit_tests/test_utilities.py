"""``Utils`` for the patch series' unit tests, in the form Megatron-LM's tests use it.

Megatron-LM's ``tests/unit_tests/test_utilities.py`` starts one rank per GPU under
torchrun. These tests run in one CPU process: a gloo group of one rank, so a test
written against ``Utils.initialize_model_parallel`` reads the same here and upstream.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


class Utils:
    world_size = 1
    rank = 0

    @staticmethod
    def initialize_distributed():
        if not dist.is_initialized():
            # An in-memory store: a group of one needs no rendezvous (and no port).
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        Utils._destroy_groups()
        Utils.initialize_distributed()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        model_parallel_cuda_manual_seed(123)

    @staticmethod
    def destroy_model_parallel():
        Utils._destroy_groups()
        torch.manual_seed(0)

    @staticmethod
    def _destroy_groups():
        """Megatron's parallel state, then the world of one with every group made in it.

        ``initialize_model_parallel`` makes some twenty gloo groups, each with threads of its own;
        ``destroy_model_parallel`` only forgets them. Destroying the default group frees them all,
        so tests in one process do not pile up thousands of polling threads.
        """
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
