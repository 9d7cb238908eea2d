"""Optimize and build one imported model: the tvm_fusion pipeline (with tuning records where
they apply), ``tvm.compile``, and stock TVM's build of the same module for comparison."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import PipelineConfig
from .frontend.dims import ranges_of
from .patterns import PatternReport
from .preparation import PreparedModel, Progress, quiet


@dataclasses.dataclass
class OptimizedModule:
    module: object
    report: PatternReport
    schedule_rules: dict[str, str]
    # kernel -> tuning.apply.TunedKernel, for kernels a tuning-log record scheduled
    tuned: dict = dataclasses.field(default_factory=dict)


def optimize(prepared: PreparedModel, tuning_log: str | Path | bool | None = None,
             progress: Progress = quiet) -> OptimizedModule:
    """Run the configured tvm_fusion pipeline: canonicalize, fuse, lower, schedule.

    Kernels with a record in the tuning log (see ``load_tuning``) get the tuned schedule. With
    shape buckets in the config, each bucket is prepared and optimized as a static model and
    ``main`` dispatches to it (``buckets.py``); the report is the dynamic module's.
    """
    from .buckets import bucket_points, bucket_suffix, with_buckets
    from .passes import fusion_pipeline
    from .preparation import prepare_at

    report = PatternReport()
    schedule_log: dict[str, str] = {}
    records = load_tuning(prepared.config, tuning_log, progress)
    module = fusion_pipeline(prepared.config, report, schedule_log=schedule_log,
                             tuning=records)(prepared.relax_module)
    module = callable_module(module, prepared)
    applied = dict(records.applied) if records else {}
    ranges = ranges_of(prepared.inputs)
    specialized = []
    for point in bucket_points(prepared.config.buckets, ranges):
        static = optimize(prepare_at(prepared, dataclasses.replace(prepared.config, buckets=()), point, progress),
                          tuning_log, progress)
        suffix = bucket_suffix(point)
        schedule_log.update({name + suffix: rule for name, rule in static.schedule_rules.items()})
        applied.update({name + suffix: tuned for name, tuned in static.tuned.items()})
        specialized.append((point, static.module))
    if specialized:
        module = with_buckets(module, specialized, ranges)
    return OptimizedModule(module, report, schedule_log, applied)


def load_tuning(config: PipelineConfig, tuning_log: str | Path | bool | None = None,
                progress: Progress = quiet):
    """The tuning records for the config's target: ``tuning_log`` is a log root (holding
    ``<target-key>/`` stores), None for the config's (``TuningConfig.read_dirs``), False for none.
    What is not applied (damaged lines, other targets or TVM versions) is said via ``progress``."""
    if tuning_log is False:
        return None
    from .tuning.apply import load_records

    roots = config.tuning.read_dirs() if tuning_log in (None, True) else [tuning_log]
    target = config.tvm_target()
    found = [records for records in (load_records(root, target) for root in roots) if records is not None]
    # The first root holding a store for this target (the user's before the shipped one).
    records = next((r for r in found if r.directory.is_dir()), found[0] if found else None)
    if records is not None:
        records.say = lambda note: progress(f"tuning log: {note}")
        for note in records.notes:
            records.say(note)
    return records


def build(module, config: PipelineConfig):
    """``tvm.compile`` with Relax's default pipeline, then the VM's shape functions marked
    noalias (see ``passes/mark_shape_functions_noalias.py``: without it a symbolic-shape
    module's kernels keep their accumulators in memory)."""
    import tvm
    from tvm import relax

    from .passes.mark_shape_functions_noalias import MarkShapeFunctionsNoAlias

    pipeline = tvm.transform.Sequential([relax.get_pipeline("default"), MarkShapeFunctionsNoAlias()])
    return tvm.compile(module, target=config.tvm_target(), relax_pipeline=pipeline)


def callable_module(module, prepared: PreparedModel):
    """The module whose ``main`` takes the inputs as given: with a stepped range, the
    pipeline's ``main`` (step counts first) behind one that takes plain dims."""
    from .frontend.stepped_dims import expose_input_dims

    return expose_input_dims(module, ranges_of(prepared.inputs))


def build_stock(prepared: PreparedModel):
    """Stock TVM: its default pipeline on the same imported module (no fusion, no schedules on CPU)."""
    import tvm

    return tvm.compile(callable_module(prepared.relax_module, prepared), target=prepared.config.tvm_target())


def kernel_calls(module) -> int:
    """How many kernel launches one call of ``main`` makes (call_tir sites, also in the Relax
    function ``main`` calls when a stepped range puts one in front)."""
    from tvm import relax

    count = 0

    def visit(expr):
        nonlocal count
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            count += 1

    for _gvar, func in module.functions_items():
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            relax.analysis.post_order_visit(func, visit)
    return count


def stock_kernel_calls(prepared: PreparedModel) -> int:
    from .passes import stock_fusion_pipeline

    return kernel_calls(stock_fusion_pipeline()(prepared.relax_module))
