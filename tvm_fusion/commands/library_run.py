"""How compile runs an exported library to check it (here, or under qemu-user), and builds CUDA
kernels as source for nvcc to compile at export."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import tvm

from ..export import return_freed_heap
from ..native_log import captured_native_stderr
from ..runtime import CompiledModel
from ..targets import run_emulated


def run_library(library: Path, metadata: dict, how: str, inputs: dict) -> dict:
    """Outputs by name of an exported library run in this process, or under qemu-user."""
    if how == "qemu":
        return run_emulated(library, metadata, inputs)
    # dlopen returns the library already loaded under a path: a second build staged at the same
    # path (auto's float32 rebuild) would run the first one's code. A link of a name of its own
    # opens this very file.
    unique = library.with_name(f"{library.stem}.check{next(LOADS)}{library.suffix}")
    os.link(library, unique)
    return_freed_heap()  # ONNX Runtime's reference session, just freed: the load below is the peak
    try:
        with captured_native_stderr([]):  # "Scope Loaded" per function
            module = tvm.runtime.load_module(str(unique))
    finally:
        unique.unlink()
    return CompiledModel(module, metadata).run(inputs)


LOADS = itertools.count()


class cuda_source_modules:
    """Have TVM keep CUDA kernels as source even where a CUDA runtime is loaded (a GPU host).

    Otherwise it would JIT-compile them (NVRTC by default) at build time; export then compiles
    the source with nvcc for the configured arch (targets.cuda_fatbin_packer) the same way on
    every machine.
    """

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        if self.active:
            self.saved = os.environ.get("TVM_COMPILE_FORCE_FALLBACK")
            os.environ["TVM_COMPILE_FORCE_FALLBACK"] = "1"

    def __exit__(self, *_exc):
        if self.active:
            if self.saved is None:
                os.environ.pop("TVM_COMPILE_FORCE_FALLBACK", None)
            else:
                os.environ["TVM_COMPILE_FORCE_FALLBACK"] = self.saved
