#!/usr/bin/env python3
"""Run the real-model zoo: per model, compile + verify, coverage, kernels, latency against ORT
(and OpenVINO, when the peers extra is installed: at f32, and at its default precision, bf16 on
CPUs with AVX512_BF16 or AMX, each with its error against ONNX Runtime float32).

Each model runs in a worker process of its own (a crash or a runaway allocation in one model
does not stop the report), one at a time. Results go to ``benchmarks/results/zoo.json`` and a
Markdown table on stdout (the docs' benchmark pages are generated from the JSON). Models are fetched first
(scripts/fetch_zoo.py), into the zoo cache. It exits 1 on what must not hide (``failures``): a
model that does not compile, a kernel only a generic rule took, a schedule rule that raised, a
compile over its memory budget.

Usage (from the repository root)::

    .venv/bin/python scripts/zoo_report.py [--only NAME ...] [--repeat 20] [--timeout 900] [--precision bf16]

``--repeat 0`` skips the timings: compile, memory and coverage only. ``--precision bf16`` (a host
with AVX512_BF16 or AMX-BF16) also times our bf16 build in the same rounds: its time, its ratio to our float32,
its error against ONNX Runtime float32 and its bf16 kernel count, beside OpenVINO's default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tvm_fusion.commands import zoo  # noqa: E402
from tvm_fusion.config import host_cpu_name, load_config  # noqa: E402
from tvm_fusion.kernels.cpu_features import has_bf16_kernels  # noqa: E402
from tvm_fusion.report import write_json  # noqa: E402
from isolated import run_in_worker  # noqa: E402  (scripts/isolated.py)


def measure(name: str, repeat: int, out_dir: str, precision: str, queue) -> None:
    """Compile (verifying against ONNX Runtime), inspect and bench one model; put a dict on ``queue``."""
    from tvm_fusion import api
    from tvm_fusion.errors import ModelError, TvmFusionError
    from tvm_fusion.commands.peers import installed_peers

    model = zoo.load_manifest()[name]
    path = zoo.model_path(name)
    row: dict = {"model": name, "exporter": model.exporter, "category": model.category,
                 "input_shapes": list(model.input_shapes)}
    try:
        started = time.perf_counter()
        compiled = api.compile_model(path, model.config(), list(model.input_shapes), output_dir=out_dir)
        row["compile_s"] = round(time.perf_counter() - started, 1)
        # The worker is this model's own process: its peak RSS is the compile's (the export's
        # forked child counted too), against a budget of 3x the weights + 1 GiB.
        peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        row["compile_peak_rss_mb"] = round(peak / 1024, 1)
        row["weights_mb"] = round(path.stat().st_size / 2**20, 1)
        row["compile_rss_within_budget"] = peak / 1024 <= 3 * row["weights_mb"] + 1024
        row["generic_kernels"] = compiled.metadata["generic_kernels"]
        row["schedule_rule_errors"] = compiled.metadata["schedule_rule_errors"]
        outputs = compiled.metadata["verification"]["outputs"]
        row["compiles"] = True
        row["max_abs_error"] = max(o["max_abs"] for o in outputs)
        # Outputs that passed only as ill-conditioned (verify.judge_conditioning): said in the table.
        row["ill_conditioned"] = [o["name"] for o in outputs if not o["within_tolerance"] and o.get("passed")]
        inspected = api.inspect_model(path, None, list(model.input_shapes))
        coverage = inspected.coverage
        row.update(kernels=inspected.kernels, stock_kernels=inspected.stock_kernels,
                   compute_share=round(coverage.compute_share, 3), targeted_share=round(coverage.targeted_share, 3),
                   targeted=coverage.targeted, fused=coverage.fused,
                   unfused=[{"target": u.target, "nodes": u.nodes[:3], "reason": u.reason} for u in coverage.unfused],
                   fired=dict(inspected.report.fired))
        try:
            if repeat > 0:
                row.update(timings(path, model.input_shapes, repeat, installed_peers(), precision))
                if model.derived_from:
                    row.update(float_build_timings(model.derived_from, repeat))
        except ModelError as err:
            if "OpenVINO" not in err.message:
                raise
            # A peer that cannot take the model: ours and ORT are timed in a fresh worker
            # (run_one), as OpenVINO's threads, left running here, slow small models 10-300x.
            row["openvino_error"] = err.message
    except TvmFusionError as err:
        # The message and, for a mismatch, the table head and worst output (the culprit at a glance).
        row.update(compiles=row.get("compiles", False),
                   error=" | ".join(line.strip() for line in str(err).splitlines()[:3]))
    except Exception as err:  # noqa: BLE001 - the report records a crash as a result, then goes on
        row.update(compiles=row.get("compiles", False), error=f"crash: {type(err).__name__}: {err}",
                   traceback=traceback.format_exc(limit=3))
    queue.put(row)


def timings(path, input_shapes, repeat: int, peers: list[str], precision: str = "float32") -> dict:
    """Medians of ORT, ours and the peers, interleaved in one process; each OpenVINO row (f32,
    its default) with the precision it ran at and its error against ONNX Runtime float32; at
    bf16, our bf16 row too (bf16_timings)."""
    from tvm_fusion import api
    from tvm_fusion.commands.peers import OPENVINO_ROWS

    bench = api.bench_model(path, None, list(input_shapes), repeat=repeat, include_stock=False, peers=peers,
                            precision=precision)
    medians = bench.medians_ms
    found = dict(ort_ms=round(medians["onnxruntime"], 3), ours_ms=round(medians["tvm_fusion"], 3),
                 ratio_to_ort=round(bench.ratios()["tvm_fusion"], 3), load_average=bench.load_average)
    for row in (name for name, _ in OPENVINO_ROWS if name in medians):
        found.update({f"{row}_ms": round(medians[row], 3),
                      f"ratio_to_{row}": round(medians["tvm_fusion"] / medians[row], 3),
                      f"{row}_precision": bench.peer_precision[row],
                      f"{row}_max_abs_error": bench.max_abs_error[row],
                      f"{row}_max_rel_error": bench.max_rel_error[row],
                      f"{row}_cosine_similarity": bench.cosine_similarity[row]})
    return found | bf16_timings(bench)


def float_build_timings(source: str, repeat: int) -> dict:
    """Our float32 build of the float model a quantized one was made from (``derived_from``),
    and ONNX Runtime on it, in rounds of their own in the same worker: what int8 gains over it."""
    from tvm_fusion import api

    model = zoo.load_manifest()[source]
    bench = api.bench_model(zoo.model_path(source), None, list(model.input_shapes), repeat=repeat,
                            include_stock=False)
    return dict(float_model=source, float_ours_ms=round(bench.medians_ms["tvm_fusion"], 3),
                float_ort_ms=round(bench.medians_ms["onnxruntime"], 3))


def bf16_timings(bench) -> dict:
    """Our bf16 row beside our float32 one and OpenVINO's default: what bf16 gains, and what it
    costs in error against ONNX Runtime float32 next to what OpenVINO's default costs."""
    medians = bench.medians_ms
    if "tvm_fusion_bf16" not in medians:
        return {}
    bf16 = medians["tvm_fusion_bf16"]
    found = dict(ours_bf16_ms=round(bf16, 3), ratio_bf16_to_f32=round(bf16 / medians["tvm_fusion"], 3),
                 bf16_kernels=len(bench.bf16_kernels), bf16_max_abs_error=bench.max_abs_error["tvm_fusion_bf16"],
                 bf16_cosine_similarity=bench.cosine_similarity["tvm_fusion_bf16"])
    if "openvino_default" in medians:
        found["ratio_bf16_to_openvino_default"] = round(bf16 / medians["openvino_default"], 3)
    return found


def time_without_peers(name: str, repeat: int, precision: str, queue) -> None:
    model = zoo.load_manifest()[name]
    queue.put(timings(zoo.model_path(name), model.input_shapes, repeat, [], precision))


def run_one(name: str, repeat: int, timeout: float, out_dir: str, precision: str = "float32") -> dict:
    row, failure = run_in_worker(measure, (name, repeat, out_dir, precision), timeout)
    if failure is not None:
        return {"model": name, "compiles": False, "error": failure}
    if "openvino_error" in row and repeat > 0:
        timed, failure = run_in_worker(time_without_peers, (name, repeat, precision), timeout)
        row.update(timed or {"error": f"timing: {failure}"})
    return row


def failures(rows: list[dict]) -> list[str]:
    """What fails the report, one line per finding: a model that does not compile or verify, a
    kernel that only a generic schedule rule took while holding a contraction or much of the
    FLOPs (commands/generic_kernels.py), a schedule rule that raised (its kernel went on to the
    next rule), and a compile whose peak RSS is over the budget of 3x the weights' bytes +
    1 GiB. No such thing may hide."""
    found = []
    for r in rows:
        if not r.get("compiles"):
            found.append(f"{r['model']}: does not compile: {r.get('error', 'no error recorded')}")
        for kernel in r.get("generic_kernels", []):
            found.append(f"{r['model']}: {kernel['kernel']} ({kernel['rule']}, {kernel['flops']:,} FLOPs, "
                         f"contraction: {kernel['contraction']}, ONNX {', '.join(kernel['onnx_nodes'][:3])})")
        for error in r.get("schedule_rule_errors", []):
            found.append(f"{r['model']}: schedule rule {error['rule']} raised on {error['kernel']}: {error['error']}")
        if r.get("compile_rss_within_budget") is False:
            found.append(f"{r['model']}: compile peak RSS {r['compile_peak_rss_mb']} MB over the budget of "
                         f"{3 * r['weights_mb'] + 1024:.0f} MB (3x {r['weights_mb']} MB of weights + 1 GiB)")
    return found


def markdown(rows: list[dict]) -> str:
    bf16 = any("ours_bf16_ms" in r for r in rows)  # a --precision bf16 run: our bf16 build's column
    lines = ["| model | exporter | compiles | max abs err vs ORT | coverage (targeted chains / compute nodes) "
             "| kernels (ours / stock) | ms (ORT / ours, ratio) | ms OpenVINO f32 (ours / it) "
             "| ms OpenVINO default (precision; ours / it) | OpenVINO max abs err vs ORT (f32 / default) "
             + ("| ours bf16 ms (bf16 / f32; bf16 kernels; max abs err vs ORT) " if bf16 else "")
             + "| compile s, peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if bf16 else "")]
    for r in rows:
        if not r.get("compiles"):
            lines.append(f"| {r['model']} | {r.get('exporter', '')} | no: {r.get('error', '')[:90]} | | | | | | | | |"
                         + (" |" if bf16 else ""))
            continue
        coverage = (f"{r['targeted_share']:.0%} / {r['compute_share']:.0%}" if "targeted_share" in r else "")
        kernels = f"{r['kernels']} / {r['stock_kernels']}" if "kernels" in r else ""
        timing = f"{r['ort_ms']} / {r['ours_ms']} ({r['ratio_to_ort']:.2f}x)" if "ours_ms" in r else r.get("error", "")
        openvino = (f"{r['openvino_ms']} ({r['ratio_to_openvino']:.2f}x)" if "openvino_ms" in r else
                    "cannot compile it" if "openvino_error" in r else "")
        default = (f"{r['openvino_default_ms']} ({r['openvino_default_precision']}; "
                   f"{r['ratio_to_openvino_default']:.2f}x)" if "openvino_default_ms" in r else "")
        openvino_error = (f"{r['openvino_max_abs_error']:.1e} / {r['openvino_default_max_abs_error']:.1e}"
                          if "openvino_default_max_abs_error" in r else "")
        memory = f"{r.get('compile_s', '')} s, {r.get('compile_peak_rss_mb', '')} MB"
        ours_bf16 = ([f"{r['ours_bf16_ms']} ({r['ratio_bf16_to_f32']:.2f}x; {r['bf16_kernels']}; "
                      f"{r['bf16_max_abs_error']:.1e})" if "ours_bf16_ms" in r else ""] if bf16 else [])
        shaky = f" (ill-conditioned: {', '.join(r['ill_conditioned'])})" if r.get("ill_conditioned") else ""
        lines.append(f"| {r['model']} | {r['exporter']} | yes | {r['max_abs_error']:.1e}{shaky} | {coverage} "
                     f"| {kernels} | {timing} | {openvino} | {default} | {openvino_error} | "
                     + "".join(f"{cell} | " for cell in ours_bf16) + f"{memory} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these models (default: all)")
    parser.add_argument("--repeat", type=int, default=20, help="interleaved rounds per model (default 20; 0 skips the timings: compile, "
                        "memory and coverage only)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per model (default 900)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "zoo.json"))
    parser.add_argument("--precision", choices=["float32", "bf16"], default="float32",
                        help="bf16: also time our bf16 build (matmuls and convs by constant weights as bf16 kernels) beside "
                             "our float32 one; needs a host with AVX512_BF16 or AMX-BF16")
    parser.add_argument("--note", help="a sentence the docs print under the table: how the run went (what else "
                        "shared the machine)")
    args = parser.parse_args(argv)
    if args.precision == "bf16" and not has_bf16_kernels(load_config().tvm_target()):
        parser.error(f"--precision bf16 needs a host CPU with AVX512_BF16 or AMX-BF16; this one ({host_cpu_name()}) "
                     "has neither (docs/precision.md)")
    models = zoo.load_manifest()
    names = args.only or list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        parser.error(f"not in the zoo manifest: {', '.join(unknown)} (see scripts/fetch_zoo.py --list)")
    zoo.fetch(names, progress=lambda m: print(m, file=sys.stderr))
    rows = []
    out_dir = str(ROOT / "build" / "zoo")
    for name in names:
        print(f"[zoo] {name}", file=sys.stderr, flush=True)
        rows.append(run_one(name, args.repeat, args.timeout, out_dir, args.precision))
        print(f"[zoo] {name}: {json.dumps({k: v for k, v in rows[-1].items() if k not in ('unfused', 'fired', 'traceback')})}",
              file=sys.stderr, flush=True)
    machine = {"cpu": host_cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "machine": machine, "precision": args.precision,
                           **({"note": args.note} if args.note else {}), "models": rows})
    print(markdown(rows))
    problems = failures(rows)
    for line in problems:
        print(f"[zoo] FAIL {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
