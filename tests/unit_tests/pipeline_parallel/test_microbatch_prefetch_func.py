# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""pipeline_parallel: schedules call config.microbatch_prefetch_func after each forward.

The no-pipelining schedule, training and forward-only, on one rank, and the combined-1F1B
step (overlap_moe_expert_parallel_comm) with a stand-in schedule plan; 1F1B and interleaved
1F1B (and Megatron-LM's RerunDataIterator around the iterators) run in
tests/dataplane/device/test_prefetch.py on two ranks.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import combined_1f1b, get_forward_backward_func, schedules
from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


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
        config.microbatch_prefetch_func = lambda microbatch_id, vp_stage: events.append(
            ("prefetch", microbatch_id, vp_stage)
        )
        self._run(config, forward_only, events)
        assert events == [
            ("forward", 0),
            ("prefetch", 0, None),
            ("forward", 1),
            ("prefetch", 1, None),
            ("forward", 2),
            ("prefetch", 2, None),
        ]

    def test_unset_changes_nothing(self):
        events = []
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        assert config.microbatch_prefetch_func is None
        self._run(config, False, events)
        assert events == [("forward", 0), ("forward", 1), ("forward", 2)]

    def test_the_combined_1f1b_step_calls_it_with_the_microbatch_and_chunk(self, monkeypatch):
        """The combined-1F1B schedules build a schedule plan and run it themselves; a plan that
        returns its output at once stands in for a model's (whose streams need CUDA)."""

        class Plan(AbstractSchedulePlan):
            event = None

            @staticmethod
            def run(f_schedule_plan, b_schedule_plan, **kwargs):
                events.append("forward ran")
                return torch.ones(1)

        class Chunk(torch.nn.Module):
            def set_input_tensor(self, tensor):
                pass

            def build_schedule_plan(self, *args, **kwargs):
                return Plan()

        def forward_step(data_iterator, model, return_schedule_plan):
            return model.build_schedule_plan(), lambda out: out.sum()

        def calc_loss(model, output_tensor, loss_func, config, vp_stage, *args, **kwargs):
            events.append("loss issued")
            return output_tensor, torch.tensor(1)

        monkeypatch.setattr(
            combined_1f1b, "ScheduleNode", lambda func, *a, **k: SimpleNamespace(forward=func)
        )
        monkeypatch.setattr(schedules, "forward_step_calc_loss", calc_loss)
        events = []
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        config.microbatch_prefetch_func = lambda microbatch_id, vp_stage: events.append(
            ("prefetch", microbatch_id, vp_stage)
        )
        combined_1f1b.combined_forward_backward_step(
            forward_step, None, Chunk(), 4, None, [], None, None, None, None, config,
            f_model_chunk_id=1, current_microbatch=3,
        )
        assert events == ["forward ran", "loss issued", ("prefetch", 3, 1)]
