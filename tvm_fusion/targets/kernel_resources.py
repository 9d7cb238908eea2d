"""What ptxas reports for CUDA kernels, compiled without a GPU: registers, shared memory, spills.

Compile-only figures: ``nvcc -cubin -Xptxas -v`` on the CUDA source TVM generated, for one arch.
A kernel that spills (or keeps an array in local memory) shows a stack frame or spill bytes;
registers bound the threads an SM keeps resident.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .toolchain import NVCC


@dataclass(frozen=True)
class KernelResources:
    registers: int
    shared_bytes: int
    stack_bytes: int  # the local-memory frame: arrays and spilled registers
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spills(self) -> bool:
        return bool(self.stack_bytes or self.spill_store_bytes or self.spill_load_bytes)

    def as_dict(self) -> dict:
        return asdict(self)


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def kernel_resources(cuda_source: str, arch: str) -> dict[str, KernelResources]:
    """Each ``__global__`` kernel of ``cuda_source`` compiled for ``arch`` (``sm_90``) by ptxas."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernels.cu"
        source.write_text(cuda_source)
        run = subprocess.run([NVCC.require("cuda"), "-cubin", f"-arch={arch}", "-Xptxas", "-v",
                              "-o", str(Path(folder) / "kernels.cubin"), str(source)],
                             capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed: {run.stderr.strip()[-2000:]}")
    return parse_ptxas_report(run.stderr)


def parse_ptxas_report(report: str) -> dict[str, KernelResources]:
    """``ptxas -v`` lines (an entry, its frame, its registers) per kernel."""
    found: dict[str, KernelResources] = {}
    kernel, frame = None, (0, 0, 0)
    for line in report.splitlines():
        if entry := _ENTRY.search(line):
            kernel, frame = entry.group(1), (0, 0, 0)
        elif (match := _FRAME.search(line)) and kernel:
            frame = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
        elif (match := _USED.search(line)) and kernel:
            found[kernel] = KernelResources(int(match.group(1)), int(match.group(2) or 0), *frame)
            kernel = None
    return found
