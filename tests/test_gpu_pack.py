"""The GPU check's pack (scripts/gpu_check.sh --pack, scripts/gpu_pack/): its CPU twin, built for
an llvm config, runs through the pack's own run.sh in a virtualenv that has numpy and no TVM,
and its results say the artifact matched ONNX Runtime. The same run.sh runs the CUDA pack on a
GPU machine (docs/gpu-check.md); .ci/run repeats this with a venv made by pip from scratch.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACK_SOURCES = ROOT / "scripts" / "gpu_pack"
MODEL = "examples/models/bert_tiny.onnx:input_ids:1x32,attention_mask:1x32"
# What a file that runs on the GPU machine may import: the standard library, numpy, torch, and
# the pack's own torch_models.
GPU_MACHINE_IMPORTS = set(sys.stdlib_module_names) | {"numpy", "torch", "torch_models"}


def _pack(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--pack", str(out),
                           "--config", "x86_64-avx2", "--model", MODEL, "--warmup", "1", "--repeat", "3", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("twin") / "pack"
    done = _pack(out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def numpy_only_python(tmp_path_factory) -> Path:
    """A fresh virtualenv (no pip, so no download) that sees numpy and nothing else of ours."""
    root = tmp_path_factory.mktemp("venv")
    venv.create(root / "env", with_pip=False)
    python = root / "env" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shelf = root / "numpy_only"
    shelf.mkdir()
    installed = Path(numpy.__file__).resolve().parent
    for name in ("numpy", "numpy.libs"):
        if (installed.parent / name).exists():
            (shelf / name).symlink_to(installed.parent / name)
    (Path(site) / "numpy_only.pth").write_text(f"{shelf}\n")
    return python


def _run(pack: Path, python: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHON=str(python), OUT=str(out), PATH=f"{python.parent}:{env.get('PATH', '')}")
    return subprocess.run([str(pack / "run.sh"), *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=out.parent)


def test_the_venv_cannot_import_tvm(numpy_only_python):
    for module in ("tvm", "tvm_ffi", "tvm_fusion", "onnx", "onnxruntime"):
        done = subprocess.run([str(numpy_only_python), "-c", f"import {module}"], capture_output=True,
                              cwd=numpy_only_python.parent)  # not the checkout, whose tvm_fusion/ -c would see
        assert done.returncode != 0, f"{module} is importable in the numpy-only venv"
    subprocess.run([str(numpy_only_python), "-c", "import numpy"], check=True)


def test_the_pack_holds_runtime_runner_inputs_and_references(twin):
    manifest = json.loads((twin / "manifest.json").read_text())
    assert manifest["pack"]["device"] == "cpu" and manifest["pack"]["config"] == "x86_64-avx2"
    assert sorted(p.name for p in (twin / "lib").iterdir()) == ["libtvm_ffi.so", "libtvm_runtime.so"]
    for file in ("run.sh", "run.py", "torch_models.py", "bin/runner", "src/runner.cc"):
        assert (twin / file).is_file(), file
    (model,) = manifest["models"]
    assert model["name"] == "bert_tiny" and model["torch"]["weights"].endswith(".npz")
    assert [s["shape"] for s in model["inputs"]] == [[1, 32], [1, 32]]
    assert all((twin / s["file"]).is_file() for s in model["inputs"])
    assert all((twin / s["reference"]).is_file() for s in model["outputs"])
    weights = numpy.load(twin / model["torch"]["weights"])
    # The Linear weights the exporter renamed (onnx::MatMul_N, transposed) are back under their names.
    assert weights["encoder.layer.0.attention.self.query.weight"].shape == (256, 256)
    assert weights["encoder.layer.0.intermediate.dense.weight"].shape == (1024, 256)


def test_the_cpu_twin_runs_without_tvm_and_matches(twin, numpy_only_python, tmp_path):
    done = _run(twin, numpy_only_python, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    entry = results["models"]["bert_tiny"]
    assert entry["tvm_fusion"]["status"] == "pass", entry
    assert entry["tvm_fusion"]["max_abs_err"] <= 1e-3 and entry["tvm_fusion"]["runs"] == 3
    assert entry["torch"]["status"] == "skipped"  # no torch in this venv
    assert results["machine"]["runner"] == "shipped"
    assert results["summary"] == {"artifacts": 1, "passed": 1, "all_passed": True}


def test_a_broken_model_is_recorded_and_the_others_still_run(twin, numpy_only_python, tmp_path):
    pack = tmp_path / "pack"
    shutil.copytree(twin, pack, symlinks=True)
    manifest = json.loads((pack / "manifest.json").read_text())
    broken = dict(manifest["models"][0], name="broken", artifact="models/broken/model.so")
    manifest["models"].insert(0, broken)
    (pack / "manifest.json").write_text(json.dumps(manifest))
    done = _run(pack, numpy_only_python, tmp_path / "out", "--no-torch")
    assert done.returncode == 1
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["models"]["broken"]["tvm_fusion"]["status"] == "error"
    assert "models/broken/model.so" in results["models"]["broken"]["tvm_fusion"]["error"]
    assert results["models"]["bert_tiny"]["tvm_fusion"]["status"] == "pass"
    assert results["summary"]["passed"] == 1 and not results["summary"]["all_passed"]


def test_a_pack_over_the_limit_is_refused(tmp_path):
    done = _pack(tmp_path / "pack", "--max-mib", "5")
    assert done.returncode == 3
    assert "over the 5 MiB limit" in done.stderr and "models/bert_tiny" in done.stderr
    assert not (tmp_path / "pack").exists()
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind


@pytest.mark.parametrize("name", ["run.py", "torch_models.py"])
def test_files_for_the_gpu_machine_import_no_tvm(name):
    tree = ast.parse((PACK_SOURCES / name).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported <= GPU_MACHINE_IMPORTS, f"{name} imports {sorted(imported - GPU_MACHINE_IMPORTS)}"


def _assigned(path: Path, name: str) -> ast.expr:
    (value,) = [node.value for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", "") == name]
    return value


def test_pack_and_torch_models_agree_on_the_torch_modules():
    modules = _assigned(PACK_SOURCES / "torch_models.py", "MODULES")
    assert isinstance(modules, ast.Dict)
    assert ast.literal_eval(_assigned(PACK_SOURCES / "pack.py", "TORCH_MODULES")) == \
        {key.value for key in modules.keys if isinstance(key, ast.Constant)}
