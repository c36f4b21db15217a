"""The policy's model chunks: built from the flags, run through Megatron's pipeline schedule one pass at
a time (eagerly, or forward-only as CUDA graph replays), and the collectives among a model replica's ranks.
"""
