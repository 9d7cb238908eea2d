"""RestoreTileConfig: a kernel with AMX tiles hands its caller's thread back the tile
configuration it found there.

Our AMX calls load their tile shapes only when the tiles hold other ones, and leave them loaded
for the next call (``schedules/cpu/amx_intrinsics.py``: ``ldtilecfg`` costs as much as a small
call's products). Other AMX code may not check: ONNX Runtime's int8 kernels load a thread's
configuration once and trust it after, so on a thread where our kernel changed it (or released
the tiles) its next ``tdpbusd`` computes with our shapes or dies of SIGILL. A process that runs
ONNX Runtime and our artifact on one thread (a user's, ``bench``) would hit that.

So each PrimFunc that configures tiles reads the calling thread's configuration first
(``sttilecfg``: zeros where none is loaded) and, at its end, puts it back if it changed:
``ldtilecfg`` of what it found, or ``tilerelease`` where none was loaded. The calling thread
runs the function's body, and one share of its parallel loops; the thread pool's other threads
run only TVM kernels, ours, which check before they use the tiles.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

CONFIGURE = "llvm.x86.ldtilecfg"
WORDS = 8  # the 64-byte configuration as int64 words


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.RestoreTileConfig")
class RestoreTileConfig:
    """Wrap every PrimFunc that loads a tile configuration in a save and a restore of the
    calling thread's."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed = {gvar: _wrapped(func) for gvar, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc) and configures_tiles(func)}
        if not changed:
            return mod
        functions = dict(mod.functions_items())
        functions.update(changed)
        return tvm.IRModule(functions, mod.attrs, mod.global_infos)


def configures_tiles(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` loads a tile configuration (an AMX call's ``ldtilecfg``: a call of
    ``call_llvm_intrin`` whose first argument is that LLVM intrinsic's id)."""
    configure = tirx.call_llvm_intrin("void", CONFIGURE)
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.ir.Call, lambda call: found.append(call) if (
        call.op.same_as(configure.op) and call.args and isinstance(call.args[0], tirx.IntImm)
        and int(call.args[0]) == int(configure.args[0])) else None))
    return bool(found)


def _intrinsic(name: str, *args) -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_llvm_intrin("void", name, *args))


def _wrapped(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` whose root block saves the tile configuration first and restores it last."""
    saved, current = (tirx.decl_buffer((WORDS,), "int64", name=name, scope="local")
                      for name in ("caller_tile_config", "tile_config_after"))
    changed = _any_differs(saved, current)
    none_loaded = tirx.EQ(tirx.BufferLoad(saved, [0]) & tirx.const(0xFF, "int64"), tirx.const(0, "int64"))
    restore = tirx.IfThenElse(changed, tirx.IfThenElse(
        none_loaded, _intrinsic("llvm.x86.tilerelease"),
        _intrinsic(CONFIGURE, tirx.address_of(tirx.BufferLoad(saved, [0])))), None)
    realize = func.body
    root = realize.block
    body = tirx.SeqStmt([_intrinsic("llvm.x86.sttilecfg", tirx.address_of(tirx.BufferLoad(saved, [0]))), root.body,
                         _intrinsic("llvm.x86.sttilecfg", tirx.address_of(tirx.BufferLoad(current, [0]))), restore])
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                         [*root.alloc_buffers, saved, current], root.match_buffers, root.annotations)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, block))


def _any_differs(saved: tirx.Buffer, current: tirx.Buffer) -> tirx.PrimExpr:
    differs = [tirx.NE(tirx.BufferLoad(current, [i]), tirx.BufferLoad(saved, [i])) for i in range(WORDS)]
    result = differs[0]
    for term in differs[1:]:
        result = tirx.Or(result, term)
    return result
