#!/usr/bin/env python3
"""``inspect --onnx --check`` over every bundled example and every zoo model: is each fused file
valid (onnx.checker), and does it compute what the original does (onnx.reference with our
ops against ONNX Runtime, within the config's tolerances)?

Each model runs in a worker process of its own, one at a time (a crash or a runaway
allocation in one does not stop the sweep), through the same API call as the CLI
(``api.export_fused_onnx(..., check=True)``). Per model: ONNX nodes absorbed into fused
nodes, fused nodes by op, the fusions kept as their original nodes (and why), the max abs
error per output, pass/fail. Models TVM cannot import at all are listed with the reason.
Results go to ``benchmarks/results/fused_onnx_check.json`` (written atomically) and a table
on stdout.

Usage (from the repository root)::

    .venv/bin/python scripts/check_fused_onnx_zoo.py [--only NAME ...] [--timeout 900]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tvm_fusion.commands import zoo  # noqa: E402
from tvm_fusion.report import write_json  # noqa: E402
from isolated import run_in_worker  # noqa: E402  (scripts/isolated.py)

CONFIG = ROOT / "configs" / "x86_64-host.toml"
EXAMPLES = ROOT / "examples" / "models"
CNN_SHAPE = ("input:1x3x224x224",)  # the bundled CNNs' dims are all symbolic
# One entry per absorbed node in a fused node's doc_string: "name (OpType)", comma-separated.
ABSORBED = re.compile(r" \((\w+)\)(?:, |$)")
# A row of verify.format_comparisons: output, max abs, max rel, verdict.
COMPARISON_ROW = re.compile(r"^(\S+)\s+([-+.\deinfa]+)\s+([-+.\deinfa]+)\s+(ok|MISMATCH)", re.MULTILINE)


def models() -> dict[str, tuple[str, Path, tuple[str, ...] | None]]:
    """name -> (source, path, input shapes): the bundled examples, then the zoo in manifest order."""
    found = {path.stem: ("example", path, None if path.stem in ("bert_tiny", "gpt2_tiny") else CNN_SHAPE)
             for path in sorted(EXAMPLES.glob("*.onnx"))}
    for name, model in zoo.load_manifest().items():
        found[name] = ("zoo", zoo.model_path(name), model.input_shapes)
    return found


def check_one(name: str, queue) -> None:
    """Export and check one model; put its row on ``queue``."""
    import onnx

    from tvm_fusion import api
    from tvm_fusion.errors import ModelError, VerificationError
    from tvm_fusion.onnx_export import DOMAIN

    source, path, shapes = models()[name]
    row: dict = {"model": name, "source": source, "input_shapes": list(shapes or [])}
    started, report = time.perf_counter(), None
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / f"{name}_fused.onnx"
        try:
            report = api.export_fused_onnx(path, str(CONFIG), list(shapes) if shapes else None, out, check=True)
            row.update(passed=True, outputs={c.name: {"max_abs": c.max_abs, "max_rel": c.max_rel}
                                             for c in report.comparisons})
            row.update(rtol=report.rtol, atol=report.atol)
        except VerificationError as err:  # the file is written; the message holds the comparison table
            row.update(passed=False, error=str(err).splitlines()[0],
                       outputs={m[1]: {"max_abs": float(m[2]), "max_rel": float(m[3])}
                                for m in COMPARISON_ROW.finditer(str(err))})
        except ModelError as err:
            row.update(imports=False, passed=False, error=str(err).splitlines()[0])
        except Exception as err:  # noqa: BLE001 - a crash is a result of the sweep, then it goes on
            row.update(passed=False, error=f"crash: {type(err).__name__}: {err}",
                       traceback=traceback.format_exc(limit=4))
        if out.exists():
            onnx.checker.check_model(str(out))  # raises in the worker: reported as a dead worker
            custom = [n for n in onnx.load(str(out)).graph.node if n.domain == DOMAIN]
            row.update(imports=True, valid=True,
                       nodes_fused=sum(len(ABSORBED.findall(n.doc_string)) for n in custom),
                       fused_ops=dict(collections.Counter(n.op_type for n in custom).most_common()))
            if report is not None:  # grouped: an unrolled GRU keeps dozens of fusions for one reason
                kept = collections.Counter((k.variant, k.reason) for k in report.kept)
                row["kept"] = [{"variant": variant, "reason": reason, "count": count}
                               for (variant, reason), count in kept.items()]
    if row.get("outputs"):
        row["max_abs_error"] = max(o["max_abs"] for o in row["outputs"].values())
    row["seconds"] = round(time.perf_counter() - started, 1)
    queue.put(row)


def run_one(name: str, timeout: float) -> dict:
    row, failure = run_in_worker(check_one, (name,), timeout)
    return row if failure is None else {"model": name, "passed": False, "error": failure}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | fused nodes (ONNX nodes absorbed) | kept | max abs error | check |", "|---|---|---|---|---|"]
    for r in rows:
        if not r.get("imports", True):
            lines.append(f"| {r['model']} | does not import: {r['error'][:80]} | | | |")
            continue
        ops = ", ".join(f"{count} {op}" for op, count in r.get("fused_ops", {}).items())
        error = f"{r['max_abs_error']:.1e}" if "max_abs_error" in r else ""
        verdict = "ok" if r["passed"] else f"FAIL: {r.get('error', '')[:80]}"
        kept = sum(k["count"] for k in r.get("kept", []))
        lines.append(f"| {r['model']} | {ops} ({r.get('nodes_fused', 0)}) | {kept} | {error} "
                     f"| {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these models (default: all)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per model (default 900)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fused_onnx_check.json"))
    args = parser.parse_args(argv)
    known = models()
    names = args.only or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)} (known: {', '.join(known)})")
    rows = []
    for name in names:
        print(f"[fused-onnx] {name}", file=sys.stderr, flush=True)
        if not known[name][1].is_file():
            rows.append({"model": name, "passed": False, "error": "not fetched (scripts/fetch_zoo.py)"})
            continue
        rows.append(run_one(name, args.timeout))
        print(f"[fused-onnx] {name}: {'ok' if rows[-1]['passed'] else rows[-1].get('error')}", file=sys.stderr,
              flush=True)
    write_json(args.json, {"config": str(CONFIG.relative_to(ROOT)), "models": rows})
    print(markdown(rows))
    checked = [r for r in rows if r.get("imports", True)]
    return 0 if all(r["passed"] for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
