"""scripts/zoo_report.py fails the report on what must not hide: a model that does not compile,
a kernel only a generic rule took, a schedule rule that raised, a compile over its memory budget."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parent.parent / "scripts" / "zoo_report.py"


@pytest.fixture
def zoo_report(monkeypatch):
    monkeypatch.syspath_prepend(str(REPORT.parent))  # the script imports its sibling isolated.py
    spec = importlib.util.spec_from_file_location("zoo_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(**fields) -> dict:
    return {"model": "m", "compiles": True, "generic_kernels": [], "schedule_rule_errors": [],
            "compile_peak_rss_mb": 900.0, "weights_mb": 10.0, "compile_rss_within_budget": True, **fields}


def test_a_clean_row_passes(zoo_report):
    assert zoo_report.failures([row()]) == []


def test_each_finding_fails_the_report_with_its_culprit(zoo_report):
    rows = [row(model="broken", compiles=False, error="verification: max abs 0.5"),
            row(model="generic", generic_kernels=[{"kernel": "fused_einsum", "rule": "Reduction", "flops": 1_000_000,
                                                   "contraction": True, "onnx_nodes": ["Einsum_3"]}]),
            row(model="raised", schedule_rule_errors=[{"kernel": "softmax", "rule": "Softmax",
                                                       "error": "StopIteration", "scheduled_by": "Reduction"}]),
            row(model="heavy", compile_peak_rss_mb=1200.0, compile_rss_within_budget=False)]
    found = zoo_report.failures(rows)
    assert len(found) == 4
    assert found[0].startswith("broken: does not compile: verification")
    assert "fused_einsum (Reduction, 1,000,000 FLOPs" in found[1]
    assert "schedule rule Softmax raised on softmax: StopIteration" in found[2]
    assert "heavy: compile peak RSS 1200.0 MB over the budget of 1054 MB" in found[3]
