"""A follower model whose weights trail a policy's by a fixed number of optimizer steps.

Asynchronous RL samples with weights some steps behind the trainer's; the
built-in rollout engine reproduces that with ``staleness`` snapshots of the
policy's weights, stored in the follower's dtype (bf16 for the engine). Each
:meth:`LaggedWeights.advance`, called once per iteration before sampling, takes
a snapshot of the policy as it is now and loads into the follower the one taken
``staleness`` calls ago (the policy's initial weights until there is one). With
``staleness = 0`` the follower gets the current weights.

The follower's weights and :attr:`LaggedWeights.snapshots` are all the state
there is: a checkpoint that saves both resumes the lag exactly.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch


class LaggedWeights:
    """Keeps ``follower`` ``staleness`` policy updates behind ``policy``.

    Both are lists of model chunks of the same architecture and parallel layout;
    parameters are matched by name and may differ in dtype. The constructor
    copies the policy's weights into the follower.

    Args:
        policy: The trainer's model chunks.
        follower: The chunks to keep behind (the rollout engine's).
        staleness: Optimizer steps the follower trails by (>= 0).
    """

    def __init__(self, policy: Sequence[torch.nn.Module], follower: Sequence[torch.nn.Module], staleness: int):
        if staleness < 0:
            raise ValueError(f"--rollout-staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self._pairs = _matched_parameters(policy, follower)
        self.snapshots: deque[list[torch.Tensor]] = deque()
        self._load([p for p, _ in self._pairs])

    @torch.no_grad()
    def advance(self) -> None:
        """Snapshots the policy; the follower takes the snapshot ``staleness`` calls old."""
        self.snapshots.append([p.detach().to(f.dtype, copy=True) for p, f in self._pairs])
        if len(self.snapshots) > self.staleness:
            self._load(self.snapshots.popleft())

    @torch.no_grad()
    def _load(self, weights: Sequence[torch.Tensor]) -> None:
        for (_, follower), weight in zip(self._pairs, weights):
            follower.copy_(weight)


def _matched_parameters(policy, follower) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    if len(policy) != len(follower):
        raise ValueError(f"the policy has {len(policy)} model chunks, the follower {len(follower)}")
    pairs = []
    for chunk, (source, target) in enumerate(zip(policy, follower)):
        source_params, target_params = dict(source.named_parameters()), dict(target.named_parameters())
        if source_params.keys() != target_params.keys():
            raise ValueError(f"model chunk {chunk}: parameters differ: "
                             f"{sorted(source_params.keys() ^ target_params.keys())}")
        for name, param in source_params.items():
            if param.shape != target_params[name].shape:
                raise ValueError(f"model chunk {chunk}: {name} is {tuple(param.shape)} in the policy and "
                                 f"{tuple(target_params[name].shape)} in the follower")
            pairs.append((param, target_params[name]))
    return pairs
