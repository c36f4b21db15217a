"""Samples on their way to the device: packed into a rank's THD microbatches, the routing plan of each
model chunk, filler routes, per-expert token counts, the packing kernels, the upload to the GPU and the
preparation of each microbatch one ahead of its use.
"""
