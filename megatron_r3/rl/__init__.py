"""The RL loop on Megatron: tasks and the rollout engine, the policy loss and trainer, Megatron's
training stack, checkpoints, metrics, the run and its checks.
"""
