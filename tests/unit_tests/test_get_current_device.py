# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""utils: get_current_device on every torch megatron-core supports (torch >= 2.6).

torch.accelerator exists from torch 2.6; current_accelerator(check_available=...) and
current_device_index from torch 2.7. The older APIs are stood in for on the running torch.
"""

import types

import torch

from megatron.core.utils import get_current_device


def _torch_2_6_accelerator(available, device_type="cuda", index=3):
    """torch.accelerator as torch 2.6 has it: no check_available, current_device_idx."""
    return types.SimpleNamespace(
        current_accelerator=lambda: torch.device(device_type),
        is_available=lambda: available,
        current_device_idx=lambda: index,
    )


class TestGetCurrentDevice:

    def test_torch_2_6_with_an_accelerator(self, monkeypatch):
        monkeypatch.setattr(torch, "accelerator", _torch_2_6_accelerator(available=True))
        assert get_current_device() == torch.device("cuda", 3)

    def test_torch_2_6_without_an_available_accelerator(self, monkeypatch):
        # torch 2.6 names the accelerator it was built for even where none is present.
        monkeypatch.setattr(torch, "accelerator", _torch_2_6_accelerator(available=False))
        assert get_current_device() == torch.device("cpu")

    def test_torch_without_torch_accelerator(self, monkeypatch):
        monkeypatch.delattr(torch, "accelerator")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert get_current_device() == torch.device("cpu")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        assert get_current_device() == torch.device("cuda", 1)

    def test_the_running_torch(self):
        want = torch.accelerator.current_accelerator(check_available=True)
        if want is None:
            assert get_current_device() == torch.device("cpu")
        else:
            assert get_current_device() == torch.device(
                want.type, torch.accelerator.current_device_index()
            )
