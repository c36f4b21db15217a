"""torchrun entry points (``torchrun ... launch/pretrain_gpt_r3.py``)."""
