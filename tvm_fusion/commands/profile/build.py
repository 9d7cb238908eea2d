"""The module ``profile`` times, built as ``compile`` builds it, from the session's import whose
bindings are named after ONNX nodes (``provenance``), so that each kernel lists the ONNX nodes
it covers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tvm

from ...passes.bf16_activations import copied_from
from ...provenance import kernel_onnx_nodes
from ...session import ModelSession

Progress = Callable[[str], None]


@dataclasses.dataclass
class ProfiledModule:
    module: tvm.IRModule      # scheduled, ready to build
    lowered: tvm.IRModule     # before schedules: FLOPs are counted here
    schedule_rules: dict[str, str]
    patterns: dict[str, str]  # kernel -> Composite name, or how it was grouped
    covers: dict[str, list[str]]  # kernel -> ONNX node names
    tuned: list[str] = dataclasses.field(default_factory=list)  # kernels a tuning-log record scheduled


def build_profiled(session: ModelSession, config, tuning_log=None,
                   excluded: frozenset[str] = frozenset()) -> ProfiledModule:
    """The session's scheduled stage, with each kernel traced to the ONNX nodes it covers.

    ``excluded``: bindings left unfused (those the fusion gate undid when an artifact was built).
    """
    prepared = session.prepared(config)
    scheduled = session.scheduled(prepared.config, tuning_log, excluded=excluded)
    covers = kernel_onnx_nodes(scheduled.lowered.kernel_bindings, scheduled.report, prepared.simplified)
    patterns = dict(scheduled.lowered.kernel_patterns)
    lowered = with_copies(scheduled.lowered.module, scheduled.module, patterns, covers)
    return ProfiledModule(scheduled.module, lowered, scheduled.schedule_rules, patterns, covers,
                          sorted(scheduled.tuned))


def with_copies(lowered: tvm.IRModule, module, patterns: dict, covers: dict) -> tvm.IRModule:
    """``lowered`` with, for each kernel the schedule phase copied (``Bf16Activations``: a
    kernel some of whose calls read or write bf16 maps), the original's function, pattern and
    ONNX nodes under the copy's name."""
    names = {gvar.name_hint: func for gvar, func in lowered.functions_items()}
    copies = {gvar.name_hint: copied_from(gvar.name_hint) for gvar, func in module.functions_items()
              if isinstance(func, tvm.tirx.PrimFunc) and gvar.name_hint not in names}
    copies = {copy: original for copy, original in copies.items() if original in names}
    if not copies:
        return lowered
    functions = dict(lowered.functions_items())
    for copy, original in copies.items():
        functions[tvm.ir.GlobalVar(copy)] = names[original]
        if original in patterns:
            patterns[copy] = patterns[original]
        if original in covers:
            covers[copy] = covers[original]
    return tvm.IRModule(functions, lowered.attrs)
