"""Model structure: which layers are MoE, where context-parallel tokens sit, and the layer specs
(attention, norm) that run every parallel layout without TransformerEngine.
"""
