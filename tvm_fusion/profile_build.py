"""The module ``profile`` times, built as ``compile`` builds it, from an import whose bindings are
named after ONNX nodes (``provenance``), so that each kernel lists the ONNX nodes it covers."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

Progress = Callable[[str], None]


@dataclasses.dataclass
class ProfiledModule:
    module: object            # scheduled, ready to build
    lowered: object           # before schedules: FLOPs are counted here
    schedule_rules: dict[str, str]
    patterns: dict[str, str]  # kernel -> Composite name, or how it was grouped
    covers: dict[str, list[str]]  # kernel -> ONNX node names
    tuned: list[str] = dataclasses.field(default_factory=list)  # kernels a tuning-log record scheduled


def build_profiled(prepared, progress: Progress = lambda _m: None, tuning_log=None,
                   excluded: frozenset[str] = frozenset()) -> ProfiledModule:
    """The configured pipeline on the node-named import, phase by phase, kernels traced.

    ``excluded``: bindings left unfused (those the fusion gate undid when an artifact was built).
    """
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
    fused = fusion_pipeline(cfg, report, phases=GRAPH_PHASES, excluded=excluded)(named)
    lowering = lowering_passes(cfg.fast_math, cfg.winograd)
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
    return ProfiledModule(module, lowered, rules, patterns, covers, sorted(records.applied) if records else [])


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
