"""Build megatron_r3 and its csrc/ extension (megatron_r3._C).

The CPU kernels in csrc/*.cpp are always built. The CUDA kernels in csrc/*.cu
are added when torch has CUDA and nvcc is found (set R3_CPU_ONLY=1 to skip
them); the binding then defines R3_WITH_CUDA.
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def extensions():
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/*.cu"))
    if not cpp_sources:
        return []
    with_cuda = (
        bool(cuda_sources)
        and torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("R3_CPU_ONLY") != "1"
    )
    if with_cuda:
        return [
            CUDAExtension(
                "megatron_r3._C",
                cpp_sources + cuda_sources,
                define_macros=[("R3_WITH_CUDA", None)],
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]},
            )
        ]
    return [CppExtension("megatron_r3._C", cpp_sources, extra_compile_args=["-O3"])]


setup(
    name="megatron-r3",
    version="0.1.0",
    description="Rollout routing replay (R3) for Megatron-Core MoE training",
    packages=find_packages(include=["megatron_r3", "megatron_r3.*"]),
    python_requires=">=3.10",
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
