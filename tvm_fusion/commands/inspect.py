"""``inspect``: what our patterns do to a model (op counts before and after, which fusions
fired on which ONNX nodes, near misses, coverage), and the fused graph written as ONNX."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import onnx

from tvm import relax

from .. import onnx_export
from ..build import kernel_calls
from ..files import check_writable
from ..frontend import onnx as onnx_frontend
from ..frontend import bf16_conv, bf16_matmul, int8_conv, integer_matmul
from ..frontend.dims import ranges_of
from ..native_log import captured_native_stderr
from ..patterns import PatternReport
from ..preparation import ShapeArg
from ..provenance import kernel_onnx_indices, node_index, node_label
from ..render import check_graph_path, render_fusion_graph
from ..schedules import RuleError
from ..session import ModelSession
from ..verify import OutputComparison
from .coverage import Coverage
from .coverage import measure as measure_coverage
from .generic_kernels import GenericKernel, generic_kernels


@dataclasses.dataclass
class InspectReport:
    model: str
    onnx_ops: dict[str, int]
    onnx_ops_simplified: dict[str, int]
    relax_ops: dict[str, int]
    fused_ops: dict[str, int]
    report: PatternReport
    kernels: int
    stock_kernels: int
    instances: list[FusedNodes] = dataclasses.field(default_factory=list)
    coverage: Coverage | None = None
    # kernels only a generic schedule rule took though they hold a contraction or much of the FLOPs
    generic_kernels: list[GenericKernel] = dataclasses.field(default_factory=list)
    # schedule rules that raised on a kernel, which then went on to the next rule
    schedule_rule_errors: list[RuleError] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["report"] = {"fired": dict(self.report.fired), "variants": dict(self.report.variants),
                          "near_misses": [dataclasses.asdict(m) for m in self.report.near_misses]}
        data["coverage"] = self.coverage.to_json() if self.coverage is not None else None
        return data


def relax_op_counts(module) -> dict[str, int]:
    """Op name (or kernel name for call_tir) -> count, over ``main``."""
    counts: collections.Counter = collections.Counter()

    def visit(expr):
        if isinstance(expr, relax.Call):
            if isinstance(expr.op, relax.GlobalVar):
                counts[expr.op.name_hint] += 1
            elif getattr(expr.op, "name", "") == "relax.call_tir":
                counts[expr.args[0].name_hint] += 1
            elif hasattr(expr.op, "name"):
                counts[expr.op.name.removeprefix("relax.")] += 1

    relax.analysis.post_order_visit(module["main"], visit)
    return dict(counts.most_common())


@dataclasses.dataclass
class FusedNodes:
    """One place a pattern fired, as the ONNX nodes (of the simplified graph) it absorbed."""

    pattern: str
    variant: str
    nodes: list[str]
    ops: list[str]
    indices: list[int]


def fused_nodes(report: PatternReport, model: onnx.ModelProto) -> list[FusedNodes]:
    """Each fusion with the ONNX nodes it absorbed, rewrites it absorbed included; then the
    rewrites no fusion absorbed. Bindings are named by ``provenance.import_with_node_names``."""
    rewrites = {i.output: i for i in report.instances if i.variant == i.pattern}

    def indices(names, seen) -> list[int]:
        found = []
        for name in names:
            if name in rewrites and name not in seen:
                seen.add(name)
                found += indices(rewrites[name].absorbed, seen)
            index = node_index(name, model)
            if index is not None:
                found.append(index)
        return found

    absorbed_rewrites: set[str] = set()
    groups = []
    fusions = [i for i in report.instances if i.variant != i.pattern]
    for instance in fusions + [i for i in rewrites.values()]:
        if instance.variant == instance.pattern and instance.output in absorbed_rewrites:
            continue
        seen: set[str] = set()
        nodes = sorted(set(indices(instance.absorbed, seen)))
        absorbed_rewrites |= seen
        groups.append(FusedNodes(instance.pattern, instance.variant,
                                 [node_label(model, i) for i in nodes],
                                 [model.graph.node[i].op_type for i in nodes], nodes))
    return groups


# The kernels our frontend and passes emit (no pattern does), which FuseOps then gives their
# epilogue: the int8 and bf16 matmuls' and convs' PrimFuncs, by name.
OWN_KERNELS = (int8_conv.PRIMFUNC_NAME, integer_matmul.KERNEL_NAME, bf16_conv.PRIMFUNC_NAME, bf16_matmul.KERNEL_NAME)


def own_kernel_groups(lowered, report: PatternReport, model: onnx.ModelProto) -> list[FusedNodes]:
    """Each lowered kernel built around one of ``OWN_KERNELS``, with the ONNX nodes it computes:
    a quantized conv's requantization and activation after it run in its kernel as surely as a
    pattern's epilogue, and coverage counts them so."""
    ours = {kernel: names for kernel, names in lowered.kernel_bindings.items()
            if any(name in kernel for name in OWN_KERNELS)}
    return [FusedNodes("own kernel", f"own kernel.{kernel}", [node_label(model, i) for i in indices],
                       [model.graph.node[i].op_type for i in indices], indices)
            for kernel, indices in kernel_onnx_indices(ours, report, model).items()]


def inspect_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                  graph: str | Path | None = None) -> InspectReport:
    """Op counts before/after fusion, which fusions fired how often (with the ONNX nodes each
    absorbed), and near misses; with ``graph``, the fused graph drawn (.svg/.png/.html)."""
    if graph is not None:
        check_graph_path(graph)  # before the work, not after it
    session = ModelSession(model_path, input_shapes)
    with captured_native_stderr([]):  # inspection builds nothing; TVM's build warnings are noise here
        prepared = session.prepared(config)
        fused = session.fused(prepared)
        lowered = session.lowered(fused, prepared.config)
        stock_kernels = session.stock_kernel_calls(prepared.config)
        scheduled = session.scheduled(prepared.config)
        kernels = kernel_calls(scheduled.dynamic_module)  # per call: one branch of a dispatched If
        generic = generic_kernels(scheduled, prepared)
    simplified = prepared.simplified_with_weights()  # coverage reads constants
    report = fused.report
    for miss in report.near_misses:
        index = node_index(miss.var, simplified)
        if index is not None:
            node = simplified.graph.node[index]
            miss.where += f" (ONNX {node.op_type} {node.name or f'#{index}'})"
    instances = fused_nodes(report, simplified)
    if graph is not None:
        render_fusion_graph(simplified, instances, graph, title=prepared.name)
    return InspectReport(
        model=prepared.name,
        onnx_ops=dict(collections.Counter(n.op_type for n in prepared.onnx_model.graph.node).most_common()),
        onnx_ops_simplified=dict(collections.Counter(n.op_type for n in simplified.graph.node).most_common()),
        relax_ops=relax_op_counts(prepared.relax_module),
        fused_ops=relax_op_counts(fused.module),
        report=report,
        kernels=kernels,
        stock_kernels=stock_kernels,
        instances=instances,
        coverage=measure_coverage(simplified, instances + own_kernel_groups(lowered, report, simplified),
                                  report.near_misses),
        generic_kernels=generic,
        schedule_rule_errors=scheduled.schedule_rule_errors,
    )


@dataclasses.dataclass
class FusedOnnxReport:
    path: str
    fused_ops: dict[str, int]
    kept: list  # onnx_export.KeptInstance: fusions left as their original nodes, with why
    comparisons: list[OutputComparison] | None  # with check: per output, against ONNX Runtime
    rtol: float
    atol: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def export_fused_onnx(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                      path: str | Path = "fused.onnx", check: bool = False) -> FusedOnnxReport:
    """Write the model as it stands after our patterns, each fusion one ``tvm_fusion`` node
    (``onnx_export``); with ``check``, run it under onnx.reference with our ops' numpy
    definitions against the original under ONNX Runtime (VerificationError outside the
    config's tolerances, after the file is written so that it can be looked at)."""
    path = Path(path)
    check_writable(path.parent, f"the fused ONNX file {path.name}", "--onnx")
    session = ModelSession(model_path, input_shapes)
    with captured_native_stderr([]):
        prepared = session.prepared(config)
        report = session.fused(prepared).report
    simplified = prepared.simplified_with_weights()
    cfg = prepared.config
    typical = {name: r.typical for name, r in ranges_of(prepared.inputs).items()}
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, onnx_frontend.inputs_at(prepared.inputs, typical),
                                         cfg.seed)
    exported = onnx_export.fused_onnx(simplified, fused_nodes(report, simplified), inputs)
    onnx_export.write_model(exported.model, path)
    comparisons = None
    if check:
        comparisons = onnx_export.compare_with_onnxruntime(prepared.onnx_model, exported.model, inputs,
                                                           cfg.rtol, cfg.atol, cfg.threads)
        onnx_export.check_comparisons(comparisons, path, cfg.rtol, cfg.atol)
    return FusedOnnxReport(str(path), exported.fused, exported.kept, comparisons, cfg.rtol, cfg.atol)
