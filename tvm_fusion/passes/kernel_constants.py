"""Kernels whose constant argument the build transforms once, for every call (a matmul weight
packed in column panels, a conv weight in Winograd's transformed form): the calls, and the
rewrite of the kernel and of the constant each call passes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np
import tvm
from tvm import relax, s_tir, tirx


@dataclass(frozen=True)
class ConstantRewrite:
    """A kernel's new body, and what every call passes as its argument ``param`` instead:
    ``transform`` of the old constant (computed once per constant and ``key``)."""

    kernel: tirx.PrimFunc
    param: int
    key: Hashable
    transform: Callable[[np.ndarray], np.ndarray]


def calls_by_kernel(mod: tvm.IRModule) -> dict:
    """GlobalVar -> the ``call_tir`` calls of it, over every Relax function of ``mod``."""
    calls: dict = {}
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir) and isinstance(expr.args[1], relax.Tuple):
            calls.setdefault(expr.args[0], []).append(expr)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return calls


def constant_at_every_call(calls: list, param: int) -> bool:
    """Whether there are calls and each passes a constant as argument ``param`` (a weight
    computed at run time, or a kernel nobody calls, stays as it is)."""
    return bool(calls) and all(isinstance(_arguments(call)[param], tvm.ir.GenericConst) for call in calls)


def rewrite_kernels(mod: tvm.IRModule, rewrites: dict[str, ConstantRewrite]) -> tvm.IRModule:
    """``mod`` with each kernel named in ``rewrites`` replaced and its calls passing the
    transformed constant."""
    if not rewrites:
        return mod
    # A kernel's signature changes, so it gets a new GlobalVar (its type is the signature's)
    # under its old name, and every call is rewritten to it.
    kept = {gvar: func for gvar, func in mod.functions_items() if gvar.name_hint not in rewrites}
    builder = relax.BlockBuilder(tvm.IRModule(kept, attrs=mod.attrs, global_infos=mod.global_infos))
    gvars = {name: builder.add_func(rewrite.kernel, name) for name, rewrite in rewrites.items()}
    mod = builder.get()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _TransformConstants(mod, rewrites, gvars).visit_expr(func)
    return mod


def without_root_statements(body: s_tir.SBlockRealize, drop: Callable, buffers: Callable = lambda buf: False
                            ) -> s_tir.SBlockRealize:
    """A kernel's body without the root's top-level statements ``drop`` selects, nor the root's
    buffers ``buffers`` selects (a kernel rewritten for a transformed constant loses the loop
    nests that checked or computed that constant)."""
    root = body.block
    stmts = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    kept = [stmt for stmt in stmts if not drop(stmt)]
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                        kept[0] if len(kept) == 1 else tirx.SeqStmt(kept),
                        alloc_buffers=[buf for buf in root.alloc_buffers if not buffers(buf)],
                        annotations=root.annotations)
    return s_tir.SBlockRealize([], True, root)


def _arguments(call: relax.Call) -> list:
    return list(call.args[1].fields)


@relax.expr_functor.mutator
class _TransformConstants(relax.PyExprMutator):
    """Every call of a rewritten kernel (by name) passes its constant transformed, each once."""

    def __init__(self, mod: tvm.IRModule, rewrites: dict[str, ConstantRewrite], gvars: dict):
        super().__init__(mod)
        self.rewrites = rewrites
        self.gvars = gvars
        self.done: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op.same_as(tvm.ir.Op.get("relax.call_tir")) and call.args[0].name_hint in self.rewrites:
            name = call.args[0].name_hint
            rewrite = self.rewrites[name]
            args = _arguments(call)
            args[rewrite.param] = self._transformed(args[rewrite.param], rewrite)
            call = relax.Call(call.op, [self.gvars[name], relax.Tuple(args), *call.args[2:]], call.attrs, call.ty_args)
        return call

    def _transformed(self, constant: tvm.ir.GenericConst, rewrite: ConstantRewrite) -> tvm.ir.GenericConst:
        key = (constant, rewrite.key)
        if key not in self.done:
            self.done[key] = relax.const(rewrite.transform(constant.value.numpy()))
        return self.done[key]
