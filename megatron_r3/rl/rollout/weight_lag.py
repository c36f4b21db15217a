"""A follower model whose weights trail a policy's by a fixed number of optimizer steps.

Asynchronous RL samples with weights some steps behind the trainer's; the
built-in rollout engine reproduces that with ``staleness`` snapshots of the
policy's weights, kept in model chunks of the follower's kind (bf16 for the
engine) used as a ring: each :meth:`LaggedWeights.advance`, called once per
iteration before sampling, loads into the follower the snapshot taken
``staleness`` calls ago (the policy's initial weights until there is one) and
puts a snapshot of the policy as it is now in its place. With ``staleness = 0``
the follower gets the current weights.

All the state there is: the follower's chunks, the snapshot chunks
(:attr:`LaggedWeights.snapshots`, ring slot ``i`` holds the snapshot of advance
``n`` with ``n % staleness == i``) and the number of advances; a checkpoint that
saves the chunks and :attr:`LaggedWeights.advances` resumes the lag exactly.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class LaggedWeights:
    """Keeps ``follower`` ``staleness`` policy updates behind ``policy``.

    Both are lists of model chunks of the same architecture and parallel layout;
    parameters are matched by name and may differ in dtype. The constructor
    copies the policy's weights into the follower and builds the snapshot chunks.

    Args:
        policy: The trainer's model chunks.
        follower: The chunks to keep behind (the rollout engine's).
        staleness: Optimizer steps the follower trails by (>= 0).
        make_snapshot: Builds chunks like the follower's, to hold one snapshot
            (called ``staleness`` times, here).
    """

    def __init__(self, policy: Sequence[torch.nn.Module], follower: Sequence[torch.nn.Module], staleness: int,
                 make_snapshot: Callable[[], Sequence[torch.nn.Module]]):
        if staleness < 0:
            raise ValueError(f"--rollout-staleness must be >= 0, got {staleness}")
        _check_matching(policy, follower)
        self.staleness = staleness
        self.policy, self.follower = list(policy), list(follower)
        self.snapshots = [list(make_snapshot()) for _ in range(staleness)]
        for snapshot in self.snapshots:
            _check_matching(follower, snapshot)
        self.advances = 0
        # The parameters each copy reads and writes, matched once (the optimizer steps in place).
        self._to_follower = _ParameterCopy(self.policy, self.follower)
        self._to_snapshot = [_ParameterCopy(self.policy, snapshot) for snapshot in self.snapshots]
        self._from_snapshot = [_ParameterCopy(snapshot, self.follower) for snapshot in self.snapshots]
        self._to_follower()

    @torch.no_grad()
    def advance(self) -> None:
        """The follower takes the snapshot ``staleness`` calls old; the policy's current weights replace it."""
        self.advances += 1
        if self.staleness == 0:
            self._to_follower()
            return
        slot = self.advances % self.staleness
        if self.advances > self.staleness:
            self._from_snapshot[slot]()
        self._to_snapshot[slot]()


class _ParameterCopy:
    """Copies the parameters of ``source``'s chunks into ``target``'s same-named ones (casting the dtype),
    in one ``_foreach_copy_``: a per-parameter loop costs the host more than the copies take the device."""

    def __init__(self, source: Sequence[torch.nn.Module], target: Sequence[torch.nn.Module]):
        self.sources, self.targets = [], []
        for source_chunk, target_chunk in zip(source, target):
            targets = dict(target_chunk.named_parameters())
            for name, param in source_chunk.named_parameters():
                self.sources.append(param)
                self.targets.append(targets[name])

    @torch.no_grad()
    def __call__(self) -> None:
        torch._foreach_copy_(self.targets, self.sources)


def _check_matching(policy, follower) -> None:
    if len(policy) != len(follower):
        raise ValueError(f"the policy has {len(policy)} model chunks, the follower {len(follower)}")
    for chunk, (source, target) in enumerate(zip(policy, follower)):
        source_params, target_params = dict(source.named_parameters()), dict(target.named_parameters())
        if source_params.keys() != target_params.keys():
            raise ValueError(f"model chunk {chunk}: parameters differ: "
                             f"{sorted(source_params.keys() ^ target_params.keys())}")
        for name, param in source_params.items():
            if param.shape != target_params[name].shape:
                raise ValueError(f"model chunk {chunk}: {name} is {tuple(param.shape)} in the policy and "
                                 f"{tuple(target_params[name].shape)} in the follower")
