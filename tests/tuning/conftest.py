"""Fixtures for the tuning tests: the test MLP's two kernels, prepared once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tuning_helpers import ADD, GELU, MLP_SHAPE, tuning_config

from tvm_fusion import api
from tvm_fusion.session import ModelSession
from tvm_fusion.tuning.tasks import kernel_tasks


@pytest.fixture(scope="session")
def mlp_config(tmp_path_factory) -> Path:
    return tuning_config(tmp_path_factory.mktemp("tuning-config") / "mlp.toml")


@pytest.fixture(scope="session")
def mlp_prepared(mlp_path, mlp_config):
    return api.prepare(mlp_path, mlp_config, MLP_SHAPE)


@pytest.fixture(scope="session")
def mlp_tasks(mlp_prepared):
    """The MLP's two kernels: matmul+bias (ADD) and matmul+bias+gelu (GELU), by name."""
    tasks = kernel_tasks(ModelSession.of(mlp_prepared).tuning_module(mlp_prepared.config), mlp_prepared.config.tvm_target())
    assert sorted(t.name for t in tasks) == [ADD, GELU]
    return {t.name: t for t in tasks}
