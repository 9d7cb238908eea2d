"""Fixtures for the per-target tests: tools that scripts/setup_targets.sh installs.

Tests that need the cross toolchain, qemu or cuobjdump skip with the command to install them
on a developer machine, but fail in CI (CI=true): .ci/run installs them, so a missing tool
there is a broken setup, not a reason to skip.
"""

from __future__ import annotations

import pytest
from target_helpers import require


@pytest.fixture(scope="session")
def aarch64_tools():
    from tvm_fusion import targets

    for tool in (targets.AARCH64_GCC, targets.AARCH64_GXX, targets.QEMU_AARCH64):
        require(tool.path() is not None, f"{tool.command} ({tool.package})")
    require((targets.aarch64_runtime_dir() / "libtvm_runtime.so").is_file(), "the aarch64 TVM runtime")


@pytest.fixture(scope="session")
def cuda_tools():
    from tvm_fusion import targets

    require(targets.NVCC.path() is not None, "nvcc")
    require(targets.CUOBJDUMP.path() is not None, "cuobjdump (nvidia-cuda-cuobjdump)")
