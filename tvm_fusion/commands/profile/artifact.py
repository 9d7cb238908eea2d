"""``profile ARTIFACT`` and ``bench ARTIFACT``: the kernels a built artifact runs, not a fresh
build that may differ.

The artifact's metadata says what it was built from (``metadata.built_from``): the model file,
the config as loaded, the tuning-log root, the input shapes and the bindings the fusion gate left
unfused. ``profile`` builds the same kernels from them, for what only a build has (each kernel's
FLOPs, bytes and ONNX nodes, and the empty-kernel twin that times dispatch), checks they are the
ones in the artifact's library, and times that library itself. Anything that would make them
differ (the model file gone or edited, another tuning log, a range of sizes) is refused with the fix.
``bench`` times the library beside ONNX Runtime and stock TVM on the model it was built from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import tvm
from tvm import relax

from ...build import kernel_calls
from ...config import PipelineConfig
from ...errors import ArtifactError, ModelError, ShapeError, TvmFusionError
from ...files import sha256_of
from ...frontend.dims import DimRange
from ...metadata import config_from_json
from ...native_log import captured_native_stderr
from ...runtime import load


@dataclasses.dataclass
class ArtifactBuild:
    """What an artifact was built from, checked against what is on disk now."""

    directory: Path
    library: object               # the artifact's model.so, loaded (a tvm.runtime.Module)
    metadata: dict
    model_path: Path
    config: PipelineConfig
    input_shapes: dict[str, tuple | int | float]  # as ``parse_input_shapes`` takes them
    tuning_log: str | bool        # the log root, or False: built without tuning records
    excluded: frozenset[str]      # bindings the fusion gate undid

    @property
    def name(self) -> str:
        return self.directory.name


def is_artifact(path: str | Path) -> bool:
    return Path(path).is_dir()


def read_artifact(directory: str | Path, config=None, input_shapes=None, tuning_log=None,
                  command: str = "profile", precision: str | None = None) -> ArtifactBuild:
    """The artifact at ``directory``, its library loaded and checked (``runtime.load``), and the
    model, config, shapes and tuning log it was built from; errors for what cannot reproduce it.
    ``profile`` times each kernel at one size, so it refuses an artifact built for ranges."""
    directory = Path(directory)
    given = [flag for flag, value in (("--config", config), ("--input-shape", input_shapes),
                                      ("--tuning-log/--no-tuning-log", tuning_log), ("--precision", precision))
             if value not in (None, [], {})]
    if given:
        raise TvmFusionError(f"{directory} is an artifact: it was built with its own config, precision, input "
                             f"shapes and tuning log, and {command} uses those; {', '.join(given)} would {command} other "
                             "kernels", f"drop {', '.join(given)}, or {command} the ONNX model instead of the artifact")
    metadata = load(directory).metadata  # checks the library's sha256 and that it runs here
    kind = metadata.get("target", {}).get("kind", "llvm")
    if kind != "llvm":
        raise ArtifactError(f"{directory} was built for {kind}: {command} times CPU (llvm) kernels only",
                            f"{command} an artifact built with a CPU config, e.g. --config x86_64-host")
    source = metadata.get("built_from") or {}
    if not source.get("model_path") or not source.get("config"):
        raise ArtifactError(f"{directory} does not say which model file and config it was built from "
                            "(built by an older tvm_fusion)",
                            f"rebuild it with `tvm-fusion compile`, or {command} its ONNX model with --config")
    model_path = Path(source["model_path"])
    if command == "profile":
        _refuse_ranges(directory, metadata, model_path)
    _check_model(directory, model_path, metadata.get("model_sha256"))
    with captured_native_stderr([]):  # "Scope Loaded" per function
        library = tvm.runtime.load_module(str(directory / metadata["library"]))
    gate = metadata.get("fusion_gate") or {}
    return ArtifactBuild(
        directory, library, metadata, model_path, config_from_json(source["config"]),
        artifact_input_shapes(metadata),
        source["tuning_log"] or False,
        frozenset(name for failure in gate.get("undone", []) for name in failure["bindings"]))


def artifact_input_shapes(metadata: dict) -> dict[str, tuple | int | float]:
    """The input shapes an artifact was built for: sizes, ranges as (low, high, step), and
    pinned values."""
    ranges = metadata.get("dims", {})

    def dim(value):
        if isinstance(value, str):
            r = ranges[value]
            return (r["min"], r["max"], r.get("step", 1))
        return value

    return {spec["name"]: spec["value"] if "value" in spec else tuple(dim(d) for d in spec["shape"])
            for spec in metadata["inputs"]}


def _refuse_ranges(directory: Path, metadata: dict, model_path: Path) -> None:
    """An artifact compiled for a range of sizes: its kernels take any size, profile times one."""
    ranges = [DimRange(name, r["min"], r["max"], r.get("step", 1)) for name, r in metadata.get("dims", {}).items()]
    if ranges:
        listed = ", ".join(f"{r.name} {r}" for r in ranges)
        raise ShapeError(f"profile runs the model at one size, but the artifact {directory} was compiled for "
                         f"ranges ({listed})",
                         f"profile its model at one size, e.g. the typical size "
                         f"{', '.join(f'{r.name}={r.typical}' for r in ranges)}: tvm-fusion profile {model_path} "
                         "--input-shape NAME:DIMxDIM")


def _check_model(directory: Path, model_path: Path, expected: str | None) -> None:
    """The model file the artifact names is there and holds the model it was built from."""
    rebuild = f"or rebuild the artifact from the model you have: tvm-fusion compile MODEL.onnx -o {directory.parent}"
    if not model_path.is_file():
        raise ModelError(f"the model file {model_path}, which the artifact {directory} was built from, is missing",
                         f"put the model back at {model_path}, {rebuild}")
    actual = sha256_of(model_path)
    if expected is not None and actual != expected:
        raise ModelError(f"the model file {model_path} has changed since the artifact {directory} was built from it "
                         f"(sha256 {actual[:12]}..., the artifact's {expected[:12]}...)",
                         f"restore the model it was built from at {model_path}, {rebuild}")


def check_same_kernels(build: ArtifactBuild, module, tuned: list[str], kernels: set[str], args: list) -> None:
    """The kernels built again are the artifact's: the same tuned kernels and number of kernel
    calls, and every kernel its library calls (in one run on ``args``) among ``kernels``, so that
    no kernel is given another's FLOPs, bytes and ONNX nodes."""
    metadata, fix = build.metadata, "rebuild the artifact with `tvm-fusion compile`, then profile it"
    built_tuned = sorted((metadata.get("tuning") or {}).get("tuned_kernels", []))
    if built_tuned != sorted(tuned):
        raise ArtifactError(f"the tuning log {build.tuning_log or '(none)'} now schedules other kernels than when "
                            f"{build.directory} was built (tuned then: {len(built_tuned)}, now: {len(tuned)})", fix)
    called: set[str] = set()

    def note(_func, name, before_run, _ret, *_args):
        if before_run:
            called.add(name)
        return relax.VMInstrumentReturnKind.NO_OP

    vm = relax.VirtualMachine(build.library, tvm.cpu())
    vm.set_instrument(note)
    vm["main"](*args)
    # What the VM calls that the library does not implement is the runtime's own (vm.builtin.*).
    unknown = sorted(name for name in called - kernels if build.library.implements_function(name, True))
    calls = kernel_calls(module)
    if unknown or calls != metadata.get("kernels", calls):
        what = (f"its library calls {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}, not built again"
                if unknown else f"{calls} kernel calls, the artifact makes {metadata['kernels']}")
        raise ArtifactError(f"building {build.model_path} again as {build.directory} was built gives other kernels "
                            f"({what}): tvm_fusion or TVM changed since", fix)
