"""What rollout engines return (vLLM, SGLang, Megatron inference), turned into validated routes and
rollout samples.
"""
