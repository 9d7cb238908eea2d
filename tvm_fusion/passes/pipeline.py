"""The tvm_fusion pipeline, in phases, per target.

    canonicalize  recognize exporter-decomposed activations (one op instead of five), so that
                  fusion patterns see the graph the model author wrote
    fuse          our fusion patterns: each match becomes one composite = one kernel
    lower         LegalizeOps (vectorizable exp/erf/tanh when fast_math is on) + TVM's own
                  FuseOps/FuseTIR for everything our patterns left
    schedule      a hand-written TensorIR schedule for every kernel (stock CPU schedules none)

The stock comparison pipeline is TVM's "zero" pipeline: the same lowering without our
patterns or schedules.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..config import PipelineConfig
from ..patterns import FusionRule, PatternReport, RewriteRule, get_pattern
from .apply_rewrite_rules import ApplyRewriteRules
from .fast_math import fast_math_legalize_map
from .fold_constants import FoldConstantsSafely
from .fuse_patterns import FusePatterns


def fusion_pipeline(config: PipelineConfig, report: PatternReport,
                    phases: tuple[str, ...] = ("canonicalize", "fuse", "lower", "schedule"),
                    schedule_log: dict[str, str] | None = None, tuning=None) -> tvm.transform.Pass:
    """The configured pipeline (optionally only some phases, for inspection and tests).

    ``report`` receives fusion counts and near misses; ``schedule_log`` (kernel -> schedule
    rule) what the schedule phase did. ``tuning`` (tuning.apply.TuningRecords) schedules the
    kernels it has records for before the hand-written rules take the rest.
    """
    rules = [get_pattern(name) for name in config.patterns]
    rewrites = [rule for rule in rules if isinstance(rule, RewriteRule)]
    fusions = [rule for rule in rules if isinstance(rule, FusionRule)]
    passes = {
        "canonicalize": lambda: [
            relax.transform.ConvertToDataflow(),
            # Folds the importer's constant bound/shape computations so rules see constants.
            FoldConstantsSafely(),
            ApplyRewriteRules(rewrites, report),
            relax.transform.DeadCodeElimination(),
            relax.transform.ConvertToDataflow(),
        ],
        "fuse": lambda: [FusePatterns(fusions, report)],
        "lower": lambda: lowering_passes(config.fast_math),
        "schedule": lambda: schedule_passes(config, schedule_log, tuning),
    }
    return tvm.transform.Sequential([p for phase in phases for p in passes[phase]()],
                                    name="tvm_fusion.Pipeline")


def lowering_passes(fast_math: bool = True) -> list[tvm.transform.Pass]:
    return [
        relax.transform.LegalizeOps(fast_math_legalize_map() if fast_math else None),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def schedule_passes(config: PipelineConfig, schedule_log: dict[str, str] | None,
                    tuning=None) -> list[tvm.transform.Pass]:
    if config.schedule == "none":
        return []
    from ..schedules import ApplySchedules

    tuned = []
    if tuning is not None and len(tuning):
        from ..tuning.apply import ApplyTuningRecords

        tuned = [ApplyTuningRecords(tuning, config.tvm_target(), log=schedule_log)]
    return [*tuned, ApplySchedules(config.tvm_target(), log=schedule_log)]


def stock_fusion_pipeline() -> tvm.transform.Pass:
    """TVM's own fusion (LegalizeOps, FuseOps, FuseTIR), for kernel-count comparison."""
    return relax.get_pipeline("zero")
