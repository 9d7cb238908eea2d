"""Bad inputs found by hand (issue 14): each is one clear error line with a documented exit code,
no traceback, and nothing left behind (no half files, no staging or temp directories)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

import helpers
from tvm_fusion import cli, export
from tvm_fusion.errors import (ArtifactError, ConfigError, ModelError, ShapeError, TuningLogError,
                               TvmFusionError)

MLP_SHAPE = ["--input-shape", "x:4x16"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(err: str, *culprits: str) -> None:
    """One error (message + fix line) naming every culprit, and no traceback."""
    assert err.count("tvm-fusion: error:") == 1, err
    assert "Traceback" not in err and "\n  fix: " in err, err
    for culprit in culprits:
        assert culprit in err, err


def listing(folder: Path) -> list[str]:
    """Everything under ``folder``, hidden entries (staging) included."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nothing can be written into, root included (tests and CI run as root, so
    chmod would not stop a write): a read-only tmpfs, or where mounting is not permitted, an
    immutable directory (chattr +i), which refuses root too."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                      capture_output=True).returncode == 0:
        undo = ["umount", str(folder)]
    else:
        subprocess.run(["chattr", "+i", str(folder)], check=True, capture_output=True)
        undo = ["chattr", "-i", str(folder)]
    with pytest.raises(OSError):
        (folder / "probe").write_text("x")
    yield folder
    subprocess.run(undo, check=True)


@pytest.fixture(scope="module")
def embedding_artifact(tmp_path_factory, embedding_path, config_factory) -> Path:
    from tvm_fusion.api import compile_model

    out = tmp_path_factory.mktemp("embedding_build")
    return compile_model(embedding_path, config_factory(), ["ids:1x8", "flags:1x8"], output_dir=out).artifact


def temp_files(tmpdir: Path) -> list[str]:
    """What a run left in its TMPDIR; onnxruntime's import keeps a session-id file (.ses) there."""
    return [name for name in listing(tmpdir) if name != ".ses"]


def dead_pid() -> int:
    """The PID of a process that has exited (as a SIGKILLed compile's would be)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# --- run -------------------------------------------------------------------------------------

def test_run_token_id_outside_vocabulary(capsys, tmp_path, embedding_artifact):
    """TVM gathers without a bounds check (a segfault at exit 139 before): compile records the
    table size, run checks the ids against it."""
    import tvm_fusion

    meta = helpers.read_metadata(embedding_artifact)
    ids_spec = next(s for s in meta["inputs"] if s["name"] == "ids")
    assert ids_spec["index_range"] == [-10, 9] and ids_spec["index_table"] == "table"
    assert "index_range" not in next(s for s in meta["inputs"] if s["name"] == "flags")  # not an index
    ids = np.array([[1, 2, 3, 99, 4, 5, 6, 7]], np.int64)
    np.save(tmp_path / "ids.npy", ids)
    code, out, err = run_cli(capsys, "-q", "run", embedding_artifact, "--input", f"ids={tmp_path / 'ids.npy'}",
                             "--fill", "zeros", "--save", tmp_path / "saved")
    assert code == ArtifactError.exit_code == 6 and out == ""
    assert_one_error(err, "input 'ids' holds 99 at [0, 3]", "[-10, 9]", "10-row table 'table'")
    assert not (tmp_path / "saved").exists()
    model = tvm_fusion.load(embedding_artifact)
    with pytest.raises(ArtifactError, match="holds -11"):
        model.run({"ids": np.full((1, 8), -11, np.int64), "flags": np.zeros((1, 8), np.int64)})
    # ONNX Gather counts negative ids from the end: -10 .. 9 are all valid.
    model.run({"ids": np.array([[-10, -1, 0, 9, 1, 2, 3, 4]], np.int64), "flags": np.zeros((1, 8), np.int64)})


def test_run_empty_npy(capsys, tmp_path, mlp_artifact):
    (tmp_path / "x.npy").write_bytes(b"")
    code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, "--input", f"x={tmp_path / 'x.npy'}")
    assert code == 6 and out == ""
    assert_one_error(err, f"cannot read --input x={tmp_path / 'x.npy'}: the file is empty")


def test_run_metadata_shape_not_a_list(capsys, copy_artifact):
    artifact = copy_artifact()
    meta = helpers.read_metadata(artifact)
    meta["inputs"][0]["shape"] = "4x16"
    (artifact / "metadata.json").write_text(json.dumps(meta))
    code, out, err = run_cli(capsys, "-q", "run", artifact, "--fill", "zeros")
    assert code == 6 and out == ""
    assert_one_error(err, f"{artifact / 'metadata.json'} is damaged", "input 'x': 'shape' is '4x16'",
                     "rebuild the artifact")


@pytest.mark.parametrize("where", ["read_only", "existing_file"])
def test_run_save_unwritable(capsys, tmp_path, mlp_artifact, read_only_dir, where):
    target = read_only_dir / "outputs" if where == "read_only" else tmp_path / "taken"
    if where == "existing_file":
        target.write_text("mine")
    code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, "--fill", "zeros", "--save", target)
    assert code == 6 and out == ""  # refused before the run
    culprit = "Read-only file system" if where == "read_only" else f"{target} is a file, not a directory"
    assert_one_error(err, f"cannot write the outputs into {target}", "--save")
    assert culprit in err or "Permission denied" in err  # chattr +i where mount is not permitted
    assert listing(read_only_dir) == []
    assert where == "read_only" or target.read_text() == "mine"


def test_save_outputs_disk_full_leaves_nothing(tmp_path, monkeypatch):
    """A full disk while saving the second output: neither output is left, nor any staging file."""
    from tvm_fusion import runtime
    import tvm_fusion.runtime.run_files

    real_save, calls = np.save, []

    def save(stream, value):
        calls.append(value)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(stream, value)

    monkeypatch.setattr(runtime.run_files.np, "save", save)
    with pytest.raises(ArtifactError) as info:
        runtime.run_files.save_outputs({"a": np.zeros(2), "b": np.ones(2)}, tmp_path / "saved" / "deep")
    assert "No space left on device" in str(info.value) and "free disk space" in str(info.value)
    assert listing(tmp_path) == []


def test_run_npz_input(capsys, tmp_path, mlp_artifact, mlp_path):
    """An .npz gives the array named like the input, or its only array; otherwise a clear refusal."""
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    np.savez(tmp_path / "named.npz", other=np.zeros(3), x=x)
    np.savez(tmp_path / "single.npz", anything=x)
    np.savez(tmp_path / "ambiguous.npz", a=x, b=x)
    expected = helpers.ort_outputs(mlp_path, {"x": x})["y"]
    for archive in ("named", "single"):
        code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, "--input", f"x={tmp_path / archive}.npz",
                                 "--save", tmp_path / archive)
        assert code == 0, err
        np.testing.assert_allclose(np.load(tmp_path / archive / "y.npy"), expected, rtol=1e-4, atol=1e-5)
    code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, "--input", f"x={tmp_path / 'ambiguous.npz'}")
    assert code == 6 and out == ""
    assert_one_error(err, "is a .npz archive of 2 arrays (a, b), none named 'x'", "np.savez(file, x=array)")


# --- compile ---------------------------------------------------------------------------------

def test_compile_inputs_too_large_for_memory(capsys, tmp_path, mlp_path, config_path):
    """Refused at shape binding, before anything is built (it used to die allocating test inputs)."""
    started = time.perf_counter()
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(),
                             "--input-shape", "x:100000000000x16", "-o", tmp_path / "build")
    assert code == ShapeError.exit_code == 4 and out == ""
    assert_one_error(err, "x:100000000000x16", "5.8 TiB for its inputs", "of memory is available",
                     "smaller --input-shape")
    assert time.perf_counter() - started < 30 and not (tmp_path / "build").exists()


def test_size_guard_counts_the_largest_intermediate(monkeypatch, mlp_path, config_path):
    """Inputs that fit but a hidden layer that does not: the message names the intermediate."""
    import collections

    import psutil

    from tvm_fusion import api

    memory = collections.namedtuple("memory", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(600 * 1024))
    with pytest.raises(ShapeError) as info:  # x: 256 KiB, the hidden layer float32[4096, 32]: 512 KiB
        api.prepare(mlp_path, config_path(), ["x:4096x16"])
    assert "256.0 KiB for its inputs plus 512.0 KiB for its largest intermediate (float32[4096, 32])" in str(
        info.value)


def test_compile_output_on_read_only_fs(capsys, mlp_path, config_path, read_only_dir):
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(), *MLP_SHAPE,
                             "-o", read_only_dir / "build")
    assert code == ArtifactError.exit_code == 6 and out == ""
    assert_one_error(err, f"cannot write the artifact into {read_only_dir / 'build'}", "not writable",
                     "-o/--output-dir")
    assert listing(read_only_dir) == []


def test_write_artifact_disk_full(tmp_path, monkeypatch):
    """The disk fills up during export (simulated): an ArtifactError naming the artifact, the
    previous artifact kept, no staging directory left."""

    class HalfWritten:
        def export_library(self, path: str, **_options) -> None:
            Path(path).write_bytes(b"\x7fELF half a library")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    final = tmp_path / "build" / "mlp.host"
    final.mkdir(parents=True)
    (final / "metadata.json").write_text("previous")
    with pytest.raises(ArtifactError) as info:
        export.write_artifact(HalfWritten(), {}, final)
    assert f"cannot write the artifact {final}: No space left on device" in str(info.value)
    assert listing(tmp_path / "build") == ["mlp.host", "mlp.host/metadata.json"]
    assert (final / "metadata.json").read_text() == "previous"


def test_compile_opset_newer_than_onnx(capsys, tmp_path, config_path):
    known = onnx.defs.onnx_opset_version()
    model = helpers.mlp_model()
    model.opset_import[0].version = 99
    path = helpers.save(model, tmp_path / "future.onnx")
    code, out, err = run_cli(capsys, "-q", "compile", path, "--config", config_path(), *MLP_SHAPE,
                             "-o", tmp_path / "build")
    assert code == ModelError.exit_code == 3 and out == ""
    assert_one_error(err, f"{path} declares ONNX opset 99", f"up to opset {known}")
    assert not (tmp_path / "build").exists()


def test_config_unknown_mcpu(capsys, tmp_path, mlp_path):
    """LLVM only warns about an unknown CPU and emits generic code: the config is refused instead."""
    config = tmp_path / "typo.toml"
    config.write_text('[target]\nkind = "llvm"\nmcpu = "no-such-cpu"\nnum-cores = 1\n')
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config, *MLP_SHAPE,
                             "-o", tmp_path / "build")
    assert code == ConfigError.exit_code == 2 and out == ""
    assert_one_error(err, f"{config}: key 'target.mcpu' names CPU 'no-such-cpu'", "llvm_cpu_names(")
    assert not (tmp_path / "build").exists()


def test_input_shape_given_twice(capsys, tmp_path, mlp_path, config_path):
    from tvm_fusion.api import parse_input_shapes

    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(),
                             "--input-shape", "x:4x16", "--input-shape", "x:8x16", "-o", tmp_path / "build")
    assert code == ShapeError.exit_code == 4 and out == ""
    assert_one_error(err, "input 'x' is given twice, differently: --input-shape x:4x16 and --input-shape x:8x16")
    assert parse_input_shapes(["x:4x16", "x:4,16"]) == {"x": (4, 16)}  # the same shape twice is fine


# --- inspect --graph, bench --json -----------------------------------------------------------

@pytest.mark.parametrize("command", ["inspect", "bench"])
def test_report_file_on_read_only_fs(capsys, mlp_path, config_path, read_only_dir, command):
    """Refused before the work, not after it."""
    target = read_only_dir / ("graph.svg" if command == "inspect" else "bench.json")
    flag = ["--graph", target] if command == "inspect" else ["--repeat", "1", "--json", target]
    code, out, err = run_cli(capsys, "-q", command, mlp_path, "--config", config_path(), *MLP_SHAPE, *flag)
    assert code == ArtifactError.exit_code == 6 and out == ""
    assert_one_error(err, str(read_only_dir), "not writable", flag[-2])
    assert listing(read_only_dir) == []


def test_write_json_disk_full(tmp_path, monkeypatch):
    from tvm_fusion.report import write_json

    (tmp_path / "out.json").write_text("previous")

    def full(self, _text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(ArtifactError, match="No space left on device"):
        write_json(tmp_path / "out.json", {"a": 1})
    monkeypatch.undo()
    assert listing(tmp_path) == ["out.json"] and (tmp_path / "out.json").read_text() == "previous"


# --- tuning-log ------------------------------------------------------------------------------

def test_tuning_log_show_empty_directory(capsys, tmp_path):
    code, out, err = run_cli(capsys, "tuning-log", "show", tmp_path)
    assert code == TuningLogError.exit_code == 8 and out == ""
    assert_one_error(err, f"no tuning records found in {tmp_path}")


# --- signals ---------------------------------------------------------------------------------

def _compile_until_exporting(mlp_path, config: Path, out: Path, tmpdir: Path) -> tuple[subprocess.Popen, Path]:
    """Start a compile and return once its export has written TVM's lib0.o (the staging directory)."""
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen([sys.executable, "-m", "tvm_fusion.cli", "-q", "compile", str(mlp_path),
                             "--config", str(config), *MLP_SHAPE, "-o", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        objects = list(out.glob(".mlp.*.tmp-*/**/lib0.o"))
        if objects:
            return proc, objects[0]
        time.sleep(0.005)
    proc.kill()
    pytest.fail(f"the compile never reached the export (rc {proc.poll()}): {proc.communicate()[1]}")


def test_sigkill_during_export_is_cleaned_up_by_the_next_run(capsys, tmp_path, mlp_path, config_path):
    """TVM's temp files stay inside our staging directory (nothing in TMPDIR), and the next
    compile into the same -o removes the staging of the killed run; a live run's is kept."""
    out, tmpdir = tmp_path / "build", tmp_path / "tmpdir"
    tmpdir.mkdir()
    proc, library_object = _compile_until_exporting(mlp_path, config_path(), out, tmpdir)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert temp_files(tmpdir) == []
    stale = library_object.relative_to(out).parts[0]
    assert (out / stale).is_dir()
    alive = out / f".mlp.other.tmp-{os.getpid()}"  # this test's own PID: a run still going
    alive.mkdir()
    code, _, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(), *MLP_SHAPE, "-o", out)
    assert code == 0, err
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [alive.name]
    (out / f".mlp.other.tmp-{dead_pid()}").mkdir()
    run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(), *MLP_SHAPE, "-o", out)
    assert sorted(p.name for p in out.iterdir()) == [alive.name, f"mlp.{config_path().stem}"]


def test_sigterm_during_export(tmp_path, mlp_path, config_path):
    """SIGTERM runs the same cleanup as Ctrl-C and exits 143: no staging, no temp files."""
    out, tmpdir = tmp_path / "build", tmp_path / "tmpdir"
    tmpdir.mkdir()
    proc, _ = _compile_until_exporting(mlp_path, config_path(), out, tmpdir)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "tvm-fusion: terminated; nothing partial was written" in err and "Traceback" not in err
    assert listing(out) == [] and temp_files(tmpdir) == []


def test_farm_tracker_stops_its_children_on_sigterm(tmp_path):
    import psutil

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    farm = subprocess.Popen([sys.executable, "-m", "tvm_fusion.tuning.farm", "tracker", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while "pid" not in (line := farm.stderr.readline()) and time.monotonic() < deadline and line:
        pass
    assert "tracker pid" in line, line
    children = psutil.Process(farm.pid).children(recursive=True)
    assert children
    farm.send_signal(signal.SIGTERM)
    farm.wait(timeout=60)
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, alive
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def test_every_exit_code_is_documented():
    """README's exit-code table has a row for every error class's code and the signal codes."""
    readme = (helpers.REPO_ROOT / "README.md").read_text()
    for code in {cls.exit_code for cls in TvmFusionError.__subclasses__()} | {0, 130, 143}:
        assert f"\n| {code} | " in readme, code
