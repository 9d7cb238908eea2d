"""SplitWideConcats: a concat or stack of many tensors as a two-level tree of narrow ones.

An unrolled decoder concatenates one tensor per step: slanet-table's 501-step Loop ends in
concats of 500 tensors, which FuseOps makes kernels of 500 buffers, each with the adds that
produce them. Such a kernel is costly twice over:

- its packed-function wrapper checks every buffer in one basic block, hundreds of thousands
  of instructions that LLVM takes 96 s and 2.6 GB to emit (two of them were the whole of
  slanet-table's export over its memory budget);
- TOPI's concatenate picks each output element's source through a chain of selects as long as
  the list of inputs.

Here the inputs are concatenated in chunks of ``CHUNK`` (the producers still fuse into each
chunk, as before), and the chunks' results by a concat that FuseOps keeps apart (its kernel is
marked opaque): otherwise it would fuse the chunks back into one kernel of every input. The
price is one more copy of the result, which is small next to the steps that made it. A stack
splits the same way: the stacks of the chunks, concatenated along the stacked axis.
"""

from __future__ import annotations

import tvm
from tvm import relax, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

#: The most tensors one concat kernel takes. Each chunk's kernel also takes what its fused
#: producers read, a few buffers per input at most.
CHUNK = 32

#: ``OpPatternKind::kOpaque``: FuseOps fuses nothing into or across such a kernel.
_OPAQUE = 8

_CONCAT = tvm.ir.Op.get("relax.concat")
_STACK = tvm.ir.Op.get("relax.stack")


@tvm.transform.module_pass(opt_level=0, name="SplitWideConcats")
class SplitWideConcats:
    """Split each concat or stack of more than ``CHUNK`` tensors (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
                splitter = _Splitter(mod)
                rewritten = splitter.visit_expr(func)
                if splitter.rewrote:
                    mod = splitter.builder_.get()
                    mod[gvar] = rewritten
        return mod


@mutator
class _Splitter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewrote = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not (call.op.same_as(_CONCAT) or call.op.same_as(_STACK)):
            return call
        parts = self._parts(call.args[0])
        if parts is None or len(parts) <= CHUNK:
            return call
        axis = int(call.attrs.axis) % call.ty.ndim
        narrow = relax.op.concat if call.op.same_as(_CONCAT) else relax.op.stack
        chunks = [self.builder_.emit(narrow(parts[start:start + CHUNK], axis))
                  for start in range(0, len(parts), CHUNK)]
        self.rewrote = True
        return self._kept_apart_concat(chunks, axis)

    def _parts(self, value: relax.Expr) -> list[relax.Expr] | None:
        """The tensors of a concat's tuple, also when the tuple is bound to a variable."""
        if isinstance(value, relax.Var):
            value = self.lookup_binding(value)
        return list(value.fields) if isinstance(value, relax.Tuple) else None

    def _kept_apart_concat(self, parts: list[relax.Expr], axis: int) -> relax.Expr:
        """The concat of ``parts`` in kernels FuseOps leaves alone, a tree of them past ``CHUNK``."""
        if len(parts) > CHUNK:
            parts = [self.builder_.emit(self._kept_apart_concat(parts[start:start + CHUNK], axis))
                     for start in range(0, len(parts), CHUNK)]
        call = self.builder_.call_te(lambda *tensors: topi.concatenate(tensors, axis), *parts,
                                     primfunc_name_hint="concatenate_chunks")
        gvar = call.args[0]
        self.builder_.update_func(gvar, self.builder_.get()[gvar].with_attr("op_pattern", _OPAQUE))
        return call
