"""tools/gpu_requirements.py: the pins make install and make wheelhouse add on a CUDA machine."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from gpu_requirements import fa4_requirements, te_version  # noqa: E402


@pytest.mark.parametrize("cuda_major, other", [("13", "12"), ("12", "13")])
def test_fa4_pins_take_the_cute_dsl_libraries_of_one_cuda_major(cuda_major, other):
    pins = fa4_requirements(cuda_major)
    names = [pin.partition("==")[0] for pin in pins]
    assert f"nvidia-cutlass-dsl-libs-cu{cuda_major}" in names
    assert f"nvidia-cutlass-dsl-libs-cu{other}" not in names
    assert "flash-attn-4" in names and "nvidia-cutlass-dsl-libs-core" in names
    assert all("==" in pin for pin in pins), pins  # every one pinned
    assert len(names) == len(set(names))


def test_te_version_is_install_sh_s():
    assert te_version() == "2.20.2"
    output = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_requirements.py"), "te-version"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert output == te_version()

