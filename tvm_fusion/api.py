"""The Python API: compile, inspect and bench, usable without the CLI.

Each entry point takes a model path, an optional config (path or PipelineConfig) and optional
input shapes, and raises a ``TvmFusionError`` subclass for anything the user can fix.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from . import __version__
from .config import PipelineConfig, load_config
from .errors import ArtifactError, TvmFusionError
from .export import artifact_dir, write_artifact
from .frontend import onnx as onnx_frontend
from .native_log import captured_native_stderr, summarize
from .patterns import PatternReport
from .runtime import CompiledModel, set_threads
from .verify import OutputComparison, check_outputs, compare_outputs, reference_outputs

Progress = Callable[[str], None]
ShapeArg = dict[str, tuple[int, ...]] | list[str] | None


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


@dataclasses.dataclass
class CompileResult:
    artifact: Path | None
    metadata: dict
    report: PatternReport
    comparisons: list[OutputComparison]


def resolve_config(config: str | Path | PipelineConfig | None) -> PipelineConfig:
    return config if isinstance(config, PipelineConfig) else load_config(config)


def parse_input_shapes(shapes: ShapeArg) -> dict[str, tuple[int, ...]]:
    if not shapes:
        return {}
    if isinstance(shapes, dict):
        return {name: tuple(dims) for name, dims in shapes.items()}
    return dict(onnx_frontend.parse_shape_flag(flag) for flag in shapes)


def prepare(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
            progress: Progress = _quiet) -> PreparedModel:
    """Load, bind shapes, simplify (onnxslim) and import into Relax."""
    cfg = resolve_config(config)
    model = onnx_frontend.load_onnx(model_path)
    specs = onnx_frontend.bind_input_shapes(model, parse_input_shapes(input_shapes), cfg.dim_defaults)
    progress("simplifying shape subgraphs at " + ", ".join(f"{s.name}:{'x'.join(map(str, s.shape))}"
                                                           for s in specs))
    simplified = onnx_frontend.simplify(model, specs)
    progress(f"importing {len(simplified.graph.node)} ONNX nodes into Relax")
    module = onnx_frontend.import_model(simplified, specs)
    return PreparedModel(cfg, Path(model_path).stem, model, specs,
                         onnx_frontend.output_specs(model), module)


def optimize(prepared: PreparedModel) -> OptimizedModule:
    """Run the configured tvm_fusion pipeline: canonicalize, fuse, lower, schedule."""
    from .passes import fusion_pipeline

    report = PatternReport()
    schedule_log: dict[str, str] = {}
    module = fusion_pipeline(prepared.config, report, schedule_log=schedule_log)(prepared.relax_module)
    return OptimizedModule(module, report, schedule_log)


def build(module, config: PipelineConfig):
    import tvm

    return tvm.compile(module, target=config.tvm_target())


def build_stock(prepared: PreparedModel):
    """Stock TVM: its default pipeline on the same imported module (no fusion, no schedules on CPU)."""
    import tvm

    return tvm.compile(prepared.relax_module, target=prepared.config.tvm_target())


def kernel_calls(module) -> int:
    """How many kernel launches one call of ``main`` makes (call_tir sites)."""
    from tvm import relax

    count = 0

    def visit(expr):
        nonlocal count
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            count += 1

    relax.analysis.post_order_visit(module["main"], visit)
    return count


def stock_kernel_calls(prepared: PreparedModel) -> int:
    from .passes import stock_fusion_pipeline

    return kernel_calls(stock_fusion_pipeline()(prepared.relax_module))


def _sha256(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString()).hexdigest()


def compile_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                  output_dir: str | Path = "build", verify: bool = True,
                  progress: Progress = _quiet) -> CompileResult:
    """Compile an ONNX model into ``<output_dir>/<model>.<target>/``, verified against ONNX Runtime.

    With ``verify`` a mismatch raises VerificationError and nothing is written.
    """
    import tvm

    started = time.perf_counter()
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ArtifactError(f"output directory {output_dir} is an existing file",
                            "pass a directory with -o/--output-dir")
    native: list[str] = []
    with captured_native_stderr(native):
        prepared = prepare(model_path, config, input_shapes, progress)
        cfg = prepared.config
        progress(f"running the tvm_fusion pipeline ({', '.join(cfg.patterns)})")
        optimized = optimize(prepared)
        progress("building for " + str(cfg.target))
        executable = build(optimized.module, cfg)
    for message in summarize(native):
        progress(f"tvm: {message}")
    metadata = {
        "model": prepared.name,
        "model_sha256": _sha256(prepared.onnx_model),
        "inputs": [spec.to_json() for spec in prepared.inputs],
        "outputs": [],
        "target": cfg.target,
        "config": cfg.name,
        "pipeline": list(cfg.patterns),
        "schedule": cfg.schedule,
        "fusions": {name: count for name, count in sorted(optimized.report.fired.items())},
        "kernels": kernel_calls(optimized.module),
        "threads": cfg.threads,
        "versions": {"tvm": tvm.__version__, "tvm_fusion": __version__},
    }
    comparisons: list[OutputComparison] = []
    # Output shapes come from running it once; ONNX files often leave them symbolic.
    compiled = CompiledModel(executable, {**metadata, "outputs": [{"name": n} for n in prepared.output_names]})
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, prepared.inputs, cfg.seed)
    outputs = compiled.run(inputs)
    metadata["outputs"] = [{"name": name, "shape": list(value.shape), "dtype": str(value.dtype)}
                           for name, value in outputs.items()]
    if verify:
        progress("verifying against ONNX Runtime")
        expected = reference_outputs(prepared.onnx_model, inputs, cfg.threads)
        comparisons = compare_outputs(outputs, expected, cfg.rtol, cfg.atol)
        check_outputs(comparisons, cfg.rtol, cfg.atol)
        metadata["verification"] = {"reference": "onnxruntime", "rtol": cfg.rtol, "atol": cfg.atol,
                                    "seed": cfg.seed, "outputs": [c.to_json() for c in comparisons]}
    else:
        metadata["verification"] = None
    target_dir = artifact_dir(output_dir, prepared.name, cfg.name)
    progress(f"writing {target_dir}")
    with captured_native_stderr([]):  # one "Scope Saving" line per function: noise
        write_artifact(executable, metadata, target_dir)
    progress(f"done in {time.perf_counter() - started:.1f} s")
    return CompileResult(target_dir, metadata, optimized.report, comparisons)


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

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["report"] = {"fired": dict(self.report.fired),
                          "near_misses": [dataclasses.asdict(m) for m in self.report.near_misses]}
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


def inspect_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None) -> InspectReport:
    """Op counts before/after fusion, which fusions fired how often, and near misses."""
    from .passes import fusion_pipeline

    with captured_native_stderr([]):  # inspection builds nothing; TVM's build warnings are noise here
        prepared = prepare(model_path, config, input_shapes)
        report = PatternReport()
        fused = fusion_pipeline(prepared.config, report, phases=("canonicalize", "fuse"))(prepared.relax_module)
        lowered = fusion_pipeline(prepared.config, PatternReport(), phases=("lower",))(fused)
        stock_kernels = stock_kernel_calls(prepared)
    simplified = onnx_frontend.simplify(prepared.onnx_model, prepared.inputs)
    return InspectReport(
        model=prepared.name,
        onnx_ops=dict(collections.Counter(n.op_type for n in prepared.onnx_model.graph.node).most_common()),
        onnx_ops_simplified=dict(collections.Counter(n.op_type for n in simplified.graph.node).most_common()),
        relax_ops=relax_op_counts(prepared.relax_module),
        fused_ops=relax_op_counts(fused),
        report=report,
        kernels=kernel_calls(lowered),
        stock_kernels=stock_kernels,
    )


@dataclasses.dataclass
class BenchReport:
    model: str
    threads: int
    inputs: dict[str, list[int]]
    medians_ms: dict[str, float]
    samples: int
    max_abs_error: dict[str, float]

    def ratios(self, baseline: str = "onnxruntime") -> dict[str, float]:
        base = self.medians_ms[baseline]
        return {name: value / base for name, value in self.medians_ms.items()}

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "ratio_to_onnxruntime": self.ratios()}


def bench_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                repeat: int = 30, warmup: int = 3, include_stock: bool = True,
                progress: Progress = _quiet) -> BenchReport:
    """Median latency of ONNX Runtime, stock TVM and tvm_fusion, interleaved in one process.

    Rounds interleave the runners (A B C A B C ...) so that drift in machine load affects all
    of them alike; all use the config's thread count.
    """
    from .verify import onnxruntime_session

    native: list[str] = []
    with captured_native_stderr(native):
        prepared = prepare(model_path, config, input_shapes, progress)
        cfg = prepared.config
        set_threads(cfg.threads)
        progress("building tvm_fusion")
        models = {"tvm_fusion": CompiledModel(build(optimize(prepared).module, cfg),
                                              _bench_metadata(prepared))}
        if include_stock:
            progress("building stock TVM")
            models["stock_tvm"] = CompiledModel(build_stock(prepared), _bench_metadata(prepared))
    for message in summarize(native):
        progress(f"tvm: {message}")
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, prepared.inputs, cfg.seed)
    session = onnxruntime_session(prepared.onnx_model, cfg.threads)
    output_names = [o.name for o in session.get_outputs()]
    runners = {"onnxruntime": lambda: session.run(output_names, inputs)}
    reference = dict(zip(output_names, runners["onnxruntime"]()))
    errors = {}
    for name, model in models.items():
        tensors = model.prepare(inputs)
        runners[name] = (lambda m, t: lambda: m.run_prepared(t))(model, tensors)
        produced = model.run(inputs)
        errors[name] = max(float(np.abs(produced[k] - reference[k]).max()) for k in reference)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(warmup + repeat):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
        if round_index == warmup:
            progress(f"timing {repeat} interleaved rounds")
    return BenchReport(
        model=prepared.name, threads=cfg.threads,
        inputs={s.name: list(s.shape) for s in prepared.inputs},
        medians_ms={name: float(np.median(values)) * 1e3 for name, values in times.items()},
        samples=repeat, max_abs_error=errors)


def _bench_metadata(prepared: PreparedModel) -> dict:
    return {"inputs": [s.to_json() for s in prepared.inputs],
            "outputs": [{"name": n} for n in prepared.output_names],
            "threads": prepared.config.threads}


__all__ = ["CompileResult", "InspectReport", "BenchReport", "compile_model", "inspect_model",
           "bench_model", "prepare", "optimize", "TvmFusionError"]
