import pytest

from tests.support.megatron_lm import rl_routing_replay


@pytest.fixture(scope="session")
def rr(tmp_path_factory):
    """megatron/rl/routing_replay.py as the Megatron-LM series writes it."""
    return rl_routing_replay(tmp_path_factory.mktemp("megatron-lm-series"))
