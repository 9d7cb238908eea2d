"""The per-fusion numeric gate: each fused instance against the unfused computation of its nodes.

Verification against ONNX Runtime says *that* a model is wrong; the gate says *which fusion* is,
and takes it back. Each composite the fuse phase made is built twice:

* fused: the composite lowered and scheduled as ``compile`` does (one kernel);
* reference: its body with our legalizations but no fusion and no schedule (one naive kernel
  per op).

Both run on the same inputs: the composite's constant arguments (weights, masks) as they are
in the model, every other argument seeded random (a model compiled for a range of sizes at
each range's typical size) (floats standard normal, bools random, integers
zero, so that no index leaves its table). An instance passes when
``max |fused - reference| <= atol + rtol * max |reference|`` with the config's ``[verify]``
tolerances (scaled by the output's magnitude: a long conv or matmul reduction sums thousands of
products, and its cancellations make element-wise relative errors meaningless). An instance
outside it is undone: the fuse phase runs again with its bindings excluded, so its nodes compile
unfused, and the gate checks the new fusions until none fails.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .config import PipelineConfig
from .frontend.dims import DimRange, evaluate_dim
from .passes.pipeline import is_cpu, legalize_map
from .patterns.base import PatternInstance, PatternReport

_NODE_NAME = re.compile(r"^onnx(\d+)(?:_(\d+))?$")
MAX_ROUNDS = 4  # each round undoes at least one instance; more means fusions keep re-forming


@dataclasses.dataclass
class GateFailure:
    pattern: str
    variant: str
    bindings: list[str]
    onnx_nodes: list[str]
    max_abs_error: float
    allowed: float


@dataclasses.dataclass
class GateReport:
    checked: int
    undone: list[GateFailure]
    rtol: float
    atol: float

    @property
    def undone_bindings(self) -> frozenset[str]:
        """The bindings of every fusion the gate undid: what stays unfused in another build."""
        return frozenset(name for failure in self.undone for name in failure.bindings)

    def to_json(self) -> dict:
        return {"checked": self.checked, "rtol": self.rtol, "atol": self.atol,
                "undone": [dataclasses.asdict(f) for f in self.undone]}


def composite_calls(module) -> list[tuple[object, list]]:
    """(composite GlobalVar, call arguments) for every composite call in ``main``, in order."""
    found = []
    for block in module["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
                func = module[value.op]
                if func.attrs and "Composite" in func.attrs:
                    found.append((value.op, list(value.args)))
    return found


def check_fusions(module, report: PatternReport, config: PipelineConfig,
                  lower_and_schedule: Callable) -> tuple[int, list]:
    """(instances checked, [(instance, max abs error, allowed)] of those outside tolerance).

    ``lower_and_schedule(module, config)`` builds the fused side as compile does."""

    calls = composite_calls(module)
    if not calls:
        return 0, []
    fused = tvm.IRModule()
    reference = tvm.IRModule()
    for gvar, func in module.functions_items():  # kernels a composite calls (our EyeLike's, say)
        if isinstance(func, tvm.tirx.PrimFunc):
            fused[gvar] = func
            reference[gvar] = func
    groups = _alike_calls(module, calls)
    for index in groups:
        gvar, args = calls[index]
        composite = module[gvar]
        params = [relax.Var(p.name, p.ty) for p in composite.params]
        fused[gvar] = composite
        # The model's constants (weights) stay constants in the fused call, as in compile: the
        # schedule phase transforms them once (Winograd, packed panels), and the kernel is the
        # one compile builds (with them as parameters, a Winograd kernel would transform its
        # weight in each call, and its build took nudenet's gate from 21 to 54 s).
        call_args = [arg if _is_constant(arg) else param for arg, param in zip(args, params)]
        wrapper_params = [param for arg, param in zip(args, params) if not _is_constant(arg)]
        # A global symbol makes each an entry point, which dead-code elimination keeps.
        fused[f"fused_{index}"] = relax.Function(wrapper_params, relax.Call(gvar, call_args),
                                                 composite.ret_ty).with_attr("global_symbol", f"fused_{index}")
        reference[f"reference_{index}"] = composite.without_attr("Composite").without_attr("Primitive").with_attr(
            "global_symbol", f"reference_{index}")
    fused = relax.transform.Normalize()(fused)
    fused = lower_and_schedule(fused, config)
    # The direct conv is the reference a Winograd conv is checked against.
    legalize = legalize_map(config.fast_math, winograd=False, cpu=is_cpu(config))
    reference = relax.transform.LegalizeOps(legalize)(reference)
    target = config.tvm_target()
    fused_vm = relax.VirtualMachine(tvm.compile(fused, target=target), tvm.cpu())
    reference_vm = relax.VirtualMachine(tvm.compile(reference, target=target), tvm.cpu())
    rng = np.random.default_rng(config.seed)
    failures = []
    instances = instances_in_call_order(report, len(calls))
    sizes = typical_sizes(module)
    for index, members in groups.items():
        gvar, args = calls[index]
        inputs = [_argument(arg, rng, sizes) for arg in args]
        got = _arrays(fused_vm[f"fused_{index}"](*[x for x, arg in zip(inputs, args) if not _is_constant(arg)]))
        want = _arrays(reference_vm[f"reference_{index}"](*inputs))
        error, allowed = 0.0, 0.0
        for a, b in zip(got, want):
            b = b.astype(np.float64)
            error = max(error, float(np.abs(a.astype(np.float64) - b).max(initial=0.0)))
            allowed = max(allowed, config.atol + config.rtol * float(np.abs(b).max(initial=0.0)))
        if not error <= allowed:  # NaN fails too: every call of the same kernel on the same constants fails
            failures += [(instances[member] if instances else instance_of(module[calls[member][0]], report), error,
                          allowed) for member in members]
    return len(calls), failures


def _alike_calls(module, calls: list) -> dict[int, list[int]]:
    """The calls grouped by what they compute: equal composites on the same constants and inputs
    of the same types (an unrolled decoder's steps, thousands of calls of a few kernels), each
    group under its first call. One check stands for the group: its other calls run the same
    code on the same weights, and the other inputs are random either way."""
    groups: dict[int, list[int]] = {}
    seen: dict[tuple, list[int]] = {}  # structural hashes -> the groups' first calls
    hashes: dict = {}  # each composite and weight hashed once, however many calls share it

    def hash_of(node) -> int:
        if node not in hashes:
            hashes[node] = tvm_ffi.structural_hash(node)
        return hashes[node]

    for index, (gvar, args) in enumerate(calls):
        key = (hash_of(module[gvar]),
               *(hash_of(arg) if _is_constant(arg) else tvm_ffi.structural_hash(arg.ty) for arg in args))
        first = next((other for other in seen.get(key, []) if _alike(module, calls[other], (gvar, args))), None)
        if first is None:
            seen.setdefault(key, []).append(index)
            groups[index] = [index]
        else:
            groups[first].append(index)
    return groups


def _alike(module, first: tuple, second: tuple) -> bool:
    (gvar_a, args_a), (gvar_b, args_b) = first, second
    if len(args_a) != len(args_b) or not tvm_ffi.structural_equal(module[gvar_a], module[gvar_b]):
        return False
    for a, b in zip(args_a, args_b):
        if _is_constant(a) != _is_constant(b):
            return False
        if not tvm_ffi.structural_equal(a if _is_constant(a) else a.ty, b if _is_constant(b) else b.ty):
            return False
    return True


def _is_constant(arg) -> bool:
    return isinstance(arg, tvm.ir.GenericConst)


def typical_sizes(module) -> dict[str, int]:
    """Each symbolic dim of ``main`` at its range's typical size (from the bounds the importer
    recorded), by name."""
    attrs = module["main"].attrs or {}
    low, high = attrs.get("tir_var_lower_bound", {}), attrs.get("tir_var_upper_bound", {})
    return {str(name): DimRange(str(name), int(low[name]), int(high[name])).typical for name in high}


def _argument(arg, rng: np.random.Generator, sizes: dict[str, int]):
    """A composite's argument as the VM takes it: a tensor, or a shape (a symbolic output size
    that stayed a parameter) at ``sizes``."""
    value = getattr(arg, "value", None)  # a relax constant (TVM 0.27 names no Constant class)
    if hasattr(value, "numpy"):
        return tvm.runtime.tensor(value.numpy())
    if isinstance(arg.ty, relax.ShapeType):
        return tvm.runtime.ShapeTuple([evaluate_dim(d, sizes) for d in arg.ty.values])
    shape = [evaluate_dim(d, sizes) for d in arg.ty.shape.values]
    dtype = str(arg.ty.dtype)
    if dtype == "bool":
        array = rng.random(shape) < 0.5
    elif "float" in dtype:
        array = rng.standard_normal(shape).astype(dtype)
    else:
        array = np.zeros(shape, dtype)
    return tvm.runtime.tensor(array)


def _arrays(result) -> list[np.ndarray]:
    return [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]


def instances_in_call_order(report: PatternReport, calls: int) -> list[PatternInstance] | None:
    """The fusion instances in the order of their composite calls in ``main``, or None.

    Identical composites share one function, so a call, not a function, names an instance.
    Each call stands where its last absorbed binding stood; with the node-named import
    (``onnx<node>_<k>``) that order is the bindings' order."""
    def last_position(instance: PatternInstance):
        positions = [tuple(int(g or 0) for g in m.groups()) for m in map(_NODE_NAME.match, instance.absorbed) if m]
        return max(positions) if positions else None

    fusions = [i for i in report.instances if i.variant != i.pattern]
    keys = [last_position(i) for i in fusions]
    if len(fusions) != calls or None in keys:
        return None
    return [instance for _, instance in sorted(zip(keys, fusions), key=lambda pair: pair[0])]


def instance_of(composite, report: PatternReport) -> PatternInstance:
    """The recorded instance a composite came from: the fusion sharing most binding names
    (a fallback when the bindings are not named after nodes)."""
    names = {b.var.name for block in composite.body.blocks for b in block.bindings}
    pattern = str(composite.attrs["Composite"])
    candidates = [i for i in report.instances if i.variant.startswith(pattern)]
    return max(candidates, key=lambda i: len(names & set(i.absorbed)))


def gated_fuse(fuse: Callable[[frozenset], tuple[object, PatternReport]], config: PipelineConfig,
               lower_and_schedule: Callable, onnx_nodes: Callable[[list[str]], list[str]] = lambda _names: [],
               say: Callable[[str], None] = lambda _m: None) -> tuple[object, PatternReport, GateReport]:
    """``fuse(excluded)`` runs the graph phases; rerun it without each failing instance."""
    excluded: frozenset[str] = frozenset()
    undone: list[GateFailure] = []
    checked = 0
    for _ in range(MAX_ROUNDS):
        module, report = fuse(excluded)
        count, failures = check_fusions(module, report, config, lower_and_schedule)
        checked = max(checked, count)
        if not failures:
            break
        for instance, error, allowed in failures:
            failure = GateFailure(instance.pattern, instance.variant, list(instance.absorbed),
                                  onnx_nodes(instance.absorbed), error, allowed)
            undone.append(failure)
            say(f"fusion gate: undid {failure.variant} over {', '.join(failure.onnx_nodes or failure.bindings)}: "
                f"max abs error {error:.3g} > {allowed:.3g} against the unfused nodes")
            excluded |= set(instance.absorbed)
    else:
        module, report = fuse(excluded)  # the last round's failures undone, not checked again
    return module, report, GateReport(checked, undone, config.rtol, config.atol)
