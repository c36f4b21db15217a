"""Rollout data on its way from the engine's output to the router: samples and routes, their formats
and checks, the rollout dump, packing into microbatches, route plans, transport and prefetch.
"""
