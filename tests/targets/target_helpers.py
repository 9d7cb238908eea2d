"""Helpers for the per-target tests (a plain module: several conftest.py files exist in tests/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import helpers

CONFIGS = helpers.REPO_ROOT / "configs"
MLP_SHAPE = "x:4x16"


def config(name: str) -> Path:
    return CONFIGS / f"{name}.toml"


def require(condition: bool, what: str) -> None:
    """Skip on a developer machine without the tool; fail in CI, whose .ci/run installs it."""
    if condition:
        return
    message = f"{what} is not installed: run scripts/setup_targets.sh"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI installs it in .ci/run)")
    pytest.skip(message)


def assert_verified(metadata: dict, rtol: float, atol: float) -> None:
    """The metadata records a comparison with ONNX Runtime that passed at the config's tolerances."""
    verification = metadata["verification"]
    assert verification["reference"] == "onnxruntime"
    assert (verification["rtol"], verification["atol"]) == (rtol, atol)
    assert verification["outputs"] and all(o["within_tolerance"] for o in verification["outputs"])
