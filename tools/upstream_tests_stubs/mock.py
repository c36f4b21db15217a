"""Stand-in for the mock backport (tools/upstream_tests.py): unittest.mock under its old name."""

from unittest.mock import *  # noqa: F401,F403
from unittest.mock import patch  # noqa: F401
