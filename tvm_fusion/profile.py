"""``tvm-fusion profile``: where a model's time goes, kernel by kernel, against this machine's roofs.

The model is compiled as ``compile`` does, from an import whose bindings are named after ONNX
nodes (``provenance``), so each kernel lists the nodes it covers. Everything is timed in one
process, in interleaved rounds, medians reported:

* end to end: ``main`` as a user calls it;
* each kernel on its own: inside a VM instrument hook, the kernel is run again on the very
  tensors the model just gave it (warm caches, the way a per-kernel benchmark times it);
* each kernel in the model: the hook's before/after time, minus the same hook around an empty
  kernel (the hook's own cost);
* dispatch: ``main`` of the same VM program with every kernel body emptied: VM interpretation,
  allocation and the calls themselves, with no kernel work.

The gap between the sum of kernel times and the end-to-end time is split into those parts.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .machine_peak import MachinePeak, machine_peak

Progress = Callable[[str], None]


@dataclasses.dataclass
class KernelProfile:
    name: str
    pattern: str            # the fusion pattern variant, or "tvm FuseOps" / "single op"
    rule: str               # the schedule rule
    kind: str               # conv, matmul, pool, injective, reduction, ... (for mining)
    calls: int
    us_per_call: float      # on its own, warm caches
    us_in_model: float      # per call, inside the model run
    share: float            # of the sum of kernel times (on their own)
    flops: int
    bytes: int              # parameters read and written once: the compulsory traffic
    gflops: float
    gbytes_per_s: float
    intensity: float        # FLOP per byte
    bound: str              # "compute" or "memory": which roof is lower at this intensity
    roof_percent: float     # achieved / the lower roof at this intensity
    onnx_nodes: list[str]

    @property
    def total_us(self) -> float:
        return self.us_per_call * self.calls


@dataclasses.dataclass
class Gap:
    """End to end against the kernels: where the time between them goes (ms per model run)."""

    end_to_end_ms: float
    kernels_alone_ms: float     # the kernels timed one by one, summed (x calls)
    kernels_in_model_ms: float  # the same kernels as the model runs them
    dispatch_ms: float          # the VM program with empty kernels: interpretation + allocation
    builtin_calls: dict[str, int]

    @property
    def gap_ms(self) -> float:
        return self.end_to_end_ms - self.kernels_alone_ms

    @property
    def in_model_extra_ms(self) -> float:
        """Kernels slower in the model than alone: cold caches, workers woken from sleep."""
        return self.kernels_in_model_ms - self.kernels_alone_ms

    @property
    def unexplained_ms(self) -> float:
        return self.end_to_end_ms - self.dispatch_ms - self.kernels_in_model_ms

    def line(self) -> str:
        return (f"gap: end to end {self.end_to_end_ms:.3f} ms - kernels alone {self.kernels_alone_ms:.3f} ms "
                f"= {self.gap_ms:.3f} ms: kernels slower in the model (cold caches, thread wake-up) "
                f"{self.in_model_extra_ms:.3f} ms, VM dispatch + allocation {self.dispatch_ms:.3f} ms, "
                f"other {self.unexplained_ms:.3f} ms")


@dataclasses.dataclass
class Chain:
    """Adjacent kernels no pattern fused, the intermediates passing through DRAM between them."""

    kernels: list[str]
    kinds: list[str]
    us: float               # their time per model run (calls of this exact chain: 1)
    saved_bytes: int        # intermediates written and read back, which a fusion would not
    gain_us: float          # estimate: saved bytes at the measured bandwidth + the saved launches

    @property
    def label(self) -> str:
        return " -> ".join(self.kinds)


@dataclasses.dataclass
class ProfileReport:
    model: str
    threads: int
    peak: MachinePeak
    kernels: list[KernelProfile]
    gap: Gap
    chains: list[Chain] | None = None

    def to_json(self) -> dict:
        return {"model": self.model, "threads": self.threads,
                "peak": {**dataclasses.asdict(self.peak), "ridge_flop_per_byte": self.peak.ridge},
                "kernels": [{**dataclasses.asdict(k), "total_us": k.total_us} for k in self.kernels],
                "gap": {**dataclasses.asdict(self.gap), "gap_ms": self.gap.gap_ms,
                        "in_model_extra_ms": self.gap.in_model_extra_ms,
                        "unexplained_ms": self.gap.unexplained_ms},
                "chains": None if self.chains is None else
                [{**dataclasses.asdict(c), "label": c.label} for c in self.chains]}


# Building: the module as compile builds it, each kernel traced to its ONNX nodes -------------

@dataclasses.dataclass
class ProfiledModule:
    module: object            # scheduled, ready to build
    lowered: object           # before schedules: FLOPs are counted here
    schedule_rules: dict[str, str]
    patterns: dict[str, str]  # kernel -> Composite name, or how it was grouped
    covers: dict[str, list[str]]  # kernel -> ONNX node names


def build_profiled(prepared, progress: Progress = lambda _m: None, tuning_log=None) -> ProfiledModule:
    """The configured pipeline on the node-named import, phase by phase, kernels traced."""
    import tvm

    from .build import load_tuning
    from .frontend import onnx as onnx_frontend
    from .passes import GRAPH_PHASES, fusion_pipeline
    from .passes.pipeline import lowering_passes
    from .patterns import PatternReport
    from .provenance import import_with_node_names, node_index

    cfg = prepared.config
    simplified = onnx_frontend.simplify(prepared.onnx_model, prepared.inputs)
    named = import_with_node_names(simplified, {s.name: list(s.shape) for s in prepared.inputs},
                                   {s.name: s.dtype for s in prepared.inputs})
    progress("running the tvm_fusion pipeline")
    report = PatternReport()
    fused = fusion_pipeline(cfg, report, phases=GRAPH_PHASES)(named)
    lowering = lowering_passes(cfg.fast_math)
    split = [p.info.name for p in lowering].index("FuseTIR")
    grouped = tvm.transform.Sequential(lowering[:split])(fused)
    patterns, covered = kernel_groups(grouped)
    lowered = tvm.transform.Sequential(lowering[split:])(grouped)
    rules: dict[str, str] = {}
    records = load_tuning(cfg, tuning_log, progress)
    module = fusion_pipeline(cfg, PatternReport(), phases=("schedule",), schedule_log=rules,
                             tuning=records)(lowered)
    fusions = [set(i.absorbed) for i in report.instances if i.variant != i.pattern]
    for names in covered.values():
        # FuseOpsByPattern renames the tail a composite absorbed (to gv, lv49, ...); its
        # instance has the node names. Only node names identify the instance.
        own = {name for name in names if node_index(name, simplified) is not None}
        names += [name for absorbed in fusions if absorbed & own for name in absorbed]
    covers = {kernel: onnx_nodes_of(names, report, simplified) for kernel, names in covered.items()}
    return ProfiledModule(module, lowered, rules, patterns, covers)


def kernel_groups(grouped) -> tuple[dict[str, str], dict[str, list[str]]]:
    """After FuseOps, before FuseTIR (which names each kernel after its group): kernel -> how it
    was grouped, and kernel -> the binding names it computes (its group's, or its own)."""
    from tvm import relax

    patterns: dict[str, str] = {}
    covered: dict[str, list[str]] = collections.defaultdict(list)
    for block in grouped["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            if isinstance(value.op, relax.GlobalVar):
                func = grouped[value.op]
                name = value.op.name_hint
                composite = func.attrs.get("Composite") if func.attrs else None
                patterns[name] = str(composite) if composite else "tvm FuseOps"
                covered[name] += [b.var.name for inner in func.body.blocks for b in inner.bindings]
            elif getattr(value.op, "name", "") == "relax.call_tir":
                name = value.args[0].name_hint
                patterns.setdefault(name, "single op")
                covered[name].append(binding.var.name)
    return patterns, dict(covered)


def onnx_nodes_of(names: list[str], report, model) -> list[str]:
    """The ONNX nodes behind binding names of the node-named import, through the rewrites."""
    from .provenance import node_index

    rewrites = {i.output: i.absorbed for i in report.instances if i.variant == i.pattern}
    found: set[int] = set()
    pending, seen = list(names), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        pending += rewrites.get(name, [])  # a rewritten op stands for the chain it replaced
        index = node_index(name, model)
        if index is not None:
            found.add(index)
    return [model.graph.node[i].name or f"#{i}" for i in sorted(found)]


# Static costs ------------------------------------------------------------------------------

def kernel_costs(func) -> tuple[int, int]:
    """(FLOPs, bytes): float arithmetic of every block times its iteration domain; every
    parameter buffer read or written once."""
    import tvm
    import tvm_ffi
    from tvm import s_tir

    blocks: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append))
    flops = 0
    for block in blocks:
        value = getattr(block.body, "value", None)
        if value is None:
            continue
        size = 1
        for iv in block.iter_vars:
            size *= int(iv.dom.extent)
        flops += size * _arith_ops(value)
    nbytes = 0
    for param in func.params:  # buffers in TVM 0.27
        if hasattr(param, "shape"):
            count = 1
            for dim in param.shape:
                count *= int(dim)
            nbytes += count * ((tvm.runtime.DataType(str(param.dtype)).bits + 7) // 8)
    return flops, nbytes


def _arith_ops(expr) -> int:
    """Float arithmetic nodes in a stored value; index math inside loads is not counted."""
    kind = type(expr).__name__
    if kind == "BufferLoad" or not hasattr(expr, "ty"):
        return 0
    is_float = "float" in str(expr.ty)
    own = int(is_float and kind in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Call"))
    if kind == "Call" and is_float and str(getattr(expr.op, "name", "")).endswith("fma"):
        own = 2
    children = [getattr(expr, field) for field in ("a", "b", "value", "condition", "true_value", "false_value")
                if hasattr(getattr(expr, field, None), "ty")]
    if kind == "Call":
        children += list(expr.args)
    return own + sum(_arith_ops(child) for child in children)


def kernel_kind(name: str, func, pattern: str) -> str:
    """A short label for mining: the op class of the kernel's heaviest work."""
    for key, kind in (("conv2d_transpose", "conv_transpose"), ("conv", "conv"), ("matmul", "matmul"),
                      ("dense", "matmul"), ("pool", "pool"), ("softmax", "softmax"),
                      ("layer_norm", "norm"), ("rms_norm", "norm")):
        if key in name:
            return kind
    if pattern not in ("tvm FuseOps", "single op"):
        return pattern.split(".")[0]
    op_pattern = int(func.attrs["op_pattern"]) if func.attrs and "op_pattern" in func.attrs else 8
    return {0: "injective", 1: "injective", 2: "injective", 3: "reduction", 4: "conv/matmul"}.get(
        op_pattern, "opaque")


# Timing ------------------------------------------------------------------------------------

def empty_kernels(module):
    """The same module with every kernel's body emptied: what is left is the VM's own work."""
    from tvm import tirx

    emptied = module.clone()
    for gvar, func in module.functions_items():
        if isinstance(func, tirx.PrimFunc):
            emptied[gvar] = func.with_body(tirx.Evaluate(0))
    return emptied


@dataclasses.dataclass
class Timings:
    end_to_end_ms: float
    dispatch_ms: float
    alone_us: dict[str, float]      # kernel -> per call, warm
    in_model_us: dict[str, float]   # kernel -> per call, in the model
    calls: dict[str, int]           # kernel -> calls per model run
    builtin_calls: dict[str, int]


def time_model(executable, empty_executable, kernels: set[str], args: list, rounds: int = 30,
               kernel_rounds: int = 5, repeats: int = 10) -> Timings:
    """Medians of interleaved rounds; see the module docstring for what each number is."""
    import tvm
    from tvm import relax

    def vm_main(executable, instrument=None):
        vm = relax.VirtualMachine(executable, tvm.cpu())
        if instrument is not None:
            vm.set_instrument(instrument)
        return vm["main"]

    plain, empty = vm_main(executable), vm_main(empty_executable)
    ends: dict[str, list[float]] = {"plain": [], "empty": []}
    for _ in range(3):
        plain(*args), empty(*args)
    for _ in range(rounds):
        for name, run in (("plain", plain), ("empty", empty)):
            start = time.perf_counter()
            run(*args)
            ends[name].append(time.perf_counter() - start)

    started: dict[str, float] = {}
    hooked: dict[str, list[float]] = collections.defaultdict(list)
    counts: collections.Counter = collections.Counter()

    def stopwatch(_func, name, before_run, _ret, *_args):
        if before_run:
            counts[name] += 1
            started[name] = time.perf_counter()
        else:
            hooked[name].append(time.perf_counter() - started.pop(name))
        return relax.VMInstrumentReturnKind.NO_OP

    alone: dict[str, list[float]] = collections.defaultdict(list)

    def rerun(func, name, before_run, _ret, *call_args):
        if before_run and name in kernels:
            func(*call_args)  # the real call follows and rewrites the outputs
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                func(*call_args)
                samples.append(time.perf_counter() - start)
            alone[name].append(float(np.median(samples)))
        return relax.VMInstrumentReturnKind.NO_OP

    timed_plain, timed_empty = vm_main(executable, stopwatch), vm_main(empty_executable, stopwatch)
    timed_alone = vm_main(executable, rerun)
    in_model: dict[str, list[float]] = collections.defaultdict(list)
    hook_cost: dict[str, list[float]] = collections.defaultdict(list)
    timed_plain(*args)
    for _ in range(kernel_rounds):
        for run, into in ((timed_plain, in_model), (timed_empty, hook_cost)):
            hooked.clear()
            run(*args)
            for name, values in hooked.items():
                into[name] += values
        timed_alone(*args)
    calls = {name: count // (2 * kernel_rounds + 1) for name, count in counts.items()
             if name in kernels}
    builtins = {name: count // (2 * kernel_rounds + 1) for name, count in counts.items()
                if name not in kernels}
    return Timings(
        end_to_end_ms=float(np.median(ends["plain"])) * 1e3,
        dispatch_ms=float(np.median(ends["empty"])) * 1e3,
        alone_us={k: float(np.median(v)) * 1e6 for k, v in alone.items()},
        in_model_us={k: max(0.0, float(np.median(v) - np.median(hook_cost.get(k, [0.0])))) * 1e6
                     for k, v in in_model.items() if k in kernels},
        calls=calls, builtin_calls=builtins)


# The command --------------------------------------------------------------------------------

def profile_model(model_path: str | Path, config=None, input_shapes=None, rounds: int = 30,
                  mine: bool = False, progress: Progress = lambda _m: None,
                  tuning_log=None) -> ProfileReport:
    """Per-kernel times, costs and roofline position, the end-to-end gap, and (``mine``) the
    unfused kernel chains worth a pattern."""
    import tvm

    from .frontend import onnx as onnx_frontend
    from .native_log import captured_native_stderr
    from .preparation import at_one_size, prepare
    from .runtime import set_threads

    with captured_native_stderr([]):
        prepared = prepare(model_path, config, input_shapes, progress)
        at_one_size(prepared, "profile")
        cfg = prepared.config
        set_threads(cfg.threads)
        profiled = build_profiled(prepared, progress, tuning_log)
        progress("building the model and its empty-kernel twin")
        target = cfg.tvm_target()
        executable = tvm.compile(profiled.module, target=target)
        empty_executable = tvm.compile(empty_kernels(profiled.module), target=target)
        progress("probing this machine's peaks (cached per machine class)")
        peak = machine_peak(cfg)
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, prepared.inputs, cfg.seed)
    args = [tvm.runtime.tensor(np.ascontiguousarray(value)) for value in inputs.values()]
    funcs = {gv.name_hint: f for gv, f in profiled.lowered.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc)}
    progress(f"timing {len(funcs)} kernels and the whole model, {rounds} interleaved rounds")
    timings = time_model(executable, empty_executable, set(funcs), args, rounds=rounds)
    kernels = [_kernel_profile(name, funcs[name], profiled, timings, peak) for name in timings.calls]
    total = sum(k.total_us for k in kernels) or 1.0
    for kernel in kernels:
        kernel.share = kernel.total_us / total
    kernels.sort(key=lambda k: -k.total_us)
    gap = Gap(timings.end_to_end_ms, total / 1e3,
              sum(timings.in_model_us.get(k.name, 0.0) * k.calls for k in kernels) / 1e3,
              timings.dispatch_ms, timings.builtin_calls)
    chains = None
    if mine:
        per_launch_us = timings.dispatch_ms * 1e3 / max(1, sum(timings.calls.values()))
        chains = mine_chains(kernel_graph(profiled.lowered), {k.name: k for k in kernels},
                             peak.gbytes_per_s, per_launch_us)
    return ProfileReport(prepared.name, cfg.threads, peak, kernels, gap, chains)


def _kernel_profile(name, func, profiled: ProfiledModule, timings: Timings, peak: MachinePeak) -> KernelProfile:
    flops, nbytes = kernel_costs(func)
    us = timings.alone_us.get(name, 0.0)
    seconds = us / 1e6 or float("inf")
    gflops, gbps = flops / seconds / 1e9, nbytes / seconds / 1e9
    intensity = flops / nbytes if nbytes else 0.0
    bound = "compute" if intensity >= peak.ridge else "memory"
    # A kernel without arithmetic (data movement) is measured against the bandwidth roof only.
    achieved = gflops / min(peak.gflops, intensity * peak.gbytes_per_s) if flops else gbps / peak.gbytes_per_s
    pattern = profiled.patterns.get(name, "single op")
    return KernelProfile(name, pattern, profiled.schedule_rules.get(name, "-"), kernel_kind(name, func, pattern),
                         timings.calls[name], us, timings.in_model_us.get(name, 0.0), 0.0, flops, nbytes,
                         gflops, gbps, intensity, bound, 100.0 * achieved, profiled.covers.get(name, []))


# Mining -------------------------------------------------------------------------------------

@dataclasses.dataclass
class KernelCall:
    kernel: str
    output_bytes: int
    inputs: list[int]       # indices of the calls whose outputs it reads
    model_output: bool = False  # its output leaves main: it must reach memory anyway


def kernel_graph(lowered) -> list[KernelCall]:
    """The call_tir sites of ``main`` in order, each with the earlier calls it reads."""
    from tvm import relax

    func = lowered["main"]
    producer: dict = {}
    calls: list[KernelCall] = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Var) and value in producer:
                producer[binding.var] = producer[value]
            elif isinstance(value, relax.TupleGetItem) and value.tuple_value in producer:
                producer[binding.var] = producer[value.tuple_value]
            elif isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir":
                args = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else [value.args[1]]
                reads = sorted({producer[a] for a in args if a in producer})
                producer[binding.var] = len(calls)
                calls.append(KernelCall(value.args[0].name_hint, _type_bytes(binding.var.ty), reads))
    returned: set[int] = set()
    relax.analysis.post_order_visit(func.body.body, lambda e: returned.add(producer[e])
                                    if isinstance(e, relax.Var) and e in producer else None)
    for index in returned:
        calls[index].model_output = True
    return calls


def _type_bytes(ty) -> int:
    import tvm
    from tvm import relax

    if isinstance(ty, relax.TupleType):
        return sum(_type_bytes(field) for field in ty.fields)
    count = 1
    for dim in ty.shape.values:
        count *= int(dim)
    return count * ((tvm.runtime.DataType(str(ty.dtype)).bits + 7) // 8)


def mine_chains(calls: list[KernelCall], kernels: dict[str, KernelProfile], gbytes_per_s: float,
                per_launch_us: float, longest: int = 3, top: int = 10) -> list[Chain]:
    """Chains of 2..``longest`` adjacent kernel calls where each intermediate is read by the
    next call only (so a fusion could keep it out of DRAM), ranked by estimated gain.

    Gain: the intermediates written and read back, at the measured bandwidth, plus one saved
    launch per fused edge, at most the chain's own time.
    """
    consumers: dict[int, list[int]] = collections.defaultdict(list)
    for index, call in enumerate(calls):
        for source in call.inputs:
            consumers[source].append(index)

    def next_of(index: int) -> int | None:
        readers = consumers.get(index, [])
        return readers[0] if len(readers) == 1 and not calls[index].model_output else None

    chains = []
    for start in range(len(calls)):
        path = [start]
        while len(path) < longest and (following := next_of(path[-1])) is not None:
            path.append(following)
            saved = sum(2 * calls[i].output_bytes for i in path[:-1])
            us = sum(kernels[calls[i].kernel].us_per_call for i in path if calls[i].kernel in kernels)
            gain = min(us, saved / (gbytes_per_s * 1e3) + per_launch_us * (len(path) - 1))
            chains.append(Chain([calls[i].kernel for i in path],
                                [kernels[calls[i].kernel].kind if calls[i].kernel in kernels else "?"
                                 for i in path], us, saved, gain))
    chains.sort(key=lambda c: -c.gain_us)
    return chains[:top]
