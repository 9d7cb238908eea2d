#!/usr/bin/env python3
"""ONNX's backend node tests through stock TVM and through tvm_fusion, side by side.

The cases are the ones the onnx package defines (``onnx.backend.test.case.node``: a one-node
model, inputs and expected outputs per case; ~1900 of them), generated in memory. Each case
runs through

* ``stock``: ``relax.frontend.onnx.from_onnx`` + ``tvm.compile`` (TVM's default pipeline), and
* ``tvm_fusion``: ``api.prepare`` (checker, onnxslim, import) + ``api.optimize`` (our rewrites,
  fusions, schedules) + ``api.build``,

and its outputs are compared with the expected ones at the case's own rtol/atol. Per pipeline
a case is ``not_imported`` (the frontend refused it), ``failed`` (build/run error, crash,
timeout or mismatch) or ``passed``. The requirement: no case passes stock and fails ours.

Every (case, pipeline) runs in a worker process, so a crash or hang costs one unit, not the run.

    .venv/bin/python scripts/onnx_node_conformance.py [--filter REGEX] [--timeout 120]
        [--out benchmarks/results/conformance.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ("stock", "tvm_fusion")
NOT_IMPORTED, FAILED, PASSED = "not_imported", "failed", "passed"


def node_cases(pattern: str | None = None) -> dict:
    """Case name -> onnx TestCase, for every node test case whose name matches ``pattern``."""
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    regex = re.compile(pattern) if pattern else None
    return {case.name: case for case in sorted(cases, key=lambda c: c.name)
            if regex is None or regex.search(case.name)}


def _tensor_io(case) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    inputs, outputs = case.data_sets[0]
    inputs, outputs = list(inputs), list(outputs)
    if not all(isinstance(v, np.ndarray) for v in inputs + outputs):
        return None
    return inputs, outputs


def _input_names(model) -> list[str]:
    initializers = {init.name for init in model.graph.initializer}
    return [value.name for value in model.graph.input if value.name not in initializers]


def _run_vm(executable, arrays: list[np.ndarray]) -> list[np.ndarray]:
    import tvm
    from tvm import relax

    device = tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    result = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a), device) for a in arrays])
    values = [result] if hasattr(result, "numpy") else list(result)
    return [np.asarray(v.numpy()) for v in values]


def _compare(actual: list[np.ndarray], expected: list[np.ndarray], rtol: float, atol: float) -> str | None:
    """The first mismatch as text, or None when every output matches."""
    from tvm_fusion.verify import compare_outputs

    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for index, (got, want) in enumerate(zip(actual, expected)):
        if got.dtype == bool or want.dtype.kind in "biuU":
            if got.shape != want.shape or not np.array_equal(got.astype(want.dtype), want):
                return f"output {index} differs (shape {got.shape} vs {want.shape})"
            continue
        (result,) = compare_outputs({"y": got}, {"y": want}, rtol, atol)
        if not result.within_tolerance:
            return f"output {index}: max abs err {result.max_abs:.3g} {result.note}".strip()
    return None


def run_unit(case, pipeline: str, config=None) -> dict:
    """One case through one pipeline: {"status", "detail"}."""
    import tvm

    from tvm_fusion import api
    from tvm_fusion.config import load_config

    io = _tensor_io(case)
    if io is None:
        return {"status": NOT_IMPORTED, "detail": "non-tensor (sequence/optional/map) inputs or outputs"}
    inputs, expected = io
    model = case.model
    names = _input_names(model)
    if len(names) != len(inputs):
        return {"status": NOT_IMPORTED, "detail": f"{len(inputs)} inputs given for {len(names)} graph inputs"}
    cfg = config or load_config(ROOT / "configs" / "x86_64-host.toml")
    shapes = {name: tuple(a.shape) for name, a in zip(names, inputs)}
    try:
        if pipeline == "stock":
            from tvm.relax.frontend.onnx import from_onnx

            module = from_onnx(model, shape_dict={n: list(s) for n, s in shapes.items()},
                               dtype_dict={n: str(a.dtype) for n, a in zip(names, inputs)})
        else:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / f"{case.name}.onnx"
                path.write_bytes(model.SerializeToString())
                prepared = api.prepare(path, cfg, shapes)
    except Exception as err:  # any frontend refusal counts as not imported
        return {"status": NOT_IMPORTED, "detail": _last_line(err)}
    try:
        if pipeline == "stock":
            executable = tvm.compile(module, target=cfg.tvm_target())
        else:
            executable = api.build(api.optimize(prepared).module, cfg)
        actual = _run_vm(executable, inputs)
    except Exception as err:
        return {"status": FAILED, "detail": _last_line(err)}
    mismatch = _compare(actual, expected, float(case.rtol), float(case.atol))
    return {"status": FAILED if mismatch else PASSED, "detail": mismatch or ""}


def _last_line(err: Exception) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]


def _worker(units: list[str]) -> None:
    """Run ``case@pipeline`` units, one JSON line per unit on stdout (after a START line)."""
    from tvm_fusion.native_log import captured_native_stderr

    cases = node_cases("^(" + "|".join(re.escape(u.split("@")[0]) for u in units) + ")$")
    out = sys.stdout
    for unit in units:
        name, pipeline = unit.split("@")
        out.write(f"START {unit}\n")
        out.flush()
        try:
            with captured_native_stderr([]):
                result = run_unit(cases[name], pipeline)
        except Exception:  # a bug in this script, not in a pipeline: keep it visible
            result = {"status": FAILED, "detail": "harness error: " + traceback.format_exc(limit=2)[-300:]}
        out.write("RESULT " + json.dumps({"unit": unit, **result}) + "\n")
        out.flush()


def run_all(names: list[str], timeout: float, progress) -> dict[str, dict[str, dict]]:
    """case -> pipeline -> result, restarting the worker after a crash or a hang."""
    pending = [f"{name}@{pipeline}" for name in names for pipeline in PIPELINES]
    results: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = 0
    while pending:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", *pending], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)
        current, started = None, time.monotonic()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break  # the worker exited (finished or crashed)
                if line.startswith("START "):
                    current, started = line[6:].strip(), time.monotonic()
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
                    name, pipeline = result.pop("unit").split("@")
                    results[name][pipeline] = result
                    pending.remove(f"{name}@{pipeline}")
                    current = None
                    done += 1
                    if done % 100 == 0:
                        progress(f"{done} units done, {len(pending)} to go")
            elif current and time.monotonic() - started > timeout:
                proc.kill()
                break
        proc.wait()
        if current is not None and current in pending:
            name, pipeline = current.split("@")
            reason = "timeout" if proc.returncode in (-9, 137) else f"crash (exit {proc.returncode})"
            results[name][pipeline] = {"status": FAILED, "detail": reason}
            pending.remove(current)
        elif pending and proc.returncode not in (0, None):
            break  # died outside a unit: do not loop forever
    return dict(results)


def summarize(results: dict[str, dict[str, dict]]) -> dict:
    summary = {}
    for pipeline in PIPELINES:
        statuses = collections.Counter(r[pipeline]["status"] for r in results.values() if pipeline in r)
        summary[pipeline] = {"cases": sum(statuses.values()),
                             "imported": statuses[PASSED] + statuses[FAILED],
                             "passed": statuses[PASSED], "failed": statuses[FAILED],
                             "not_imported": statuses[NOT_IMPORTED]}
    summary["regressions"] = sorted(name for name, r in results.items() if regressed(r))
    summary["fixed"] = sorted(name for name, r in results.items()
                              if r.get("tvm_fusion", {}).get("status") == PASSED
                              and r.get("stock", {}).get("status") != PASSED)
    return summary


def regressed(result: dict[str, dict]) -> bool:
    """Stock TVM passes the case and tvm_fusion does not."""
    return (result.get("stock", {}).get("status") == PASSED
            and result.get("tvm_fusion", {}).get("status") != PASSED)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filter", help="only cases whose name matches this regex (e.g. 'conv|pool')")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case and pipeline")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conformance.json"))
    args = parser.parse_args(argv)
    names = list(node_cases(args.filter))
    if not names:
        print(f"no node test case matches {args.filter!r}", file=sys.stderr)
        return 2
    print(f"{len(names)} node test cases x {len(PIPELINES)} pipelines", flush=True)
    results = run_all(names, args.timeout, lambda m: print(m, flush=True))
    summary = summarize(results)
    from tvm_fusion.report import table, write_json

    print(table(["pipeline", "cases", "imported", "passed", "failed", "not imported"],
                [[p, s["cases"], s["imported"], s["passed"], s["failed"], s["not_imported"]]
                 for p, s in ((p, summary[p]) for p in PIPELINES)]))
    print(f"passed by stock TVM but not by tvm_fusion: {len(summary['regressions'])}"
          + (f" ({', '.join(summary['regressions'])})" if summary["regressions"] else ""))
    print(f"passed by tvm_fusion but not by stock TVM: {len(summary['fixed'])}")
    write_json(args.out, {"summary": summary, "cases": results}, indent=1, sort_keys=True)
    return 1 if summary["regressions"] else 0


if __name__ == "__main__":
    sys.exit(main())
