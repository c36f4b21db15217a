# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""utils.local_multi_tensor_l2_norm and local_multi_tensor_scale: gradient norm and clipping
without apex or TransformerEngine.

The norm must equal the norm of every tensor taken as one vector, the scale must write
``src * scale`` into ``dst``, and both must stay on the tensors' device: on ``meta`` tensors
any read back to the host (``float()``, ``torch.tensor`` of device scalars) raises, so an
implementation that reads back cannot pass.
"""

import torch

from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale
from tests.unit_tests.test_utilities import Utils


def test_the_norm_is_the_norm_of_all_tensors_as_one_vector():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen) for shape in ((3, 5), (7,), (2, 2, 2), (1,))]
    norm, per_tensor = local_multi_tensor_l2_norm(2048, None, [tensors[:2], tensors[2:]], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], torch.cat([t.flatten() for t in tensors]).norm(), rtol=1e-6, atol=0)


def test_bf16_tensors_give_a_float32_norm():
    tensors = [torch.full((4,), 1.5, dtype=torch.bfloat16), torch.full((16,), 1.0, dtype=torch.bfloat16)]
    norm, _ = local_multi_tensor_l2_norm(2048, None, [tensors], False)
    assert norm.dtype == torch.float32 and norm.item() == 5.0  # sqrt(4 * 2.25 + 16)


def test_no_tensor_gives_zero():
    norm, _ = local_multi_tensor_l2_norm(2048, None, [[]], False)
    assert norm.tolist() == [0.0]


def test_the_norm_never_reads_the_device_back():
    tensors = [torch.empty(3, 5, device="meta"), torch.empty(7, device="meta")]
    norm, _ = local_multi_tensor_l2_norm(2048, None, [tensors], False)
    assert norm.device.type == "meta" and norm.shape == (1,)


def test_scale_writes_the_scaled_sources_into_the_destinations():
    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(shape, generator=gen) for shape in ((3, 5), (7,), (1,))]
    dst = [torch.empty_like(t) for t in src[:2]] + [torch.empty(1, dtype=torch.bfloat16)]
    local_multi_tensor_scale(2048, None, [src, dst], 0.25)
    for s, d in zip(src, dst):
        assert torch.equal(d, (s * 0.25).to(d.dtype))
    assert torch.equal(src[0], torch.randn((3, 5), generator=torch.Generator().manual_seed(1)))


def test_scale_in_place_as_clip_grads_calls_it():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    local_multi_tensor_scale(2048, None, [grads, grads], torch.tensor(0.5))
    assert [g.tolist() for g in grads] == [[1.5, 2.0], [6.0]]


def test_scale_never_reads_the_device_back():
    tensors = [torch.empty(3, 5, device="meta"), torch.empty(7, device="meta")]
    local_multi_tensor_scale(2048, None, [tensors, tensors], torch.tensor(0.5, device="meta"))
    local_multi_tensor_scale(2048, None, [[], []], 0.5)


def test_get_grad_norm_fp32_uses_it():
    """Without apex and TransformerEngine (this machine), the clip-grads path takes the local norm."""
    Utils.initialize_model_parallel()
    try:
        grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
        assert get_grad_norm_fp32(grads) == 13.0
    finally:
        Utils.destroy_model_parallel()
