# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""gpt: every pipeline stage scatters the MoE padding mask under sequence parallelism."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class TestSequenceParallelPaddingMask:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("pre_process", [True, False], ids=["first_stage", "later_stage"])
    def test_the_mask_is_scattered_over_the_models_tp_group(self, monkeypatch, pre_process):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            use_cpu_initialization=True,
        )
        # The model's own TP group, not the one parallel_state keeps.
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        pg_collection.tp = dist.new_group([0])
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=64,
            max_sequence_length=16,
            pre_process=pre_process,
            pg_collection=pg_collection,
        )
        # A single rank has no sequence parallelism to enable; the mask path only asks the flag.
        config.sequence_parallel = True
        scattered = []
        scatter = tensor_parallel.scatter_to_sequence_parallel_region

        def spy(input_, group=None):
            scattered.append((input_.dtype, group))
            return scatter(input_, group=group)

        monkeypatch.setattr(tensor_parallel, "scatter_to_sequence_parallel_region", spy)
        tokens = torch.randint(0, 64, (2, 16))
        padding_mask = torch.zeros(2, 16, dtype=torch.bool)
        padding_mask[:, -3:] = True

        preprocessed = model._preprocess(
            tokens, torch.arange(16).expand(2, -1), padding_mask=padding_mask
        )

        mask_scatters = [group for dtype, group in scattered if dtype == torch.bool]
        assert mask_scatters == [pg_collection.tp]
        assert any(torch.equal(out, padding_mask) for out in preprocessed if torch.is_tensor(out))
