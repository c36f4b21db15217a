"""The RL loop's training stack before Megatron's: a reference for tests and benchmarks.

:class:`OldLoopStack` stands in for :func:`megatron_r3.rl.trainer.training_stack.build_training_stack`
(same constructor and attributes): the model chunks unwrapped, a plain ``torch.optim.AdamW``
over them, and gradients all-reduced parameter by parameter over the data-parallel group
(expert parameters over the expert data-parallel group), then scaled by the float32
reciprocal of the iteration's token count, as ``finalize_model_grads`` scales them.
"""

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state


class _PlainAdamW:
    """The old loop's optimizer, behind the interface the trainer uses."""

    def __init__(self, params, settings):
        self.adam = torch.optim.AdamW(params, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2),
                                      eps=settings.adam_eps, weight_decay=settings.weight_decay)
        self.param_groups = [{"default_config": True, "lr": settings.lr}]

    def step(self):
        self.adam.step()
        return True, math.nan, None


class OldLoopStack:
    """The old loop: the chunks unwrapped, AdamW, gradients all-reduced per parameter."""

    def __init__(self, chunks, config, settings):
        self.model = self.chunks = list(chunks)
        self.optimizer = _PlainAdamW([p for c in chunks for p in c.parameters()], settings)
        self.scheduler = self  # a constant rate: nothing to step
        config.finalize_model_grads_func = self._finalize

    def step(self, increment):
        pass

    def zero_grad(self):
        self.optimizer.adam.zero_grad(set_to_none=True)

    @staticmethod
    def _finalize(model, num_tokens, pg_collection=None, force_all_reduce=False):
        dist.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        for chunk in model:
            for param in chunk.parameters():
                if param.grad is None:  # an expert no token reached
                    param.grad = torch.zeros_like(param)
                expert = not getattr(param, "allreduce", True)
                dist.all_reduce(param.grad, group=parallel_state.get_expert_data_parallel_group() if expert else
                                parallel_state.get_data_parallel_group(with_context_parallel=True))
                param.grad.mul_(1.0 / num_tokens)
