"""Bf16Activations: a float32 tensor that only bf16 kernels read travels between kernels as bf16.

At ``--precision bf16`` a conv or matmul kernel rounds its float32 input to bf16 in its own
prologue (``frontend/bf16_matmul.bf16_bits``), so a feature map between two kernels is written
and read as 4 bytes a value where the product uses 2; on a memory-bound CNN that traffic is
most of the time. Where every kernel that reads a tensor reads it only through that rounding,
the kernel that writes it rounds instead (the same rounding of the same float32 value, so the
results are bit for bit those of the float32 tensor) and stores the 16 bits; the readers load
them as they are. A tensor something else reads (a residual add, a depthwise conv, an SE
gate's multiply before the rounding, the model's output) stays float32, and so does one whose
writer reads it back (a sum accumulated in its output) or is not a float32 conv or matmul
(``_writes_bf16``: a depthwise conv's map into a pointwise bf16 conv is the case that pays).

It runs after the schedules, on the scheduled PrimFuncs: the rules match and tile the kernels
as written, and a tuning record keeps its kernel's hash. A kernel called where some of its
tensors change and elsewhere where they do not is copied (``_bf16`` in its name).
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import TensorLoad

from ..frontend.bf16_matmul import bf16_bits
from ..kernels.costs import has_contraction
from .restore_tile_config import configures_tiles

CALL_TIR = tvm.ir.Op.get("relax.call_tir")
SUFFIX = "_bf16"  # a kernel's copy for the calls whose tensors change


def copied_from(name: str) -> str:
    """The kernel a copy's name (``NAME_bf16``, ``NAME_bf16<k>``) was copied from; else the name."""
    head, found, tail = name.rpartition(SUFFIX)
    return head if found and (not tail or tail.isdigit()) else name


@dataclasses.dataclass(frozen=True)
class _Site:
    """One call_tir: the Relax function and binding it is in, the kernel, its tensor arguments."""

    function: tvm.ir.GlobalVar
    var: relax.Var
    kernel: tvm.ir.GlobalVar
    args: tuple


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.Bf16Activations")
class Bf16Activations:
    """float32 tensors between kernels as bf16 where only bf16 roundings read them; ``log``
    (kernel -> schedule rule) gets each copied kernel's rule under its new name."""

    def __init__(self, log: dict[str, str] | None = None):
        self.log = log

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        sites, other_uses = _call_sites(mod)
        kernels = {gvar: func for gvar, func in mod.functions_items() if isinstance(func, tirx.PrimFunc)}
        readers: dict = {}  # tensor -> [(kernel, argument index)]
        for site in sites:
            for index, arg in enumerate(site.args):
                if isinstance(arg, relax.Var):
                    readers.setdefault(arg, []).append((site.kernel, index))
        reads_bits = {key: _reads_bf16(kernels[key[0]], key[1]) is not None
                      for key in {key for keys in readers.values() for key in keys}}
        narrowed = {site.var for site in sites
                    if site.var not in other_uses and site.var in readers and site.kernel not in other_uses
                    and _writes_bf16(kernels[site.kernel], len(site.args))
                    and all(reads_bits[key] and key[0] not in other_uses for key in readers[site.var])}
        if not narrowed:
            return mod
        changes = {site.var: (frozenset(i for i, arg in enumerate(site.args) if arg in narrowed), site.var in narrowed)
                   for site in sites}
        return _rewrite(mod, sites, kernels, changes, self.log)


def _call_sites(mod: tvm.IRModule) -> tuple[list[_Site], set]:
    """Every call_tir of one tensor result bound in a Relax function, and the variables read
    anywhere but as an argument of one (a function's result, a tuple, another op) with the
    kernels called otherwise."""
    sites, other_uses = [], set()
    for gvar, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                args = value.args[1].fields if (isinstance(value, relax.Call) and value.op.same_as(CALL_TIR)
                                                and isinstance(value.args[1], relax.Tuple)) else None
                if args is not None and len(value.args) == 2 and isinstance(value.ty, relax.TensorType):
                    sites.append(_Site(gvar, binding.var, value.args[0], tuple(args)))
                else:  # its variables, and the kernels it calls (a call with shape vars): left as they are
                    relax.analysis.post_order_visit(value, lambda e: other_uses.add(e) if isinstance(
                        e, (relax.Var, tvm.ir.GlobalVar)) else None)
        relax.analysis.post_order_visit(func.body.body, lambda e: other_uses.add(e) if isinstance(e, relax.Var)
                                        else None)
    return sites, other_uses


def _loads(node, buffer: tirx.Buffer) -> list:
    """The loads of ``buffer`` in ``node``."""
    found: list = []
    tvm_ffi.structural_walk(node, (TensorLoad, lambda load: found.append(load) if load.source.same_as(buffer) else None))
    return found


def _writes_bf16(func: tirx.PrimFunc, inputs: int) -> bool:
    """Whether the kernel's one output (after ``inputs`` parameters) is a float32 buffer it only
    stores to (a sum accumulated in it is read back: its partial sums must stay float32), from
    a float32 conv or matmul (a contraction) without AMX tiles. Measured against their float32
    stores, the rounding in other writers' epilogues cost more than the bytes saved: an AMX
    conv's epilogue per tile (nudenet-yolov8n's convs, up to 1.4x slower alone) and an
    element-wise kernel of selects (basic-pitch's harmonic stacking, 1.7x)."""
    if len(func.params) != inputs + 1:
        return False
    out = func.params[inputs]
    return (str(out.dtype) == "float32" and not _loads(func.body, out) and has_contraction(func)
            and not configures_tiles(func))


def _bf16_buffer(buffer: tirx.Buffer) -> tirx.Buffer:
    """A buffer of ``buffer``'s shape and layout holding bf16 bits."""
    return buffer.with_dtype("uint16")


def _reads_bf16(func: tirx.PrimFunc, index: int) -> tirx.PrimFunc | None:
    """``func`` with float32 parameter ``index`` taken as bf16 bits, where every read of it is
    the bf16 rounding of a load (that rounding becomes the load of the bits); else None."""
    old = func.params[index]
    if str(old.dtype) != "float32":
        return None
    new = _bf16_buffer(old)

    def rounded(cast: tirx.Cast):
        """The rounding of a load (``bf16_bits`` but its NaN test, which TVM's simplifier drops)."""
        loads = _loads(cast, old)
        if not loads or not tvm_ffi.structural_equal(cast, bf16_bits(loads[0]).false_value):
            return cast
        return tirx.BufferLoad(new, loads[0].indices)

    def nan_test(select: tirx.Select):
        """``bf16_bits``'s NaN test around a rounding replaced: the bits are the value's already."""
        if (isinstance(select.false_value, TensorLoad) and select.false_value.source.same_as(new)
                and isinstance(select.condition, tirx.NE) and _loads(select.condition, old)):
            return select.false_value
        return select

    body = tvm_ffi.structural_map(func.body, [(tirx.Cast, rounded)])
    body = tvm_ffi.structural_map(body, [(tirx.Select, nan_test)])
    if body.same_as(func.body) or _loads(body, old):
        return None  # not read, or read otherwise too
    return _with_buffer(func.with_body(body), old, new)


def _with_buffer(func: tirx.PrimFunc, old: tirx.Buffer, new: tirx.Buffer) -> tirx.PrimFunc:
    """``func`` with ``old`` (a parameter's buffer) replaced by ``new`` everywhere, made anew so
    that its type (what a call of it is checked against) names the new parameter."""
    mapped = tvm_ffi.structural_map(func, [(tirx.Buffer, lambda b: new if b.same_as(old) else b)])
    return tirx.PrimFunc(mapped.params, mapped.body, mapped.ret_type, mapped.attrs)


def _writes_bits(func: tirx.PrimFunc, index: int) -> tirx.PrimFunc:
    """``func`` storing the bf16 rounding of each value of its output ``index``, the value
    bound once (``bf16_bits`` reads it four times)."""
    old = func.params[index]
    new = _bf16_buffer(old)

    def store(stmt: tirx.BufferStore) -> tirx.BufferStore:
        if not stmt.buffer.same_as(old):
            return stmt
        value = tirx.Var("value", "float32")
        return tirx.BufferStore(new, tirx.Let(value, stmt.value, bf16_bits(value)), stmt.indices)

    body = tvm_ffi.structural_map(func.body, [(tirx.BufferStore, store)])
    return _with_buffer(func.with_body(body), old, new)


def _variant(func: tirx.PrimFunc, inputs: frozenset[int], output: bool) -> tirx.PrimFunc:
    for index in sorted(inputs):
        func = _reads_bf16(func, index)
    return _writes_bits(func, len(func.params) - 1) if output else func


def _rewrite(mod: tvm.IRModule, sites: list[_Site], kernels: dict, changes: dict, log) -> tvm.IRModule:
    """The module with each call site's kernel replaced by its variant (in place where every
    call of the kernel takes the same one, else a copy) and the narrowed tensors typed uint16.
    A changed kernel is added anew under its name (its GlobalVar's type names its parameters)."""
    by_kernel: dict = {}
    for site in sites:
        by_kernel.setdefault(site.kernel, set()).add(changes[site.var])
    unchanged = (frozenset(), False)
    base = mod.clone()
    for gvar, variants in by_kernel.items():
        if len(variants) == 1 and unchanged not in variants:
            del base[gvar]
    mutator = _NarrowCalls(base, {site.var: site for site in sites}, changes)
    builder = mutator.builder_
    for gvar, variants in by_kernel.items():
        for change in variants:
            if change == unchanged:
                mutator.targets[(gvar, change)] = gvar
                continue
            in_place = len(variants) == 1
            target = builder.add_func(_variant(kernels[gvar], *change), gvar.name_hint + ("" if in_place else SUFFIX))
            mutator.targets[(gvar, change)] = target
            if log is not None and gvar.name_hint in log and not in_place:
                log[target.name_hint] = log[gvar.name_hint]
    for gvar in {site.function for site in sites}:
        builder.update_func(gvar, mutator.visit_expr(mod[gvar]))
    return builder.get()


@relax.expr_functor.mutator
class _NarrowCalls(relax.expr_functor.PyExprMutator):
    """Each call_tir to its kernel's variant, a narrowed output typed uint16."""

    def __init__(self, mod, site_of: dict, changes: dict):
        super().__init__(mod)
        self.site_of, self.changes = site_of, changes
        self.targets: dict = {}  # (kernel, change) -> the GlobalVar its calls take

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        site = self.site_of.get(binding.var)
        if site is None:
            super().visit_var_binding_(binding)
            return
        change = self.changes[binding.var]
        args = [self.visit_expr(arg) for arg in site.args]
        ty = binding.value.ty
        out_ty = relax.TensorType(ty.shape, "uint16") if change[1] else ty
        call = relax.call_tir(self.targets[(site.kernel, change)], args, out_ty)
        value = self.builder_.normalize(call)
        var = (relax.DataflowVar if isinstance(binding.var, relax.DataflowVar) else relax.Var)(binding.var.name, value.ty)
        self.builder_.emit_normalized(relax.VarBinding(var, value))
        self.set_var_remap(binding.var, var)
