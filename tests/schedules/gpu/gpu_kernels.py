"""Helpers for the GPU schedule tests (a plain module): lower small Relax graphs to kernels, build a
scheduled kernel for sm_90 into CUDA source, read its thread bindings and what ptxas reports.

No GPU is needed: kernels are built and inspected, never run. Their numbers are checked on a GPU
by the GPU pack (scripts/gpu_check.sh --pack; docs/gpu-check.md).
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import relax, s_tir

from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern

ARCH = "sm_90"
CUDA = tvm.target.Target({"kind": "cuda", "arch": ARCH}, host={"kind": "llvm"})
# ptxas keeps a kernel without spills under this many registers a thread (255 is the hardware cap);
# these kernels hold a few scalars a thread, their rows live in shared memory.
REGISTER_BOUND = 64


def kernel(build, shapes: dict, patterns: tuple[str, ...] = ()) -> tuple[str, tvm.tirx.PrimFunc]:
    """(name, PrimFunc) of the one kernel of ``build(*params)`` after the ``patterns`` fused it."""
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(bb, *params))
        bb.emit_func_output(out)
    mod = bb.get()
    if patterns:
        mod = FusePatterns([get_pattern(name) for name in patterns], PatternReport())(mod)
    mod = tvm.transform.Sequential(lowering_passes(cpu=False))(mod)
    [(name, func)] = [(gv.name_hint, f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return name, func


def cuda_source(func: tvm.tirx.PrimFunc) -> str:
    """The CUDA source of a scheduled kernel built for sm_90."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main").with_attr("tirx.is_scheduled", True)})
    built = tvm.compile(mod, target=CUDA)
    return built.mod.imports[0].inspect_source()  # the host module imports the CUDA one


def kernel_bodies(source: str) -> list[str]:
    """The body of each ``__global__`` kernel definition in ``source``."""
    return re.findall(r"__global__ void [^;{]*\{(.*?)\n\}", source, flags=re.DOTALL)


def thread_extents(func: tvm.tirx.PrimFunc) -> dict[str, set[int]]:
    """thread tag -> the extents of the loops bound to it."""
    found: dict[str, set[int]] = {}

    def visit(loop: tvm.tirx.For) -> None:
        if loop.kind == tvm.tirx.ForKind.THREAD_BINDING:
            found.setdefault(loop.thread_binding.thread_tag, set()).add(int(loop.extent))

    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, visit))
    return found


def readers(func: tvm.tirx.PrimFunc) -> dict[str, list[str]]:
    """buffer name -> the blocks that read it."""
    sch = s_tir.Schedule(func)
    found: dict[str, list[str]] = {}
    pending = [sch.get_sblock("root")]
    while pending:
        for block in sch.get_child_blocks(pending.pop()):
            pending.append(block)
            stmt = sch.get(block)
            for region in stmt.reads:
                found.setdefault(region.source.name, []).append(stmt.name_hint)
    return found
