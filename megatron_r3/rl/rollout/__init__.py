"""Rollouts: the built-in tasks, the rollout engine that samples completions and records their routes
with weights that trail the policy's, and where each iteration's samples come from (the engine or a
rollout dump).
"""
