"""What the CPU tests import from the Megatron-LM series (patches/megatron-lm/) without a checkout.

The series creates ``megatron/rl/routing_replay.py``, which depends on torch, numpy and the
patched megatron-core only: it is written out of the series as the series leaves it
(``tools/megatron_lm_series.py extract``) and imported under its own name.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "megatron/rl/routing_replay.py"
_NAME = "megatron_lm_rl_routing_replay"


def _series_tool():
    spec = importlib.util.spec_from_file_location("megatron_lm_series", ROOT / "tools" / "megatron_lm_series.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def rl_routing_replay(out: Path):
    """``megatron/rl/routing_replay.py`` of the Megatron-LM series, written under ``out`` and
    imported once per process."""
    if _NAME not in sys.modules:
        path = _series_tool().extract(MODULE, out)
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[_NAME]
