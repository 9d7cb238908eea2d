"""A full disk, for real: a tiny tmpfs under the output. Every write that the CLI makes (the
artifact, run --save, bench --json, tune's records) ends with exit 6, one error naming the path
and "No space left on device", and nothing half written; a previous artifact stays whole.

Compiling onto a full disk used to exit 1 with no message: LLVM exits the process when it
cannot write the object file (export.py runs that step in a child process for this).
Mounting needs root (tests and CI run as root); where it is not permitted the tests skip, and
test_bad_input.py covers the same paths with an injected OSError(ENOSPC).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import helpers
import tvm_fusion
from tvm_fusion import cli

MLP_SHAPE = ["--input-shape", "x:4x16"]


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def tiny_disk(tmp_path):
    """``tiny_disk(kib)``: a tmpfs of that size, unmounted after the test."""
    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); test_bad_input.py injects ENOSPC")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)  # a loaded library keeps it busy


def fill(disk: Path, leave_kib: int) -> None:
    """Take all but ``leave_kib`` of the disk's free space."""
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(free - leave_kib * 1024, 0))


def assert_disk_full_error(code: int, err: str, path) -> None:
    assert code == 6, err
    assert err.count("tvm-fusion: error:") == 1 and "Traceback" not in err, err
    assert str(path) in err and "No space left on device" in err, err


def test_compile_onto_a_full_disk(capsys, tiny_disk, mlp_path, config_path):
    disk = tiny_disk(8)
    code = cli.main(["-q", "compile", str(mlp_path), "--config", str(config_path()), *MLP_SHAPE, "-o", str(disk)])
    assert_disk_full_error(code, capsys.readouterr().err, disk)
    assert listing(disk) == []  # no staging, no temp files


# A process that has run a model with parallel kernels: TVM's pool workers wait on a condition
# variable, and when LLVM's exit() ran the forking thread's thread-local destructors in the
# export's child, destroying that variable waited forever for workers the child does not have.
AFTER_A_PARALLEL_RUN = """
import sys
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import tvm_fusion
from tvm_fusion import cli
from tvm_fusion.api import compile_model
weight = numpy_helper.from_array(np.ones((256, 256), np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 256])], [weight])
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), sys.argv[1] + "/mm.onnx")
built = compile_model(sys.argv[1] + "/mm.onnx", sys.argv[3], [], sys.argv[1] + "/build")
model = tvm_fusion.load(built.artifact)
for _ in range(20):
    model.run({"x": np.ones((256, 256), np.float32)})
sys.exit(cli.main(["-q", "compile", sys.argv[1] + "/mm.onnx", "--config", sys.argv[3], "-o", sys.argv[2]]))
"""


def test_compile_onto_a_full_disk_after_a_parallel_run(tmp_path, tiny_disk, config_path):
    disk = tiny_disk(8)
    proc = helpers.run_python(AFTER_A_PARALLEL_RUN, str(tmp_path), str(disk), str(config_path()), timeout=120)
    assert_disk_full_error(proc.returncode, proc.stderr, disk)
    assert listing(disk) == []


def test_compile_onto_a_full_disk_keeps_the_previous_artifact(capsys, tiny_disk, mlp_path, config_path):
    disk = tiny_disk(4096)
    argv = ["-q", "compile", str(mlp_path), "--config", str(config_path()), *MLP_SHAPE, "-o", str(disk)]
    assert cli.main(argv) == 0
    before = {p: (disk / p).read_bytes() for p in listing(disk) if (disk / p).is_file()}
    fill(disk, leave_kib=16)
    code = cli.main(argv)
    assert_disk_full_error(code, capsys.readouterr().err, disk)
    after = {p: (disk / p).read_bytes() for p in listing(disk) if (disk / p).is_file() and p != "filler"}
    assert after == before
    (artifact,) = [disk / p for p in listing(disk) if p.startswith("mlp.") and "/" not in p]
    assert tvm_fusion.load(artifact).run({"x": np.zeros((4, 16), np.float32)})


def test_run_save_onto_a_full_disk(capsys, tiny_disk, mlp_artifact):
    disk = tiny_disk(64)
    fill(disk, leave_kib=0)
    code = cli.main(["-q", "run", str(mlp_artifact), "--fill", "random", "--save", str(disk / "outputs")])
    assert_disk_full_error(code, capsys.readouterr().err, disk / "outputs")
    assert listing(disk) == ["filler"]


def test_bench_json_onto_a_full_disk(capsys, tiny_disk, mlp_path, config_path):
    disk = tiny_disk(64)
    fill(disk, leave_kib=0)
    code = cli.main(["-q", "bench", str(mlp_path), "--config", str(config_path()), *MLP_SHAPE, "--repeat", "1",
                     "--no-stock", "--json", str(disk / "bench.json")])
    assert_disk_full_error(code, capsys.readouterr().err, disk / "bench.json")
    assert listing(disk) == ["filler"]


def test_tuning_records_onto_a_full_disk(capsys, tiny_disk, mlp_path, config_path):
    """tune on a disk that fills while it appends records: exit 6 naming the store file, no
    half line and no temp file left, and what was written before stays readable."""
    disk = tiny_disk(256)
    fill(disk, leave_kib=20)  # room for the store's first files, not for the kernels' workloads
    code = cli.main(["-q", "tune", str(mlp_path), "--config", str(config_path()), *MLP_SHAPE,
                     "--trials", "64", "--tuning-log", str(disk)])
    err = capsys.readouterr().err
    assert code == 6, err
    assert err.count("tvm-fusion: error:") == 1 and "Traceback" not in err, err
    assert "cannot write the tuning log" in err and str(disk) in err and "No space left on device" in err, err
    assert "database_" in err  # the appends of workloads and records, not only the first files
    assert not [p for p in listing(disk) if ".tmp-" in p]  # no temp files
    for log in disk.rglob("*.json*"):
        text = log.read_bytes()
        assert not text or text.endswith(b"\n"), f"{log} ends in a half line"
