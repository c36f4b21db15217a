"""Checkpoints through dist_checkpointing: model chunks, optimizer, RNG states and the run's state; their
directories and atomic publication, the room a save needs, and the finiteness of what is saved and loaded.
"""
