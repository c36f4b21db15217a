"""The policy update: the clipped policy-gradient loss, the trainer's passes under R3, R2 or live routing,
Megatron's training stack, the update pass as a CUDA graph replay, and the training metrics.
"""
