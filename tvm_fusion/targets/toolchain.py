"""Build tools per target: which command, which package brings it, and its version.

A missing tool is a ``ToolchainError`` naming the package to install (or the setup script,
which installs what every target needs).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import ToolchainError

SETUP_SCRIPT = "scripts/setup_targets.sh"


@dataclasses.dataclass(frozen=True)
class Tool:
    command: str
    package: str  # the Debian package (or pip package, for "pip:..." ) that provides it
    purpose: str

    def path(self) -> str | None:
        if os.sep in self.command:
            return self.command if os.access(self.command, os.X_OK) else None
        return shutil.which(self.command) or _venv_tool(self.command)

    def require(self, target_name: str) -> str:
        found = self.path()
        if found is None:
            install = (f"pip install {self.package.removeprefix('pip:')}" if self.package.startswith("pip:")
                       else f"apt-get install -y {self.package}")
            raise ToolchainError(f"target {target_name}: {self.command} ({self.purpose}) is not installed",
                                 f"{install}, or run {SETUP_SCRIPT} (installs what every target needs)")
        return found


def _venv_tool(command: str) -> str | None:
    """Tools pip installs into the venv (cuobjdump) are found even when the venv is not activated."""
    candidate = Path(sys.prefix) / "bin" / command
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


GCC = Tool("gcc", "gcc", "links x86-64 libraries")
AARCH64_GCC = Tool("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu", "links aarch64 libraries")
AARCH64_GXX = Tool("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu", "builds the aarch64 test runner")
QEMU_AARCH64 = Tool("qemu-aarch64", "qemu-user", "runs aarch64 binaries on this machine")
NVCC = Tool("nvcc", "pip:nvidia-cuda-nvcc", "compiles CUDA kernels into a fatbin")
CUOBJDUMP = Tool("cuobjdump", "pip:nvidia-cuda-cuobjdump", "lists the device code in a fatbin")


@functools.cache
def tool_version(path: str) -> str:
    """First line of ``--version`` (nvcc: its last line, the build), for the artifact's metadata."""
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return path
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return path
    return lines[-2] if "nvcc" in Path(path).name and len(lines) > 1 else lines[0]
