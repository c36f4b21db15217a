"""Where an iteration's time goes: Megatron-LM's ``--profile`` range, wall time per phase and the host's
waits for the device.
"""
