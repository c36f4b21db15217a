"""Parallel layouts and Megatron's parallel state inside a worker process."""

import argparse
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_r3.rl.arguments import parallel_settings, parse_args
from megatron_r3.rl.initialize import init_model_parallel
from tests.support.launcher import worker_device


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way of spreading a model over ranks.

    Attributes:
        tp: Tensor-parallel size.
        sp: Sequence parallelism (needs ``tp > 1``).
        pp: Pipeline-parallel size.
        vp: Virtual pipeline stages per rank (interleaved 1F1B), or ``None``.
        cp: Context-parallel size.
        ep: Expert-parallel size.
        etp: Expert tensor-parallel size (``None``: Megatron's default, ``tp``).
        dp: Data-parallel size; the world size is ``tp * cp * pp * dp``.
        dispatcher: MoE token dispatcher, ``"alltoall"`` or ``"allgather"``.
        first_stage_layers: ``num_layers_in_first_pipeline_stage`` (uneven PP).
        last_stage_layers: ``num_layers_in_last_pipeline_stage`` (uneven PP).
        recompute: ``None``, ``"full"`` (uniform, one layer per checkpoint) or
            ``"selective"`` (Megatron's default selective modules).
        packed: Packed THD sequences instead of BSHD batches.
    """

    tp: int = 1
    sp: bool = False
    pp: int = 1
    vp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    dp: int = 1
    dispatcher: str = "alltoall"
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    recompute: Optional[str] = None
    packed: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def name(self) -> str:
        """A short id for test names, e.g. ``tp2-sp-ep2-dp2-alltoall``."""
        parts = []
        for field in ("tp", "pp", "vp", "cp", "ep", "etp", "dp"):
            value = getattr(self, field)
            if value not in (None, 1):
                parts.append(f"{field}{value}")
                if field == "tp" and self.sp:
                    parts.append("sp")
        if self.first_stage_layers is not None:
            parts.append(f"first{self.first_stage_layers}")
        if self.last_stage_layers is not None:
            parts.append(f"last{self.last_stage_layers}")
        if self.ep > 1:
            parts.append(self.dispatcher)
        if self.packed:
            parts.append("thd")
        if self.recompute:
            parts.append(f"recompute-{self.recompute}")
        return "-".join(parts) or "single"

    @property
    def flags(self) -> list[str]:
        """The launcher's flags for this layout (the data-parallel size follows from the world size)."""
        flags = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
                 "--context-parallel-size", str(self.cp), "--expert-model-parallel-size", str(self.ep),
                 "--moe-token-dispatcher-type", self.dispatcher]
        for flag, value in (("--num-virtual-stages-per-pipeline-rank", self.vp),
                            ("--expert-tensor-parallel-size", self.etp),
                            ("--decoder-first-pipeline-num-layers", self.first_stage_layers),
                            ("--decoder-last-pipeline-num-layers", self.last_stage_layers)):
            if value is not None:
                flags += [flag, str(value)]
        if self.sp:
            flags.append("--sequence-parallel")
        if self.recompute == "full":
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        elif self.recompute == "selective":
            flags += ["--recompute-granularity", "selective"]
        return flags


def init_parallel(layout: Layout, seed: int = 1234, args: Optional[argparse.Namespace] = None) -> torch.device:
    """Set up Megatron's parallel state (as the launcher does, from ``layout.flags``) and RNG in this worker.

    Args:
        layout: The layout; its world size must match the process group's.
        seed: Seed of Megatron's RNG tracker (dropout, sharded init).
        args: The launcher's flags of the layout and the model, where the model decides the
            parallel state (a ``--hybrid-layer-pattern``'s segments make the virtual pipeline
            stages); default: the layout's flags.

    Returns:
        The device this rank computes on.
    """
    assert dist.get_world_size() == layout.world_size, (dist.get_world_size(), layout)
    # The launcher's defaults for the rest: only the parallel sizes are read. No test needs
    # Megatron's gloo copies of its groups (each one another group to build).
    init_model_parallel(parallel_settings(args or parse_args(layout.flags)), create_gloo_process_groups=False)
    device = worker_device()
    # Without CUDA the series gives Megatron a CPU RNG tracker (same named states).
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return device

