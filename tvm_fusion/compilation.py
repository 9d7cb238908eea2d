"""Compile a model for one or more targets: import and fuse once, then per target lower,
schedule, build, export, and check the exported library against ONNX Runtime at each size."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from .buckets import bucket_points, bucket_suffix, bucket_text, parse_bucket, with_buckets
from .build import build, callable_module, kernel_calls, load_tuning
from .config import PipelineConfig
from .errors import ArtifactError, ConfigError, TvmFusionError, VerificationError
from .export import artifact_dir, write_artifact
from .files import check_writable
from .frontend import onnx as onnx_frontend
from .frontend.dims import ranges_of, size_points
from .metadata import artifact_metadata
from .native_log import captured_native_stderr, summarize
from .patterns import PatternReport
from .preparation import PreparedModel, Progress, ShapeArg, prepare, prepare_at, quiet, resolve_config
from .runtime import CompiledModel
from .verify import OutputComparison, ReferenceUnavailable, check_outputs, compare_outputs, reference_outputs


@dataclasses.dataclass
class CompileResult:
    artifact: Path | None
    metadata: dict
    report: PatternReport
    comparisons: list[OutputComparison]


def compile_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                  output_dir: str | Path = "build", verify: bool = True,
                  progress: Progress = quiet, tuning_log: str | Path | bool | None = None,
                  fusion_gate: bool = True, buckets: list[str] | None = None) -> CompileResult:
    """Compile an ONNX model into ``<output_dir>/<model>.<target>/``, verified against ONNX Runtime.

    With ``verify`` a mismatch raises VerificationError and nothing is written. One target of
    ``compile_targets``, whose error (missing toolchain, mismatch) is raised here.
    """
    (result,) = compile_targets(model_path, [config], input_shapes, output_dir, verify, progress,
                                tuning_log=tuning_log, fusion_gate=fusion_gate, buckets=buckets)
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
                    progress: Progress = quiet, tuning_log: str | Path | bool | None = None,
                    fusion_gate: bool = True, buckets: list[str] | None = None) -> list[TargetResult]:
    """Compile one model for several targets (configs) into ``<output_dir>/<model>.<target>/`` each.

    The ONNX import runs once per distinct ``[inputs]`` table and the fusion phases once per
    distinct pattern list; lowering, schedules, build and export run per target. A target
    whose toolchain is missing, or whose artifact disagrees with ONNX Runtime, gets its error
    in its result and the other targets still build; a bad model, config or shape raises.
    Each artifact is run (natively or under qemu-user) and compared with ONNX Runtime before
    it is committed; where it cannot run here (CUDA without a GPU), or ONNX Runtime cannot run
    the model (no kernel for an op at its dtype), its result says so. With ``fusion_gate``, each
    fused instance is checked against its unfused nodes first and undone if it differs
    (``fusion_gate.py``; on targets that run here). ``buckets`` (``["sequence=128", ...]``, as
    ``--bucket`` takes them) replaces the configs' ``[buckets] sizes`` (see ``buckets.py``).
    """
    from .targets import ToolchainError, check_toolchain, execution_here

    started = time.perf_counter()
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ArtifactError(f"output directory {output_dir} is an existing file",
                            "pass a directory with -o/--output-dir")
    check_writable(output_dir, "the artifact", "-o/--output-dir")
    configs = [resolve_config(config) for config in (configs or [None])]
    if buckets is not None:
        points = tuple(parse_bucket(text, "--bucket") for text in buckets)
        configs = [dataclasses.replace(cfg, buckets=points) for cfg in configs]
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
                self.progress(f"running the tvm_fusion pipeline ({len(cfg.patterns)} patterns)")
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

    def prepare_at(self, cfg: PipelineConfig, prepared: PreparedModel, sizes: dict[str, int]) -> PreparedModel:
        """``prepared``'s model at one exact size of its ranges (a shape bucket): imported static."""
        key = (id(prepared), tuple(sorted(sizes.items())))
        if key not in self.prepared:
            self.prepared[key] = prepare_at(prepared, cfg, sizes, self.progress)
        return self.prepared[key]

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
    from .passes import fusion_pipeline
    from .targets import execution_here, export_options, platform_of, unscheduled_gpu_kernels

    native: list[str] = []
    with captured_native_stderr(native):
        prepared = shared.prepare(cfg)
        ranges = ranges_of(prepared.inputs)
        points = bucket_points(cfg.buckets, ranges)
        records = load_tuning(cfg, tuning_log, say)
        rules: dict[str, str] = {}

        def scheduled(prepared: PreparedModel, suffix: str = ""):
            """The fused, lowered and scheduled module of ``prepared``, with its pattern report
            and fusion gate result; its kernels' rules go to ``rules`` (names + ``suffix``)."""
            gate = None
            if gate_config is not None:
                fused, report, gate = shared.gated_fuse(dataclasses.replace(gate_config, patterns=cfg.patterns),
                                                        prepared, say)
            else:
                fused, report = shared.fuse(cfg, prepared)
            log: dict[str, str] = {}
            before = dict(records.applied) if records else {}
            module = callable_module(fusion_pipeline(cfg, PatternReport(), phases=("lower", "schedule"),
                                                     tuning=records, schedule_log=log)(fused), prepared)
            rules.update({name + suffix: rule for name, rule in log.items()})
            if records and suffix:  # a bucket's tuned kernels, under their names in the artifact
                tuned = {name: kernel for name, kernel in records.applied.items() if before.get(name) is not kernel}
                records.applied = {**before, **{name + suffix: kernel for name, kernel in tuned.items()}}
            return module, report, gate

        module, report, gate = scheduled(prepared)
        dynamic_module, specialized = module, []
        for point in points:
            say(f"bucket {bucket_text(point)}: a static build for that exact size")
            static_module, _report, static_gate = scheduled(shared.prepare_at(cfg, prepared, point),
                                                            bucket_suffix(point))
            specialized.append((point, static_module, static_gate))
        if specialized:
            module = with_buckets(module, [(point, static) for point, static, _gate in specialized], ranges)
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
    metadata = artifact_metadata(prepared, cfg, dynamic_module, plat, toolchain, report, records, gate, rules)
    if specialized:
        metadata["buckets"] = [{"sizes": point, "kernels": kernel_calls(static),
                                "fusion_gate": static_gate.to_json() if static_gate is not None else None}
                               for point, static, static_gate in specialized]
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
        # A range is checked at its low end, a typical size and its high end (a kernel's tail
        # handling can be wrong at some sizes only), and at every bucket (its own kernels).
        checked_at = size_points(ranges)
        for sizes in checked_at + [point for point in points if point not in checked_at]:
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
        write_artifact(executable, metadata, target_dir, options, run_and_verify, export_state=device_code)
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
