"""Benchmarks for megatron-r3 (`make bench`, or `python -m bench --help`)."""
