"""The RL loop on Megatron. The launcher's run and its flags are here (``arguments``, ``initialize``,
``run``, ``run_checks``, ``metrics_file``); what the run drives is in sub-packages: ``rollout`` (tasks,
the built-in engine, where samples come from), ``model`` (the GPT chunks and one pass of Megatron's
schedule over them), ``trainer`` (the policy loss and update, Megatron's training stack, training
metrics), ``checkpoint`` and ``profiling``.
"""
