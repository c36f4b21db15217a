"""Test-only scaffolding for running Megatron-Core on CPU process groups."""
