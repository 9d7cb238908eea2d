"""Artifact export: all-or-nothing, previous artifacts survive failures, complete metadata."""

from __future__ import annotations

import hashlib
import pathlib
import textwrap

import pytest
import tvm

import helpers
from tvm_fusion import __version__, api, cli, export
from tvm_fusion.errors import ArtifactError, ToolchainError
from tvm_fusion.runtime import LIBRARY_NAME, METADATA_NAME


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def executable(mlp_path, config_factory):
    prepared = api.prepare(mlp_path, config_factory(), ["x:4x16"])
    return api.build(api.optimize(prepared).module, prepared.config)


class Failing:
    """An executable whose export writes part of the library, then fails."""

    def __init__(self, real, error: BaseException):
        self.real, self.error = real, error

    def export_library(self, path: str) -> None:
        pathlib.Path(path).write_bytes(b"\x7fELF half a library")
        raise self.error


def previous_artifact(executable, final: pathlib.Path) -> dict[str, bytes]:
    export.write_artifact(executable, {"marker": "previous"}, final)
    return snapshot(final.parent)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("disk full"),
                                   ToolchainError("aarch64-linux-gnu-gcc is not installed", "apt-get install it")],
                         ids=["interrupt", "error", "toolchain"])
def test_failed_export_leaves_nothing(tmp_path, executable, error):
    """The export runs in a child process: its error comes back as itself (type and message)."""
    final = tmp_path / "out" / "mlp.host"
    with pytest.raises(type(error)) as info:
        export.write_artifact(Failing(executable, error), {"marker": "new"}, final)
    assert str(error) in str(info.value)
    assert not (tmp_path / "out").exists()  # no final dir, no .tmp- or .old- dir, nor the folder it made


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("disk full")], ids=["interrupt", "error"])
def test_failed_export_keeps_previous_artifact(tmp_path, executable, error):
    final = tmp_path / "mlp.host"
    before = previous_artifact(executable, final)
    assert set(before) == {f"mlp.host/{LIBRARY_NAME}", f"mlp.host/{METADATA_NAME}"}
    with pytest.raises(type(error)):
        export.write_artifact(Failing(executable, error), {"marker": "new"}, final)
    assert snapshot(tmp_path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.host"]


def test_failure_while_hashing_keeps_previous_artifact(tmp_path, executable, monkeypatch):
    final = tmp_path / "mlp.host"
    before = previous_artifact(executable, final)

    def interrupted(path):
        assert pathlib.Path(path).stat().st_size > 0  # the library was written: we are midway
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "sha256_of", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export.write_artifact(executable, {"marker": "new"}, final)
    assert snapshot(tmp_path) == before


def test_failure_at_the_final_rename_restores_previous_artifact(tmp_path, executable, monkeypatch):
    """The old artifact is moved aside before the new one moves in; if that last step fails,
    the old one must come back."""
    final = tmp_path / "mlp.host"
    before = previous_artifact(executable, final)
    real_rename = pathlib.Path.rename

    def rename(self, target):
        if pathlib.Path(target) == final and ".tmp-" in self.name:
            raise OSError("simulated failure moving the new artifact in")
        return real_rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", rename)
    with pytest.raises(ArtifactError, match="simulated"):  # an OSError: named, with a fix
        export.write_artifact(executable, {"marker": "new"}, final)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before


def test_successful_export_replaces_previous(tmp_path, executable):
    final = tmp_path / "mlp.host"
    previous_artifact(executable, final)
    (final / "stale.txt").write_text("left from an older build")
    result = export.write_artifact(executable, {"marker": "new"}, final)
    assert result == final
    assert sorted(p.name for p in final.iterdir()) == [METADATA_NAME, LIBRARY_NAME]
    assert helpers.read_metadata(final)["marker"] == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.host"]


def test_output_dir_that_is_a_file(tmp_path, executable):
    """-o pointing at a file: one ArtifactError naming it, and the file is untouched."""
    blocker = tmp_path / "build"
    blocker.write_text("not a directory")
    with pytest.raises(ArtifactError) as info:
        export.write_artifact(executable, {}, blocker / "mlp.host")
    assert str(blocker) in str(info.value) and info.value.exit_code == 6
    assert blocker.read_text() == "not a directory"


def test_compile_interrupted_while_writing_leaves_nothing(tmp_path, monkeypatch, capsys, mlp_path, config_path):
    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "sha256_of", interrupted)
    code = cli.main(["-q", "compile", str(mlp_path), "--config", str(config_path()), "--input-shape", "x:4x16",
                     "-o", str(tmp_path / "build")])
    assert code == 130
    assert "nothing partial was written" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()  # the output folder the compile created is gone too


def test_metadata_has_every_field(mlp_build, mlp_path, config_factory):
    import tvm

    from tvm_fusion.config import load_config

    artifact = mlp_build.artifact
    cfg = load_config(config_factory())
    meta = helpers.read_metadata(artifact)
    assert meta == {**mlp_build.metadata, "library": LIBRARY_NAME,
                    "library_sha256": meta["library_sha256"]}  # exactly what compile_model wrote
    assert set(meta) == {"model", "model_sha256", "inputs", "outputs", "target", "config", "pipeline",
                         "schedule", "fusions", "fusion_variants", "kernels", "threads", "versions", "verification",
                         "library", "library_sha256", "platform", "toolchain", "tuning", "fusion_gate", "dims",
                         "built_from", "schedule_rules", "generic_kernels", "schedule_rule_errors", "precision"}
    assert pathlib.Path(meta["built_from"]["model_path"]).resolve() == mlp_path.resolve()
    assert meta["dims"] == {}  # static shapes: no ranges
    assert meta["generic_kernels"] == []  # every kernel has a rule of its own
    assert meta["schedule_rule_errors"] == []  # and no rule raised on one
    assert meta["fusion_gate"]["checked"] >= 2 and meta["fusion_gate"]["undone"] == []
    assert artifact.name == f"mlp.{cfg.name}"
    assert meta["model"] == "mlp"
    assert meta["model_sha256"] == hashlib.sha256(mlp_path.read_bytes()).hexdigest()
    assert meta["inputs"] == [{"name": "x", "shape": [4, 16], "dtype": "float32"}]
    assert meta["outputs"] == [{"name": "y", "shape": [4, 8], "dtype": "float32"}]
    assert meta["target"] == cfg.target and meta["target"]["mcpu"] != "host"
    assert meta["config"] == cfg.name
    assert meta["pipeline"] == list(cfg.patterns) and meta["schedule"] == cfg.schedule
    assert meta["precision"] == "float32" and meta["built_from"]["config"]["precision"] == "float32"
    assert meta["fusions"]["gelu_erf"] == 1 and meta["fusions"]["gemm_epilogue"] == 2
    assert isinstance(meta["kernels"], int) and meta["kernels"] >= 1
    assert "MatmulEpilogue" in meta["schedule_rules"].values() and "Fallback" not in meta["schedule_rules"].values()
    assert meta["threads"] == cfg.threads
    assert meta["versions"] == {"tvm": tvm.__version__, "tvm_fusion": __version__}
    verification = meta["verification"]
    assert (verification["reference"], verification["rtol"], verification["atol"], verification["seed"]) == (
        "onnxruntime", cfg.rtol, cfg.atol, cfg.seed)
    assert [o["name"] for o in verification["outputs"]] == ["y"]
    assert verification["outputs"][0]["within_tolerance"] is True
    assert meta["library"] == LIBRARY_NAME
    assert meta["library_sha256"] == hashlib.sha256((artifact / LIBRARY_NAME).read_bytes()).hexdigest()


def test_the_export_child_does_not_carry_the_parents_freed_heap(tmp_path):
    """The forked export child maps every page resident in the parent: heap the pipeline freed
    but malloc kept would count in the child's RSS, and set the compile's memory peak."""
    code = textwrap.dedent("""
        import pathlib, sys
        from tvm_fusion import export

        def rss_mb():
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024

        class ReportsRss:
            def export_library(self, path):
                pathlib.Path(path).write_text(str(rss_mb()))

        chunks = [bytes(1024) for _ in range(300_000)]  # ~300 MB of malloc'd heap
        kept = chunks[::64]  # one in 64 stays: the heap cannot shrink from its top
        del chunks
        parent = rss_mb()
        library = pathlib.Path(sys.argv[1])
        export._export_in_child(ReportsRss(), library, {}, {})
        print(parent, library.read_text())
    """)
    done = helpers.run_python(code, str(tmp_path / "lib.so"))
    assert done.returncode == 0, done.stderr
    parent, child = map(float, done.stdout.split())
    assert parent - child > 200, (parent, child)


def test_a_handed_over_executable_is_let_go_before_the_check(executable, tmp_path):
    """compile hands the executable over in a list: by the time the check loads the library,
    write_artifact holds it no more (its weights can be freed)."""
    handoff, seen = [executable], []

    def check(library: pathlib.Path) -> dict:
        seen.append((list(handoff), library.is_file()))
        return {"checked": True}

    final = export.write_artifact(handoff, {"marker": "new"}, tmp_path / "model.x86_64-host", check=check)
    assert seen == [([], True)]
    assert '"checked": true' in (final / METADATA_NAME).read_text()


def test_a_released_scheduled_stage_is_scheduled_again(mlp_path, config_factory):
    session = api.ModelSession(mlp_path, ["x:4x16"])
    first = session.scheduled(config_factory())
    assert session.scheduled(config_factory()) is first
    session.release(first)
    again = session.scheduled(config_factory())
    assert again is not first
    tvm.ir.assert_structural_equal(again.module, first.module)
