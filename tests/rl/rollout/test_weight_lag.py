"""megatron_r3.rl.rollout.weight_lag: the follower trails the policy by exactly `staleness` updates, in its own
dtype."""

import pytest
import torch

from megatron_r3.rl.rollout.weight_lag import LaggedWeights


def model(dtype=torch.float32):
    return [torch.nn.Linear(3, 2).to(dtype), torch.nn.Linear(2, 1, bias=False).to(dtype)]


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_follower_gets_the_weights_of_staleness_updates_ago(staleness):
    policy, follower = model(), model(torch.bfloat16)
    history = []  # the policy's weights at the start of each iteration
    lag = LaggedWeights(policy, follower, staleness, lambda: model(torch.bfloat16))
    for iteration in range(6):
        history.append([p.detach().clone() for c in policy for p in c.parameters()])
        lag.advance()
        expected = history[max(0, iteration - staleness)]
        for got, want in zip([p for c in follower for p in c.parameters()], expected):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)
        assert len(lag.snapshots) == staleness and lag.advances == iteration + 1
        with torch.no_grad():  # an optimizer step
            for c in policy:
                for p in c.parameters():
                    p.add_(torch.randn_like(p))


def test_models_that_do_not_match_are_refused():
    with pytest.raises(ValueError, match="the policy has 2 model chunks, the follower 1"):
        LaggedWeights(model(), model()[:1], 0, model)
    with pytest.raises(ValueError, match=r"model chunk 0: weight is \(2, 3\) in the policy and \(2, 4\)"):
        LaggedWeights([torch.nn.Linear(3, 2)], [torch.nn.Linear(4, 2)], 0, model)
    with pytest.raises(ValueError, match="--rollout-staleness must be >= 0"):
        LaggedWeights(model(), model(), -1, model)


def test_chunks_and_advance_count_are_the_whole_state():
    """What a checkpoint saves (follower, snapshot chunks, advances) resumes the lag exactly."""
    policy = model()
    lag = LaggedWeights(policy, model(torch.bfloat16), 2, lambda: model(torch.bfloat16))
    for _ in range(3):
        lag.advance()
        with torch.no_grad():
            for p in (p for c in policy for p in c.parameters()):
                p.add_(torch.randn_like(p))
    resumed = LaggedWeights(policy, model(torch.bfloat16), 2, lambda: model(torch.bfloat16))
    for source, target in zip([lag.follower, *lag.snapshots], [resumed.follower, *resumed.snapshots]):
        for s, t in zip(source, target):
            t.load_state_dict(s.state_dict())
    resumed.advances = lag.advances
    for _ in range(3):
        lag.advance()
        resumed.advance()
        for a, b in zip(lag.follower, resumed.follower):
            for pa, pb in zip(a.parameters(), b.parameters()):
                assert torch.equal(pa, pb)
        with torch.no_grad():
            for p in (p for c in policy for p in c.parameters()):
                p.add_(torch.randn_like(p))
