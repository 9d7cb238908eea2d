"""The module ``profile`` times, built as ``compile`` builds it, from the session's import whose
bindings are named after ONNX nodes (``provenance``), so that each kernel lists the ONNX nodes
it covers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tvm

from ...provenance import kernel_onnx_nodes
from ...session import ModelSession

Progress = Callable[[str], None]


@dataclasses.dataclass
class ProfiledModule:
    module: object            # scheduled, ready to build
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
    return ProfiledModule(scheduled.module, scheduled.lowered.module, scheduled.schedule_rules,
                          scheduled.lowered.kernel_patterns, covers, sorted(scheduled.tuned))
