"""The Python API: compile, inspect and bench, usable without the CLI.

Each entry point takes a model path, an optional config (path or PipelineConfig) and optional
input shapes, and raises a ``TvmFusionError`` subclass for anything the user can fix.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from . import __version__
from .config import PipelineConfig, load_config
from .coverage import Coverage
from .coverage import measure as measure_coverage
from .errors import ArtifactError, ConfigError, ShapeError, TvmFusionError, VerificationError
from .export import artifact_dir, write_artifact
from .files import check_writable
from .frontend import onnx as onnx_frontend
from .frontend.dims import evaluate_dim, ranges_of, size_points, var_sizes
from .machine_peak import MachinePeak, machine_peak
from .native_log import captured_native_stderr, summarize
from .patterns import PatternReport
from .runtime import CompiledModel, set_threads
from .verify import (OutputComparison, ReferenceUnavailable, check_outputs, compare_outputs,
                     reference_outputs)

Progress = Callable[[str], None]
# {name: dims} (a dim: a size, or a (low, high, step) range), NAME:DIMxDIM flags, or one such flag.
ShapeArg = dict[str, tuple] | list[str] | str | None


def _quiet(_message: str) -> None:
    pass


@dataclasses.dataclass
class PreparedModel:
    """An ONNX model with bound input shapes, imported into Relax (before any of our passes)."""

    config: PipelineConfig
    name: str
    onnx_model: onnx.ModelProto
    inputs: list[onnx_frontend.TensorSpec]
    output_names: list[str]
    relax_module: object


@dataclasses.dataclass
class OptimizedModule:
    module: object
    report: PatternReport
    schedule_rules: dict[str, str]
    # kernel -> tuning.apply.TunedKernel, for kernels a tuning-log record scheduled
    tuned: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CompileResult:
    artifact: Path | None
    metadata: dict
    report: PatternReport
    comparisons: list[OutputComparison]


def resolve_config(config: str | Path | PipelineConfig | None) -> PipelineConfig:
    return config if isinstance(config, PipelineConfig) else load_config(config)


def parse_input_shapes(shapes: ShapeArg) -> dict[str, tuple]:
    """``{name: dims}``, a list of ``NAME:DIMxDIM`` flags, or one such flag; a dim may be a
    ``LOW..HIGH[/STEP]`` range (a ``(low, high, step)`` tuple in a dict)."""
    if not shapes:
        return {}
    if isinstance(shapes, dict):
        return {name: tuple(dims) for name, dims in shapes.items()}
    if isinstance(shapes, str):
        shapes = [shapes]
    parsed: dict[str, tuple[int, ...]] = {}
    for flag in shapes:
        name, dims = onnx_frontend.parse_shape_flag(flag)
        if parsed.get(name, dims) != dims:
            given = " and ".join(f"{name}:{_dims_flag(d)}" for d in (parsed[name], dims))
            raise ShapeError(f"--input-shape gives input {name!r} two different shapes: {given}",
                             f"pass --input-shape once for {name}")
        parsed[name] = dims
    return parsed


def _dims_flag(dims) -> str:
    from .frontend.dims import DimRange

    return "x".join(str(DimRange("", *d)) if isinstance(d, tuple) else str(d) for d in dims)


def shapes_text(inputs: list[onnx_frontend.TensorSpec]) -> str:
    """``input_ids:1x1..512, attention_mask:1x1..512`` for messages."""
    return ", ".join(f"{s.name}:{'x'.join(map(str, s.shape))}" for s in inputs)


def check_memory(inputs: list[onnx_frontend.TensorSpec], module=None) -> None:
    """A ShapeError before any heavy work when the bound shapes cannot fit in memory.

    What a compile or bench holds at least: the inputs, plus the largest tensor the model
    computes (from the imported module's types, once there is one), at the high end of every
    range. Without this check a mistyped dim builds the model and then dies allocating its
    test inputs.
    """
    import psutil

    high = {name: r.high for name, r in ranges_of(inputs).items()}
    input_bytes = sum(_tensor_bytes(s.shape, s.dtype) for s in onnx_frontend.inputs_at(inputs, high))
    high_vars = var_sizes(ranges_of(inputs), high)
    largest, described = max(_computed_tensors(module, high_vars), default=(0, "")) if module is not None else (0, "")
    available = psutil.virtual_memory().available
    if input_bytes + largest > available:
        shapes = shapes_text(inputs)
        need = f"{_human_bytes(input_bytes)} for its inputs" + (
            f" plus {_human_bytes(largest)} for its largest intermediate ({described})" if largest else "")
        raise ShapeError(f"at {shapes} the model needs {need}, but only {_human_bytes(available)} of memory "
                         "is available", "pass smaller --input-shape dims (the sizes you deploy with), or "
                         "lower the config's [inputs] defaults")


def _tensor_bytes(shape, dtype: str) -> int:
    import tvm

    count = 1
    for dim in shape:
        count *= int(dim)
    return count * ((tvm.runtime.DataType(dtype).bits + 7) // 8)


def _computed_tensors(module, high: dict[str, int]):
    """(bytes, 'dtype[shape]') of every tensor bound in ``main``, symbolic dims at ``high``."""
    from tvm import relax

    def sizes(ty):
        if isinstance(ty, relax.TupleType):
            for field in ty.fields:
                yield from sizes(field)
        elif isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
            try:
                shape = [evaluate_dim(dim, high) for dim in ty.shape.values]
            except (TypeError, KeyError):  # a dim no input range bounds (a data-dependent size)
                return
            yield _tensor_bytes(shape, str(ty.dtype)), f"{ty.dtype}{shape}"

    for block in getattr(module["main"].body, "blocks", []):
        for binding in block.bindings:
            yield from sizes(binding.var.ty)


def _human_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count} B"
        count /= 1024
    raise AssertionError("unreachable")


def prepare(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
            progress: Progress = _quiet) -> PreparedModel:
    """Load, bind shapes, simplify (onnxslim) and import into Relax."""
    cfg = resolve_config(config)
    model = onnx_frontend.load_onnx(model_path)
    specs = onnx_frontend.bind_input_shapes(model, parse_input_shapes(input_shapes), cfg.dim_defaults)
    check_memory(specs)
    progress("simplifying shape subgraphs at " + shapes_text(specs))
    simplified = onnx_frontend.simplify(model, specs)
    progress(f"importing {len(simplified.graph.node)} ONNX nodes into Relax")
    module = onnx_frontend.import_model(simplified, specs)
    check_memory(specs, module)
    return PreparedModel(cfg, Path(model_path).stem, model, specs,
                         onnx_frontend.output_specs(model), module)


def at_one_size(prepared: PreparedModel, command: str) -> None:
    """Commands that time or tune kernels run at fixed sizes: a ShapeError for a range."""
    ranges = ranges_of(prepared.inputs)
    if ranges:
        listed = ", ".join(f"{name} {r}" for name, r in ranges.items())
        raise ShapeError(f"{command} runs the model at one size, but the input shapes give ranges ({listed})",
                         f"pass fixed sizes to {command} (e.g. the typical size "
                         f"{', '.join(f'{n}={r.typical}' for n, r in ranges.items())})")


def optimize(prepared: PreparedModel, tuning_log: str | Path | bool | None = None,
             progress: Progress = _quiet) -> OptimizedModule:
    """Run the configured tvm_fusion pipeline: canonicalize, fuse, lower, schedule.

    Kernels with a record in the tuning log (see ``load_tuning``) get the tuned schedule.
    """
    from .passes import fusion_pipeline

    report = PatternReport()
    schedule_log: dict[str, str] = {}
    records = load_tuning(prepared.config, tuning_log, progress)
    module = fusion_pipeline(prepared.config, report, schedule_log=schedule_log,
                             tuning=records)(prepared.relax_module)
    module = callable_module(module, prepared)
    return OptimizedModule(module, report, schedule_log, dict(records.applied) if records else {})


def load_tuning(config: PipelineConfig, tuning_log: str | Path | bool | None = None,
                progress: Progress = _quiet):
    """The tuning records for the config's target: ``tuning_log`` is a log root (holding
    ``<target-key>/`` stores), None for the config's ``[tuning] log_dir``, False for none.
    What is not applied (damaged lines, other targets or TVM versions) is said via ``progress``."""
    if tuning_log is False:
        return None
    from .tuning.apply import load_records

    records = load_records(config.tuning.log_dir if tuning_log in (None, True) else tuning_log,
                           config.tvm_target())
    if records is not None:
        records.say = lambda note: progress(f"tuning log: {note}")
        for note in records.notes:
            records.say(note)
    return records


def tuning_metadata(records) -> dict | None:
    """metadata.json's ``tuning``: which log was used and the kernels its records scheduled."""
    if records is None:
        return None
    return {"log": str(records.directory), "target_key": records.target_key,
            "tuned_kernels": sorted(records.applied),
            "hand_schedule_measured_fastest": sorted(records.hand_best),
            "details": {name: dataclasses.asdict(k) for name, k in sorted(records.applied.items())}}


def build(module, config: PipelineConfig):
    import tvm

    return tvm.compile(module, target=config.tvm_target())


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


def _sha256(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString()).hexdigest()


def compile_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                  output_dir: str | Path = "build", verify: bool = True,
                  progress: Progress = _quiet, tuning_log: str | Path | bool | None = None,
                  fusion_gate: bool = True) -> CompileResult:
    """Compile an ONNX model into ``<output_dir>/<model>.<target>/``, verified against ONNX Runtime.

    With ``verify`` a mismatch raises VerificationError and nothing is written. One target of
    ``compile_targets``, whose error (missing toolchain, mismatch) is raised here.
    """
    (result,) = compile_targets(model_path, [config], input_shapes, output_dir, verify, progress,
                                tuning_log=tuning_log, fusion_gate=fusion_gate)
    if result.error is not None:
        raise result.error
    return result


@dataclasses.dataclass
class TargetResult(CompileResult):
    """One target of ``compile_targets``: its artifact, or the error that stopped it."""

    target: str = ""
    # How the artifact was checked against ONNX Runtime, or why it was not.
    verification: str = ""
    error: TvmFusionError | None = None


def compile_targets(model_path: str | Path, configs: list, input_shapes: ShapeArg = None,
                    output_dir: str | Path = "build", verify: bool = True,
                    progress: Progress = _quiet, tuning_log: str | Path | bool | None = None,
                    fusion_gate: bool = True) -> list[TargetResult]:
    """Compile one model for several targets (configs) into ``<output_dir>/<model>.<target>/`` each.

    The ONNX import runs once per distinct ``[inputs]`` table and the fusion phases once per
    distinct pattern list; lowering, schedules, build and export run per target. A target
    whose toolchain is missing, or whose artifact disagrees with ONNX Runtime, gets its error
    in its result and the other targets still build; a bad model, config or shape raises.
    Each artifact is run (natively or under qemu-user) and compared with ONNX Runtime before
    it is committed; where it cannot run here (CUDA without a GPU), or ONNX Runtime cannot run
    the model (no kernel for an op at its dtype), its result says so. With ``fusion_gate``, each
    fused instance is checked against its unfused nodes first and undone if it differs
    (``fusion_gate.py``; on targets that run here).
    """
    from .targets import ToolchainError, check_toolchain, execution_here

    started = time.perf_counter()
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ArtifactError(f"output directory {output_dir} is an existing file",
                            "pass a directory with -o/--output-dir")
    check_writable(output_dir, "the artifact", "-o/--output-dir")
    configs = [resolve_config(config) for config in (configs or [None])]
    names = [cfg.name for cfg in configs]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"two configs are named {name!r}: both would write <model>.{name}/",
                              "give each target's config file its own name")
    shared = _SharedWork(model_path, input_shapes, progress)
    # The gate checks the fusions with a target whose code runs here; what it undoes is undone
    # for every target, so the fusion phases still run once for all of them.
    gate_config = next((cfg for cfg in configs if execution_here(cfg.target).how == "native"),
                       None) if fusion_gate else None
    results = []
    for cfg in configs:
        # With several targets, each line says which one it is about.
        def say(message: str, label: str = f"[{cfg.name}] " if len(configs) > 1 else "") -> None:
            progress(label + message)

        try:
            toolchain = check_toolchain(cfg.name, cfg.target)
            results.append(_compile_target(shared, cfg, toolchain, output_dir, verify, say,
                                           tuning_log=tuning_log, gate_config=gate_config))
        except (ToolchainError, VerificationError, ArtifactError) as err:
            say(f"FAILED: {err.message}")
            results.append(TargetResult(None, {}, PatternReport(), [], target=cfg.name,
                                        verification="not built", error=err))
    progress(f"done in {time.perf_counter() - started:.1f} s")
    return results


class _SharedWork:
    """Import, fusion and ONNX Runtime references, computed once and reused by every target."""

    def __init__(self, model_path, input_shapes: ShapeArg, progress: Progress):
        self.model_path, self.input_shapes, self.progress = model_path, input_shapes, progress
        self.prepared: dict = {}
        self.fused: dict = {}
        self.references: dict = {}

    def prepare(self, cfg: PipelineConfig) -> PreparedModel:
        key = tuple(sorted(cfg.dim_defaults.items()))
        if key not in self.prepared:
            self.prepared[key] = prepare(self.model_path, cfg, self.input_shapes, self.progress)
        return self.prepared[key]

    def fuse(self, cfg: PipelineConfig, prepared: PreparedModel,
             excluded: frozenset[str] = frozenset()) -> tuple[object, PatternReport]:
        from .passes import GRAPH_PHASES, fusion_pipeline

        key = (id(prepared), cfg.patterns, excluded)
        if key not in self.fused:
            if not excluded:
                self.progress(f"running the tvm_fusion pipeline ({', '.join(cfg.patterns)})")
            report = PatternReport()
            fused = fusion_pipeline(cfg, report, phases=GRAPH_PHASES, excluded=excluded)(prepared.relax_module)
            self.fused[key] = (fused, report)
        return self.fused[key]

    def gated_fuse(self, cfg: PipelineConfig, prepared: PreparedModel, say: Progress):
        """Fusion with the numeric gate, on the node-named import so that an undone instance is
        reported by its ONNX nodes (the same graph; only binding names differ)."""
        from . import fusion_gate
        from .profile import onnx_nodes_of
        from .provenance import import_with_node_names

        key = (id(prepared), cfg.patterns, "gated")
        if key not in self.fused:
            simplified = onnx_frontend.simplify(prepared.onnx_model, prepared.inputs)
            named = dataclasses.replace(prepared, relax_module=onnx_frontend.with_range_bounds(import_with_node_names(
                simplified, onnx_frontend.relax_shape_dict(prepared.inputs),
                {s.name: s.dtype for s in prepared.inputs}), prepared.inputs))
            say("checking each fusion against its unfused nodes (--no-fusion-gate skips this)")
            self.fused[key] = fusion_gate.gated_fuse(
                lambda excluded: self.fuse(cfg, named, excluded), cfg,
                lambda names: onnx_nodes_of(names, self.fuse(cfg, named)[1], simplified), say)
        return self.fused[key]

    def inputs_and_reference(self, cfg: PipelineConfig, prepared: PreparedModel, with_reference: bool,
                             sizes: dict[str, int]):
        """Seeded inputs at ``sizes`` (one size per range; {} for a static model) and, with
        ``with_reference``, ONNX Runtime's outputs for them."""
        key = (id(prepared), cfg.seed, tuple(sorted(sizes.items())))
        if key not in self.references:
            specs = onnx_frontend.inputs_at(prepared.inputs, sizes)
            self.references[key] = [onnx_frontend.random_inputs(prepared.onnx_model, specs, cfg.seed), None]
        entry = self.references[key]
        if with_reference and entry[1] is None:
            entry[1] = reference_outputs(prepared.onnx_model, entry[0], cfg.threads)
        return entry[0], entry[1]


def _compile_target(shared: _SharedWork, cfg: PipelineConfig, toolchain: dict, output_dir,
                    verify: bool, say: Progress, tuning_log: str | Path | bool | None = None,
                    gate_config: PipelineConfig | None = None) -> TargetResult:
    import tvm

    from .passes import fusion_pipeline
    from .targets import execution_here, export_options, platform_of, unscheduled_gpu_kernels

    native: list[str] = []
    with captured_native_stderr(native):
        prepared = shared.prepare(cfg)
        gate = None
        if gate_config is not None:
            gate_config = dataclasses.replace(gate_config, patterns=cfg.patterns)
            fused, report, gate = shared.gated_fuse(gate_config, prepared, say)
        else:
            fused, report = shared.fuse(cfg, prepared)
        records = load_tuning(cfg, tuning_log, say)
        module = callable_module(fusion_pipeline(cfg, PatternReport(), phases=("lower", "schedule"),
                                                 tuning=records)(fused), prepared)
        if records and records.applied:
            say(f"tuned schedules from {records.directory} for {len(records.applied)} kernel(s)")
        plat = platform_of(cfg.target)
        if plat.device == "cuda":
            unscheduled = unscheduled_gpu_kernels(module)
            if unscheduled:
                raise ArtifactError(f"target {cfg.name}: no GPU schedule for {', '.join(unscheduled)}; "
                                    "they would silently build as host code", "report the model")
        say("building for " + str(cfg.target))
        with _cuda_source_modules(plat.device == "cuda"):
            executable = build(module, cfg)
    for message in summarize(native):
        say(f"tvm: {message}")
    metadata = {
        "model": prepared.name,
        "model_sha256": _sha256(prepared.onnx_model),
        "inputs": _input_metadata(prepared),
        "dims": {name: r.to_json() for name, r in ranges_of(prepared.inputs).items()},
        "outputs": _declared_outputs(module, prepared.output_names),
        "target": cfg.target,
        "config": cfg.name,
        "platform": plat.to_json(),
        "toolchain": toolchain,
        "pipeline": list(cfg.patterns),
        "schedule": cfg.schedule,
        "fusions": {name: count for name, count in sorted(report.fired.items())},
        "kernels": kernel_calls(module),
        "threads": cfg.threads,
        "versions": {"tvm": tvm.__version__, "tvm_fusion": __version__},
        "verification": None,
        "tuning": tuning_metadata(records),
        "fusion_gate": gate.to_json() if gate is not None else None,
    }
    execution = execution_here(cfg.target)
    comparisons: list[OutputComparison] = []
    no_reference: list[str] = []  # why ONNX Runtime could not give a reference, when it could not
    device_code: dict = {}

    def run_and_verify(library: Path) -> dict:
        """Runs on the exported library in the staging directory: what ships is what is checked."""
        updates: dict = {"device_code": dict(device_code)} if device_code else {}
        if execution.how is None:
            if verify:
                say(f"NOT VERIFIED: the artifact cannot run here: {execution.reason} "
                    "(pass --no-verify to say that is intended)")
                updates["verification"] = {"reference": "onnxruntime", "status": "not run",
                                           "reason": execution.reason}
            return updates
        checked_sizes = []
        # A range is checked at its low end, a typical size and its high end: a kernel's tail
        # handling can be wrong at some sizes only.
        for sizes in size_points(ranges_of(prepared.inputs)):
            at = f" at {', '.join(f'{name}={size}' for name, size in sizes.items())}" if sizes else ""
            try:
                inputs, expected = shared.inputs_and_reference(cfg, prepared, verify and not no_reference, sizes)
            except ReferenceUnavailable as err:
                say(f"NOT VERIFIED: {err.message}")
                no_reference.append(err.message)
                updates["verification"] = {"reference": "onnxruntime", "status": "not run", "reason": err.message}
                inputs, expected = shared.inputs_and_reference(cfg, prepared, False, sizes)
            say(f"running the artifact{at} ({'natively' if execution.how == 'native' else 'under qemu-aarch64'})")
            outputs = _run_library(library, metadata, execution.how, inputs)
            if not sizes:
                updates["outputs"] = [{"name": name, "shape": list(value.shape), "dtype": str(value.dtype)}
                                      for name, value in outputs.items()]
            if verify and not no_reference:
                say(f"verifying against ONNX Runtime{at}")
                compared = compare_outputs(outputs, expected, cfg.rtol, cfg.atol)
                if sizes:  # one row per output and size: say which size
                    compared = [dataclasses.replace(c, name=f"{c.name} @{at.removeprefix(' at')}") for c in compared]
                comparisons.extend(compared)
                check_outputs(compared, cfg.rtol, cfg.atol, at)
                checked_sizes.append(sizes)
        if verify and not no_reference:
            updates["verification"] = {"reference": "onnxruntime", "rtol": cfg.rtol, "atol": cfg.atol,
                                       "seed": cfg.seed, "outputs": [c.to_json() for c in comparisons]}
            if checked_sizes != [{}]:
                updates["verification"]["sizes"] = checked_sizes
            if execution.how != "native":
                updates["verification"]["ran"] = "qemu-aarch64"
        return updates

    target_dir = artifact_dir(output_dir, prepared.name, cfg.name)
    options = export_options(cfg.name, cfg.target, device_code)
    say(f"writing {target_dir}")
    with captured_native_stderr([]):  # one "Scope Saving" line per function: noise
        write_artifact(executable, metadata, target_dir, options, run_and_verify)
    from .runtime import METADATA_NAME

    metadata = json.loads((target_dir / METADATA_NAME).read_text())
    if not verify:
        status = "skipped (--no-verify)"
    elif execution.how is None:
        status = f"NOT VERIFIED: {execution.reason}"
    elif no_reference:
        status = f"NOT VERIFIED: {no_reference[0]}"
    else:
        status = "matches ONNX Runtime" + (" (run under qemu-aarch64)" if execution.how == "qemu" else "")
    return TargetResult(target_dir, metadata, report, comparisons, target=cfg.name, verification=status)


def _input_metadata(prepared: PreparedModel) -> list[dict]:
    """Names, shapes, dtypes; for an input that indexes a table (token ids), the valid range,
    which ``CompiledModel.prepare`` checks: TVM's gather does not, and reads out of bounds."""
    tables = onnx_frontend.index_tables(prepared.onnx_model)
    specs = []
    for spec in prepared.inputs:
        entry = spec.to_json()
        if spec.name in tables and spec.dtype not in (*onnx_frontend.FLOAT_DTYPES, "bool"):
            table, rows = tables[spec.name]
            entry.update(index_range=[-rows, rows - 1], index_table=table)  # ONNX Gather: negatives from the end
        specs.append(entry)
    return specs


def _declared_outputs(module, names: list[str]) -> list[dict]:
    """Output names, shapes and dtypes from ``main``'s return type: a symbolic dim as its
    expression over the input ranges (``"sequence"``, ``"(height - 1) // 32 + 1"``)."""
    returned = module["main"].ret_ty
    fields = list(returned.fields) if hasattr(returned, "fields") else [returned]
    specs = []
    for name, field in zip(names, fields):
        try:
            shape = [int(dim) if hasattr(dim, "value") else str(dim) for dim in field.shape.values]
        except (AttributeError, TypeError, ValueError):  # data-dependent: known only from a run
            shape = None
        specs.append({"name": name, "shape": shape, "dtype": str(field.dtype)})
    return specs


def _run_library(library: Path, metadata: dict, how: str, inputs: dict) -> dict:
    """Outputs by name of an exported library run in this process, or under qemu-user."""
    import tvm

    from .targets import run_emulated

    if how == "qemu":
        return run_emulated(library, metadata, inputs)
    with captured_native_stderr([]):  # "Scope Loaded" per function
        module = tvm.runtime.load_module(str(library))
    return CompiledModel(module, metadata).run(inputs)


class _cuda_source_modules:
    """Have TVM keep CUDA kernels as source even where a CUDA runtime is loaded (a GPU host).

    Otherwise it would JIT-compile them (NVRTC by default) at build time; export then compiles
    the source with nvcc for the configured arch (targets.cuda_fatbin_packer) the same way on
    every machine.
    """

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        if self.active:
            self.saved = os.environ.get("TVM_COMPILE_FORCE_FALLBACK")
            os.environ["TVM_COMPILE_FORCE_FALLBACK"] = "1"

    def __exit__(self, *_exc):
        if self.active:
            if self.saved is None:
                os.environ.pop("TVM_COMPILE_FORCE_FALLBACK", None)
            else:
                os.environ["TVM_COMPILE_FORCE_FALLBACK"] = self.saved


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

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["report"] = {"fired": dict(self.report.fired),
                          "near_misses": [dataclasses.asdict(m) for m in self.report.near_misses]}
        data["coverage"] = self.coverage.to_json() if self.coverage is not None else None
        return data


def relax_op_counts(module) -> dict[str, int]:
    """Op name (or kernel name for call_tir) -> count, over ``main``."""
    from tvm import relax

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
    from .provenance import node_index

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
                                 [model.graph.node[i].name or f"#{i}" for i in nodes],
                                 [model.graph.node[i].op_type for i in nodes], nodes))
    return groups


def inspect_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                  graph: str | Path | None = None) -> InspectReport:
    """Op counts before/after fusion, which fusions fired how often (with the ONNX nodes each
    absorbed), and near misses; with ``graph``, the fused graph drawn (.svg/.png/.html)."""
    from .graph_render import check_graph_path, render_fusion_graph
    from .passes import GRAPH_PHASES, fusion_pipeline
    from .provenance import import_with_node_names, node_index

    if graph is not None:
        check_graph_path(graph)  # before the work, not after it
    with captured_native_stderr([]):  # inspection builds nothing; TVM's build warnings are noise here
        prepared = prepare(model_path, config, input_shapes)
        simplified = onnx_frontend.simplify(prepared.onnx_model, prepared.inputs)
        # The same import with bindings named after ONNX nodes, to say what each fusion absorbed.
        named = import_with_node_names(simplified, onnx_frontend.relax_shape_dict(prepared.inputs),
                                       {s.name: s.dtype for s in prepared.inputs})
        report = PatternReport()
        fused = fusion_pipeline(prepared.config, report, phases=GRAPH_PHASES)(named)
        lowered = fusion_pipeline(prepared.config, PatternReport(), phases=("lower",))(fused)
        stock_kernels = stock_kernel_calls(prepared)
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
        fused_ops=relax_op_counts(fused),
        report=report,
        kernels=kernel_calls(lowered),
        stock_kernels=stock_kernels,
        instances=instances,
        coverage=measure_coverage(simplified, instances, report.near_misses),
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
    from . import onnx_export
    from .passes import GRAPH_PHASES, fusion_pipeline
    from .provenance import import_with_node_names

    path = Path(path)
    check_writable(path.parent, f"the fused ONNX file {path.name}", "--onnx")
    with captured_native_stderr([]):
        prepared = prepare(model_path, config, input_shapes)
        simplified = onnx_frontend.simplify(prepared.onnx_model, prepared.inputs)
        named = import_with_node_names(simplified, onnx_frontend.relax_shape_dict(prepared.inputs),
                                       {s.name: s.dtype for s in prepared.inputs})
        report = PatternReport()
        fusion_pipeline(prepared.config, report, phases=GRAPH_PHASES)(named)
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


@dataclasses.dataclass
class BenchReport:
    model: str
    threads: int
    inputs: dict[str, list[int]]
    medians_ms: dict[str, float]
    samples: int
    max_abs_error: dict[str, float]
    peak: MachinePeak | None = None  # this machine's FMA and bandwidth roofs, probed beside the runs

    def ratios(self, baseline: str = "onnxruntime") -> dict[str, float]:
        base = self.medians_ms[baseline]
        return {name: value / base for name, value in self.medians_ms.items()}

    def to_json(self) -> dict:
        data = {**dataclasses.asdict(self), "ratio_to_onnxruntime": self.ratios()}
        if self.peak is not None:
            data["peak"]["ridge_flop_per_byte"] = self.peak.ridge
        return data


def bench_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                repeat: int = 30, warmup: int = 3, include_stock: bool = True,
                tuning_log: str | Path | bool | None = None,
                progress: Progress = _quiet, sizes: dict[str, int] | None = None,
                peers: tuple[str, ...] = ()) -> BenchReport:
    """Median latency of ONNX Runtime, stock TVM and tvm_fusion, interleaved in one process.

    A model compiled for ranges runs at ``sizes`` (dim name -> size; default each range's
    typical size).

    Rounds interleave the runners, in a new random order each round, so that drift in machine
    load and the order they run in affect all of them alike; all use the config's thread count. When tuning records apply, tvm_fusion
    with hand schedules only runs beside it as ``tvm_fusion_untuned``. ``peers`` adds other engines
    (``"openvino"``: see tvm_fusion.peers) to the same rounds. The report carries this machine's
    peaks (tvm_fusion.machine_peak), probed once per machine class.
    """
    from .peers import OpenVinoRunner, check_peers
    from .verify import onnxruntime_feeds, onnxruntime_session, run_onnxruntime

    peers = check_peers(peers)  # a missing package fails now, not after the builds
    native: list[str] = []
    with captured_native_stderr(native):
        prepared = prepare(model_path, config, input_shapes, progress)
        cfg = prepared.config
        set_threads(cfg.threads)
        progress("building tvm_fusion")
        optimized = optimize(prepared, tuning_log, progress)
        models = {"tvm_fusion": CompiledModel(build(optimized.module, cfg), _bench_metadata(prepared))}
        if optimized.tuned:
            models["tvm_fusion_untuned"] = CompiledModel(build(optimize(prepared, False).module, cfg),
                                                         _bench_metadata(prepared))
        if include_stock:
            progress("building stock TVM")
            models["stock_tvm"] = CompiledModel(build_stock(prepared), _bench_metadata(prepared))
    for message in summarize(native):
        progress(f"tvm: {message}")
    ranges = ranges_of(prepared.inputs)
    at = {name: r.typical for name, r in ranges.items()} | (sizes or {})
    run_specs = onnx_frontend.inputs_at(prepared.inputs, at)
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, run_specs, cfg.seed)
    session = onnxruntime_session(prepared.onnx_model, cfg.threads)
    feeds = onnxruntime_feeds(inputs)  # converted once, as the TVM runners' tensors are
    runners = {"onnxruntime": lambda: run_onnxruntime(session, feeds)}
    reference = runners["onnxruntime"]()
    errors = {}

    def max_abs_error(produced: dict) -> float:
        # As float64: a bool output (a mask) has no subtraction of its own.
        return max(float(np.abs(produced[k].astype(np.float64) - reference[k].astype(np.float64)).max(
            initial=0.0)) for k in reference)

    for name, model in models.items():
        tensors = model.prepare(inputs)
        runners[name] = (lambda m, t: lambda: m.run_prepared(t))(model, tensors)
        errors[name] = max_abs_error(model.run(inputs))
    if "openvino" in peers:
        progress("compiling OpenVINO (f32, latency mode)")
        openvino = OpenVinoRunner(model_path, inputs, cfg.threads)
        runners["openvino"] = openvino.run
        openvino.run()
        errors["openvino"] = max_abs_error(openvino.outputs(reference))
    progress("probing this machine's peaks (cached per machine class)")
    peak = machine_peak(cfg)
    times: dict[str, list[float]] = {name: [] for name in runners}
    order, shuffler = list(runners), random.Random(cfg.seed)
    for round_index in range(warmup + repeat):
        # A new order each round: whichever runs right after another pays for its leftover
        # threads and cache state, so no runtime may always follow the same one.
        shuffler.shuffle(order)
        for name in order:
            run = runners[name]
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
        if round_index == warmup:
            progress(f"timing {repeat} interleaved rounds")
    return BenchReport(
        model=prepared.name, threads=cfg.threads,
        inputs={s.name: list(s.shape) for s in run_specs},
        medians_ms={name: float(np.median(values)) * 1e3 for name, values in times.items()},
        samples=repeat, max_abs_error=errors, peak=peak)


def _bench_metadata(prepared: PreparedModel) -> dict:
    return {"inputs": [s.to_json() for s in prepared.inputs],
            "dims": {name: r.to_json() for name, r in ranges_of(prepared.inputs).items()},
            "outputs": [{"name": n} for n in prepared.output_names],
            "threads": prepared.config.threads}


from .ablate import ablate_model  # noqa: E402  (they import from this module)
from .profile import profile_model  # noqa: E402

__all__ = ["CompileResult", "TargetResult", "InspectReport", "BenchReport", "compile_model",
           "compile_targets", "inspect_model", "bench_model", "profile_model", "ablate_model", "prepare",
           "optimize", "TvmFusionError"]
