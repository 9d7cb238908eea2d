"""``bench``: median latency of ONNX Runtime, stock TVM and tvm_fusion (and peers), timed in
interleaved rounds in one process, beside this machine's FMA and bandwidth peaks."""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections.abc import Callable
from pathlib import Path

from ..frontend import onnx as onnx_frontend
from ..frontend.dims import ranges_of
from ..runtime.latency import LatencyStats, load_average, noise_warning
from ..machine_peak import MachinePeak, machine_peak
from ..metadata import bench_metadata, bf16_kernels
from ..native_log import captured_native_stderr, summarize
from ..config import with_precision
from ..preparation import Progress, ShapeArg, quiet, resolve_config
from ..runtime import CompiledModel, set_threads
from ..session import ModelSession
from ..verify import onnxruntime_feeds, onnxruntime_session, reference_outputs, run_onnxruntime
from ..accuracy.output_error import cosine_similarity, max_abs_error, max_rel_error
from .peers import OPENVINO_ROWS, OpenVinoRunner, check_peers
from .profile.artifact import is_artifact, read_artifact


@dataclasses.dataclass
class BenchReport:
    model: str
    threads: int
    inputs: dict[str, list]  # each dim a size: ranges are at the size timed
    samples_ms: dict[str, list[float]]  # every timed run, by runner
    rounds: int
    max_abs_error: dict[str, float]  # by runner, the worst over the outputs (as the two below)
    peak: MachinePeak | None = None  # this machine's FMA and bandwidth roofs, probed beside the runs
    load_average: dict[str, float] = dataclasses.field(default_factory=dict)  # "before", "after"
    max_rel_error: dict[str, float] = dataclasses.field(default_factory=dict)
    cosine_similarity: dict[str, float] = dataclasses.field(default_factory=dict)
    # A peer's rows: the inference precision the engine reports it chose ("f32", "bf16").
    peer_precision: dict[str, str] = dataclasses.field(default_factory=dict)
    # The kernels of the tvm_fusion_bf16 row that sum bf16 products (empty: no such row).
    bf16_kernels: list[str] = dataclasses.field(default_factory=list)

    @functools.cached_property
    def stats(self) -> dict[str, LatencyStats]:
        return {name: LatencyStats.of([ms / 1e3 for ms in values]) for name, values in self.samples_ms.items()}

    @property
    def medians_ms(self) -> dict[str, float]:
        return {name: stats.median_ms for name, stats in self.stats.items()}

    def noise_warning(self) -> str | None:
        return noise_warning(self.stats, self.threads, self.load_average.get("before", 0.0),
                             self.load_average.get("after", 0.0))

    def ratios(self, baseline: str = "onnxruntime") -> dict[str, float]:
        base = self.medians_ms[baseline]
        return {name: value / base for name, value in self.medians_ms.items()}

    def to_json(self) -> dict:
        data = {**dataclasses.asdict(self), "medians_ms": self.medians_ms, "ratio_to_onnxruntime": self.ratios(),
                "stats": {name: s.to_json() for name, s in self.stats.items()}, "noise": self.noise_warning()}
        if self.peak is not None:
            data["peak"]["ridge_flop_per_byte"] = self.peak.ridge
        return data


def bench_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                repeat: int = 30, warmup: int = 3, include_stock: bool = True,
                tuning_log: str | Path | bool | None = None,
                progress: Progress = quiet, sizes: dict[str, int] | None = None,
                peers: tuple[str, ...] = (), precision: str | None = None) -> BenchReport:
    """Median latency of ONNX Runtime, stock TVM and tvm_fusion, interleaved in one process.

    A model compiled for ranges runs at ``sizes`` (dim name -> size; default each range's
    typical size).

    Rounds interleave the runners, in a new random order each round, so that drift in machine
    load and the order they run in affect all of them alike; all use the config's thread count. When tuning records apply, tvm_fusion
    with hand schedules only runs beside it as ``tvm_fusion_untuned``. ``peers`` adds other engines
    (``"openvino"``: see tvm_fusion.commands.peers; it adds a row at f32 and one at its default
    precision) to the same rounds. Every runner's outputs are checked against ONNX Runtime float32
    on the same inputs (tvm_fusion.accuracy.output_error). The report carries this machine's peaks
    (tvm_fusion.machine_peak), probed once per machine class.

    ``model_path`` may be an artifact directory written by ``compile``: then its own library is
    timed as ``tvm_fusion``, beside the model it was built from, with the config and input shapes
    it was built with (passing them is an error). ``precision`` (``--precision``) replaces the
    config's; where it builds bf16 kernels (bf16, or auto on AMX-BF16 or AVX512_BF16), the model is timed at
    float32 (``tvm_fusion``) and at bf16 (``tvm_fusion_bf16``) in the same rounds.
    """
    peers = check_peers(peers)  # a missing package fails now, not after the builds
    artifact = None
    if is_artifact(model_path):
        artifact = read_artifact(model_path, config, input_shapes, tuning_log, command="bench", precision=precision)
        progress(f"benchmarking {artifact.directory}, built from {artifact.model_path}")
        model_path, config, tuning_log = artifact.model_path, artifact.config, artifact.tuning_log
        input_shapes = dict(artifact.input_shapes)
    native: list[str] = []
    with captured_native_stderr(native):
        session = ModelSession(model_path, input_shapes, progress)
        prepared = session.prepared(config if artifact else with_precision(resolve_config(config), precision))
        cfg = prepared.config
        set_threads(cfg.threads)
        bf16: list[str] = []
        if artifact:
            models = {"tvm_fusion": CompiledModel(artifact.library, artifact.metadata)}
        else:
            models, bf16 = _our_models(session, prepared, tuning_log, progress)
        if include_stock:
            progress("building stock TVM")
            models["stock_tvm"] = CompiledModel(session.stock_built(cfg), bench_metadata(prepared))
    for message in summarize(native):
        progress(f"tvm: {message}")
    # Before any peer runs: OpenVINO's worker threads keep spinning after a run, and a probe
    # beside them measured half the FMA peak.
    progress("probing this machine's peaks (cached per machine class)")
    peak = machine_peak(cfg)
    ranges = ranges_of(prepared.inputs)
    at = {name: r.typical for name, r in ranges.items()} | (sizes or {})
    run_specs = onnx_frontend.inputs_at(prepared.inputs, at)
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, run_specs, cfg.seed)
    session = onnxruntime_session(prepared.onnx_model, cfg.threads)
    feeds = onnxruntime_feeds(inputs)  # converted once, as the TVM runners' tensors are
    runners: dict[str, Callable[[], object]] = {"onnxruntime": lambda: run_onnxruntime(session, feeds)}
    # The timed session's integer products may be CPU-dependent (verify.onnxruntime_session).
    reference = reference_outputs(prepared.onnx_model, inputs, cfg.threads)
    errors: dict[str, dict[str, float]] = {"max_abs_error": {}, "max_rel_error": {}, "cosine_similarity": {}}

    def check(name: str, produced: dict) -> None:
        # The worst output decides: the largest errors, the smallest cosine.
        for metric, worst in ((max_abs_error, max), (max_rel_error, max), (cosine_similarity, min)):
            errors[metric.__name__][name] = worst(metric(produced[k], reference[k]) for k in reference)

    for name, model in models.items():
        tensors = model.prepare(inputs)
        runners[name] = (lambda m, t: lambda: m.run_prepared(t))(model, tensors)
        check(name, model.run(inputs))
    peer_precision: dict[str, str] = {}
    if "openvino" in peers:
        for name, pinned in OPENVINO_ROWS:
            progress(f"compiling OpenVINO ({pinned or 'its default precision'}, latency mode)")
            openvino = OpenVinoRunner(model_path, inputs, cfg.threads, pinned)
            runners[name], peer_precision[name] = openvino.run, openvino.precision
            openvino.run()
            check(name, openvino.outputs(reference))
    times: dict[str, list[float]] = {name: [] for name in runners}
    load_before = load_average()
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
        samples_ms={name: [t * 1e3 for t in values] for name, values in times.items()},
        rounds=repeat, peak=peak, load_average={"before": load_before, "after": load_average()},
        peer_precision=peer_precision, bf16_kernels=bf16, **errors)


def _our_models(session: ModelSession, prepared, tuning_log, progress: Progress) -> tuple[dict, list[str]]:
    """tvm_fusion built from the model: always at float32 (``tvm_fusion``); where the config
    builds bf16 kernels, at bf16 too (``tvm_fusion_bf16``), so that one run shows what bf16
    gains and what it costs in error against the same float32 rounds. Returns the models and
    the bf16 build's bf16 kernels."""
    cfg = prepared.config
    float32 = dataclasses.replace(cfg, precision="float32")
    meta = bench_metadata(prepared)
    progress("building tvm_fusion")
    models = {"tvm_fusion": CompiledModel(session.built(float32, tuning_log), meta)}
    if session.scheduled(float32, tuning_log).tuned:
        models["tvm_fusion_untuned"] = CompiledModel(session.built(float32, False), meta)
    if not cfg.bf16_kernels():
        return models, []
    progress("building tvm_fusion at bf16")
    models["tvm_fusion_bf16"] = CompiledModel(session.built(cfg, tuning_log), meta)
    bf16 = bf16_kernels(session.scheduled(cfg, tuning_log).module)
    if not bf16:
        progress("WARNING: no matmul by a constant float32 weight became a bf16 kernel: "
                 "tvm_fusion_bf16 computes in float32")
    return models, bf16
