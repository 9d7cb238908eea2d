"""Shared fixtures: tiny ONNX models on disk, test configs, and one compiled MLP per session.

Compiling tests use the real pipeline (``[pipeline] schedule = "default"``): the product is
what CI tests. ``TVM_FUSION_TEST_SCHEDULE=none`` runs the same tests on naive loops, to tell
a schedule bug from a pattern bug.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import helpers

TEST_SCHEDULE = os.environ.get("TVM_FUSION_TEST_SCHEDULE", "default")
# `tune` without --tuning-log writes into the user's store: a throwaway one per test process.
os.environ["TVM_FUSION_TUNING_LOGS"] = tempfile.mkdtemp(prefix="tvm_fusion_test_logs_")
MLP_SHAPE = "x:4x16"


@pytest.fixture(scope="session")
def config_factory(tmp_path_factory):
    """``config_factory(schedule=None, patterns=None, dims=None) -> Path`` of a written config.

    ``schedule=None`` means TVM_FUSION_TEST_SCHEDULE (default "default").
    """
    folder = tmp_path_factory.mktemp("configs")
    written: dict[tuple, Path] = {}

    def make(schedule: str | None = None, patterns: list[str] | None = None,
             dims: dict[str, int] | None = None) -> Path:
        schedule = schedule or TEST_SCHEDULE
        key = (schedule, tuple(patterns) if patterns is not None else None,
               tuple(sorted(dims.items())) if dims is not None else None)
        if key not in written:
            written[key] = helpers.write_config(folder / f"test-{len(written)}.toml", schedule,
                                                patterns, dims)
        return written[key]

    return make


@pytest.fixture
def config_path(config_factory):
    """The factory again, under the name tests use: ``config_path()`` or ``config_path(schedule=...)``."""
    return config_factory


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    helpers.save(helpers.mlp_model(), folder / "mlp.onnx")
    helpers.save(helpers.unsupported_op_model(), folder / "unsupported.onnx")
    helpers.save(helpers.shape_subgraph_model(), folder / "shape_subgraph.onnx")
    helpers.save(helpers.embedding_model(), folder / "embedding.onnx")
    return folder


@pytest.fixture(scope="session")
def mlp_path(models_dir) -> Path:
    return models_dir / "mlp.onnx"


@pytest.fixture(scope="session")
def unsupported_path(models_dir) -> Path:
    return models_dir / "unsupported.onnx"


@pytest.fixture(scope="session")
def shape_model_path(models_dir) -> Path:
    return models_dir / "shape_subgraph.onnx"


@pytest.fixture(scope="session")
def embedding_path(models_dir) -> Path:
    return models_dir / "embedding.onnx"


@pytest.fixture(scope="session")
def mlp_build(tmp_path_factory, mlp_path, config_factory):
    """The MLP compiled once at x:4x16 (verified against ONNX Runtime). Read-only: copy it
    (``copy_artifact``) before changing anything in it."""
    from tvm_fusion.api import compile_model

    out = tmp_path_factory.mktemp("build")
    return compile_model(mlp_path, config_factory(), [MLP_SHAPE], output_dir=out)


@pytest.fixture(scope="session")
def mlp_artifact(mlp_build) -> Path:
    return mlp_build.artifact


@pytest.fixture
def copy_artifact(mlp_artifact, tmp_path):
    """A private copy of the compiled MLP artifact that a test may damage."""
    import shutil

    def make() -> Path:
        target = tmp_path / mlp_artifact.name
        shutil.copytree(mlp_artifact, target)
        return target

    return make
