# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""pipeline_parallel: schedules call config.microbatch_prefetch_func after each forward.

The no-pipelining schedule, training and forward-only, on one rank; 1F1B and interleaved
1F1B (and Megatron-LM's RerunDataIterator around the iterators) run in
tests/dataplane/device/test_prefetch.py on two ranks.
"""

import pytest
import torch

from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

pytestmark = pytest.mark.usefixtures("megatron_on_cpu")


class TestMicrobatchPrefetchFunc:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @staticmethod
    def _run(config, forward_only, events):
        model = torch.nn.Linear(4, 1)
        model.config = config
        model.model_type = ModelType.encoder_or_decoder
        model.set_input_tensor = lambda tensor: None  # a single stage receives nothing

        def forward_step(data_iterator, model):
            index = next(data_iterator)
            events.append(("forward", index))
            output = model(torch.ones(1, 4) * index)
            return output, lambda out: (out.sum(), torch.tensor(1, dtype=torch.int), {})

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(3)),
            model=[model],
            num_microbatches=3,
            seq_length=1,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    @pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward-only"])
    def test_called_once_after_every_forward(self, forward_only):
        events = []
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        config.microbatch_prefetch_func = lambda vp_stage: events.append(("prefetch", vp_stage))
        self._run(config, forward_only, events)
        assert events == [
            ("forward", 0),
            ("prefetch", None),
            ("forward", 1),
            ("prefetch", None),
            ("forward", 2),
            ("prefetch", None),
        ]

    def test_unset_changes_nothing(self):
        events = []
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        assert config.microbatch_prefetch_func is None
        self._run(config, False, events)
        assert events == [("forward", 0), ("forward", 1), ("forward", 2)]
