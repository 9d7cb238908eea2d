"""The generated parts of the docs: catalogues read from the registries, the source map read from
the package tree, benchmark tables read from ``benchmarks/results/*.json``, and README's headline
table. Generated, so they cannot drift from the code or from the measurements.

Two ways in:

* MkDocs hook (``hooks:`` in mkdocs.yml). A docs page line ``<!-- gen:NAME -->`` (or
  ``<!-- gen:result FILE.json -->``) is replaced by that block at build time; an unknown block,
  or a results file whose machine and date are unknown, stops the build.
* Script (from the repository root)::

      python scripts/gen_docs.py --readme      # rewrite README's headline table from the JSON
      python scripts/gen_docs.py --check       # exit 1 when README's headline table is stale
      python scripts/gen_docs.py --show NAME   # print one block (patterns, schedule-rules, ...)

``tests/test_docs.py`` checks README's table against a fresh generation and that every
registered pattern and schedule rule, every module and every results file reaches the site.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import inspect
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tvm_fusion"
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"

MARKER = re.compile(r"^<!-- gen:([a-z-]+)(?: (\S+))? -->$", re.MULTILINE)
HEADLINE_SOURCE = "zoo_emeraldrapids_2026-12-04.json"
HEADLINE_BEGIN = "<!-- headline:begin (generated: python scripts/gen_docs.py --readme) -->"
HEADLINE_END = "<!-- headline:end -->"


# --- where and when each results file was measured -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Provenance:
    """What a results file does not say itself. ``sha256`` is its first 12 hex digits: a re-run
    changes the file, and the docs build stops until the new run's machine and date are recorded."""

    sha256: str
    date: str
    machine: str | None = None  # None: the file names it
    how: str = ""


PROVENANCE = {
    "ablate_zoo.json": Provenance("79b4d50ed57f", "2026-12-01", "not recorded",
                                  "`scripts/ablate_zoo.py`, 5 rounds per variant"),
    "cnn.json": Provenance("4bc041987318", "2026-12-03", None,
                           "`benchmarks/bench_cnn.py --repeat 30`, untuned, default config"),
    "cnn_znver1.json": Provenance("5f763e7c5aa8", "2026-12-03", None,
                                  "`benchmarks/bench_cnn.py --repeat 20`, untuned, default config"),
    "conformance.json": Provenance("e8087a27b889", "2026-11-30", "not recorded (pass/fail counts, no timings)",
                                   "`scripts/onnx_node_conformance.py`, onnx 1.23's node test cases"),
    "conv_transpose.json": Provenance("b75db1933876", "2026-11-30", "not recorded",
                                      "`benchmarks/bench_conv_transpose.py`"),
    "dynamic.json": Provenance("0a1e67f7fb69", "2026-12-02", "AMD Zen 3, 2 cores (busy during the run)",
                               "`benchmarks/bench_dynamic.py --repeat 20`, untuned; the resnet_tiny and "
                               "mobilenetv3_tiny rows are from the run of 2026-12-01"),
    "examples.json": Provenance("dd1f95a460b4", "2026-11-30", "not recorded",
                                "`benchmarks/bench_examples.py`"),
    "fused_onnx_check.json": Provenance("ce9e1c15d0a9", "2026-12-01", "not recorded (errors, no timings)",
                                        "`scripts/check_fused_onnx_zoo.py`; models that import since are "
                                        "listed as they failed then"),
    "subnormals.json": Provenance("9849762a5a63", "2026-12-04", "Intel Xeon (Emerald Rapids), 2 cores",
                                  "`benchmarks/bench_subnormals.py --rounds 40`"),
    "targets.json": Provenance("900651a4e96c", "2026-11-30",
                               "not recorded (an x86-64 machine with AVX-512: both artifacts ran natively)",
                               "`benchmarks/bench_targets.py`"),
    "tuning.json": Provenance("0c05eb171f28", "2026-11-30", "AMD Zen 5, 2 cores (target key llvm-znver5-2c)",
                              "`benchmarks/bench_tuning.py`, 200 trials per model"),
    "winograd.json": Provenance("5e4bc5c32467", "2026-12-07", "Intel Xeon (Emerald Rapids), 2 cores",
                                "`benchmarks/bench_winograd.py`, the kernel alone, interleaved in one process"),
    "zoo.json": Provenance("a2d8c080aded", "2026-12-02",
                           "2-core Intel Xeons with AVX-512: the nine CNN rows on a Sapphire/Emerald Rapids "
                           "class machine, the other rows on another AVX-512 class; a row marked * names "
                           "its own machine and date",
                           "`scripts/zoo_report.py --repeat 10`, untuned, each model in a process of its own"),
    "zoo_emeraldrapids.json": Provenance("727c3f8190cc", "2026-12-03", "Intel Xeon (Emerald Rapids), 2 cores",
                                         "`scripts/zoo_report.py --repeat 10`, the nine CNNs, untuned"),
    "zoo_emeraldrapids_2026-12-04.json": Provenance("f876be8362d9", "2026-12-04",
                                                    "Intel Xeon (Emerald Rapids), 2 cores",
                                                    "`scripts/zoo_report.py --repeat 15`, the nine CNNs, "
                                                    "untuned"),
    "zoo_znver1.json": Provenance("12c565ca9366", "2026-12-03",
                                  "AMD EPYC family 23 (Zen 1, znver1), 2 cores, AVX2 only",
                                  "`scripts/zoo_report.py`, the nine CNNs, untuned"),
}


class DocsError(Exception):
    """Something the generated docs cannot be made from; the message says what to fix."""


def sha256_prefix(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _machine_in_file(data) -> str | None:
    """The machine a results file names itself, if it does."""
    if isinstance(data, dict) and isinstance(data.get("machine"), dict):
        machine = data["machine"]
        return f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
    if isinstance(data, dict) and isinstance(data.get("machine"), str):
        return data["machine"]
    entries = list(data.values()) if isinstance(data, dict) else []
    keys = sorted({entry["peak"]["target_key"] for entry in entries if isinstance(entry, dict)
                   and isinstance(entry.get("peak"), dict) and "target_key" in entry["peak"]})
    if keys:
        peaks = [entry["peak"] for entry in entries if isinstance(entry, dict) and "peak" in entry]
        return (f"target key {', '.join(keys)}; probed peaks {max(p['gflops'] for p in peaks):.0f} GFLOP/s FMA, "
                f"{max(p['gbytes_per_s'] for p in peaks):.1f} GB/s triad")
    if isinstance(data, dict) and isinstance(data.get("target"), str):
        target = json.loads(data["target"])
        return f"{target.get('mcpu', 'generic')}, {target.get('num-cores', '?')} cores"
    return None


def provenance(name: str) -> tuple[str, str, str]:
    """(machine, date, how it was run) of ``benchmarks/results/NAME``."""
    path = RESULTS / name
    data = json.loads(path.read_text())
    machine, date = _machine_in_file(data), data.get("date") if isinstance(data, dict) else None
    recorded = PROVENANCE.get(name)
    if machine and date:
        return machine, date, recorded.how if recorded else ""
    if recorded is None:
        raise DocsError(f"benchmarks/results/{name} does not say on which machine and when it was measured: "
                        "have the benchmark write 'machine' and 'date', or add it to PROVENANCE in "
                        "scripts/gen_docs.py")
    digest = sha256_prefix(path)
    if digest != recorded.sha256:
        raise DocsError(f"benchmarks/results/{name} changed since its machine and date were recorded "
                        f"(sha256 {digest}, recorded {recorded.sha256}): update its PROVENANCE entry in "
                        "scripts/gen_docs.py")
    return machine or recorded.machine or "not recorded", date or recorded.date, recorded.how


def caption(name: str) -> str:
    machine, date, how = provenance(name)
    return (f"*Machine:* {machine}. *Date:* {date}. *Source:* `benchmarks/results/{name}`"
            + (f". *Run:* {how}." if how else "."))


# --- formatting -----------------------------------------------------------------------------------------

def _ms(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


# --- benchmark tables, one renderer per kind of results file ----------------------------------------

def render_zoo(data) -> str:
    # OpenVINO at its default precision (and both rows' errors) where the file has them: runs before
    # zoo_report.py timed it have no such columns.
    default = any("openvino_default_ms" in m for m in data["models"])
    bf16 = any("ours_bf16_ms" in m for m in data["models"])  # a --precision bf16 run
    derived = any("float_ours_ms" in m for m in data["models"])  # quantized models made from zoo float ones
    rows, own = [], []
    for m in data["models"]:
        name = m["model"] + (" *" if "machine" in m else "")
        if "machine" in m:
            own.append(f"\\* {m['model']}: {m['machine']}.")
        coverage = (f"{m['targeted_share']:.0%} / {m['compute_share']:.0%}"
                    if m.get("targeted_share") is not None else "-")
        openvino = ("cannot compile it" if "openvino_error" in m and "openvino_ms" not in m
                    else _ms(m.get("openvino_ms")))
        rows.append([name, m.get("exporter", "-"), " ".join(m.get("input_shapes", [])),
                     "yes" if m.get("compiles") else "no", _err(m.get("max_abs_error")), coverage,
                     f"{m.get('kernels', '-')} / {m.get('stock_kernels', '-')}", _ms(m.get("ort_ms")),
                     _ms(m.get("ours_ms")), _ratio(m.get("ratio_to_ort")), openvino,
                     _ratio(m.get("ratio_to_openvino")),
                     *([_openvino_default_ms(m), _ratio(m.get("ratio_to_openvino_default")),
                        f"{_err(m.get('openvino_max_abs_error'))} / {_err(m.get('openvino_default_max_abs_error'))}"]
                       if default else []),
                     *(_bf16_cells(m) if bf16 else []), *(_float_build_cells(m) if derived else []),
                     _compile_cost(m)])
    text = table(["model", "exporter", "inputs", "compiles", "max abs err vs ORT",
                  "coverage (targeted chains / compute nodes)", "kernels (ours / stock)", "ORT ms", "ours ms",
                  "ours / ORT", "OpenVINO f32 ms", "ours / OpenVINO",
                  *(["OpenVINO default ms (precision)", "ours / OpenVINO default",
                     "OpenVINO max abs err vs ORT (f32 / default)"] if default else []),
                  *(["ours bf16 ms", "bf16 / f32", "bf16 / OpenVINO default", "bf16 max abs err vs ORT",
                     "bf16 kernels"] if bf16 else []),
                  *(["float model: ours float32 ms", "ours int8 / ours float32"] if derived else []),
                  "compile s, peak RSS MB (budget)"], rows)
    notes = [data["note"]] if isinstance(data, dict) and data.get("note") else []
    return text + ("\n\n" + " ".join(own) if own else "") + ("\n\n" + " ".join(notes) if notes else "")


def _float_build_cells(m: dict) -> list[str]:
    """A quantized model made from a zoo float one: our float32 build of that (its own rounds)."""
    if "float_ours_ms" not in m:
        return ["-", "-"]
    return [f"{_ms(m['float_ours_ms'])} ({m['float_model']})", _ratio(m["ours_ms"] / m["float_ours_ms"])]


def _bf16_cells(m: dict) -> list[str]:
    """Our bf16 build beside our float32 one and OpenVINO's default (zoo_report.py --precision bf16)."""
    return [_ms(m.get("ours_bf16_ms")), _ratio(m.get("ratio_bf16_to_f32")),
            _ratio(m.get("ratio_bf16_to_openvino_default")), _err(m.get("bf16_max_abs_error")),
            str(m.get("bf16_kernels", "-"))]


def _openvino_default_ms(m: dict) -> str:
    """OpenVINO's time at its default precision, with the precision it chose."""
    if "openvino_default_ms" not in m:
        return "-"
    return f"{_ms(m['openvino_default_ms'])} ({m['openvino_default_precision']})"


def _compile_cost(m: dict) -> str:
    """Compile wall time and peak RSS against the budget of 3x the weights + 1 GiB, where recorded."""
    if "compile_peak_rss_mb" not in m:
        return f"{m['compile_s']} s" if "compile_s" in m else "-"
    budget = 3 * m["weights_mb"] + 1024
    seconds = f"{m['compile_s']} s" if "compile_s" in m else "-"
    return (f"{seconds}, {m['compile_peak_rss_mb']:.0f} MB ({budget:.0f}"
            f"{', over' if not m.get('compile_rss_within_budget', True) else ''})")


def render_cnn(data) -> str:
    default = any("openvino_default" in r["medians_ms"] for r in data.values())  # runs since bench had it
    rows = []
    for case, r in data.items():
        med, ratio = r["medians_ms"], r["ratio_to_onnxruntime"]
        slowest = "; ".join(f"{k['rule']} {k['ms']:.3f} ms x{k['calls']}, {k['gflops']:.0f} GFLOP/s"
                            for k in r.get("slowest_kernels", []))
        vs_openvino = med["tvm_fusion"] / med["openvino"] if med.get("openvino") else None
        errors, chose = r["max_abs_error"], r.get("peer_precision", {}).get("openvino_default", "-")
        rows.append([case, _ms(med.get("onnxruntime")), _ms(med.get("openvino")),
                     *([f"{_ms(med.get('openvino_default'))} ({chose})",
                        f"{_err(errors.get('openvino'))} / {_err(errors.get('openvino_default'))}"] if default else []),
                     _ms(med.get("stock_tvm")), _ms(med.get("tvm_fusion")), _ratio(ratio.get("tvm_fusion")),
                     _ratio(vs_openvino), slowest])
    return table(["model, input", "ORT ms", "OpenVINO f32 ms",
                  *(["OpenVINO default ms (precision)", "OpenVINO max abs err vs ORT (f32 / default)"]
                    if default else []),
                  "stock TVM ms", "tvm_fusion ms", "ours / ORT",
                  "ours / OpenVINO", "slowest kernels (rule, ms per call x calls, GFLOP/s)"], rows)


def render_examples(data) -> str:
    rows = []
    for name, r in data.items():
        med = r["medians_ms"]
        inputs = ", ".join(f"{k} {_shape(v)}" for k, v in r["inputs"].items())
        rows.append([name, inputs, _ms(med.get("onnxruntime")), _ms(med.get("stock_tvm")),
                     _ms(med.get("tvm_fusion_untuned")), _ms(med.get("tvm_fusion")),
                     _ratio(r["ratio_to_onnxruntime"].get("tvm_fusion")),
                     f"{r.get('kernels', '-')} / {r.get('stock_fusion_kernels', '-')}",
                     _err(r["max_abs_error"].get("tvm_fusion"))])
    return table(["model", "inputs", "ORT ms", "stock TVM ms", "tvm_fusion untuned ms", "tvm_fusion ms",
                  "ours / ORT", "kernels (ours / stock FuseOps)", "max abs err"], rows)


def render_dynamic(data) -> str:
    rows = []
    for r in data["results"]:
        med = r["medians_ms"]
        size = "x".join(str(v) for v in r["sizes"].values())
        rows.append([r["model"], r["range"], size, "yes" if r["bucket"] else "**no**", _ms(med["onnxruntime"]),
                     _ms(med["static"]), _ms(med["dynamic"]), _ms(med["bucketed"]),
                     _ratio(r["dynamic_over_static"]), _ratio(r["bucketed_over_static"]),
                     _ratio(r["bucketed_over_onnxruntime"])])
    return table(["model", "range", "size", "bucket", "ORT ms", "static ms", "dynamic ms", "bucketed ms",
                  "dynamic / static", "bucketed / static", "bucketed / ORT"], rows)


def render_targets(data) -> str:
    rows = []
    for name, r in data.items():
        med = r["medians_ms"]
        inputs = ", ".join(f"{k} {_shape(v)}" for k, v in r["inputs"].items())
        rows.append([name, inputs, _ms(med.get("x86_64-avx512")), _ms(med.get("x86_64-avx2")),
                     _ratio(r.get("avx2_over_avx512")),
                     "; ".join(f"{k}: {v}" for k, v in r.get("verification", {}).items())])
    return table(["model", "inputs", "x86_64-avx512 ms", "x86_64-avx2 ms", "avx2 / avx512", "verification"], rows)


def render_tuning(data) -> str:
    rows = []
    for name, r in data.items():
        med, ours, stock = r["medians_ms"], r["tvm_fusion_tuning"], r["stock_tuning"]
        rows.append([name, _ms(med.get("onnxruntime")), _ms(med.get("tvm_fusion untuned")),
                     _ms(med.get("tvm_fusion tuned")), _ms(med.get("stock TVM tuned")),
                     f"{ours['trials_in_log']} (budget {ours['trials_budget']})",
                     f"{stock['trials_run']} over {stock['tasks']} tasks", len(ours["kernels_tuned"]),
                     len(ours["kernels_hand"])])
    return table(["model", "ORT ms", "tvm_fusion untuned ms", "tvm_fusion tuned ms", "stock TVM tuned ms",
                  "our trials in the log", "stock TVM trials", "kernels tuned", "kernels on hand schedules"], rows)


def render_concurrency(data) -> str:
    clients = sorted({r["clients"] for r in data["results"]})
    runners = list(dict.fromkeys(r["runner"] for r in data["results"]))
    by = {(r["runner"], r["clients"]): r["median_calls_per_s"] for r in data["results"]}
    rows = [[runner] + [f"{by[(runner, c)]:.0f}" if (runner, c) in by else "-" for c in clients]
            for runner in runners]
    inputs = ", ".join(f"{k} {_shape(v)}" for k, v in data["inputs"].items())
    return (f"`{data['model']}` ({inputs}), {data['threads_per_call']} threads per call, median calls/s of "
            f"{data['rounds']} rounds of {data['seconds']:g} s:\n\n"
            + table(["runner"] + [f"{c} client{'s' if c > 1 else ''}" for c in clients], rows))


def render_serve(data) -> str:
    rows = [[runner, r["requests"], f"{r['requests_per_s']:.1f}", _ms(r["p50_ms"]), _ms(r["p99_ms"]), r["errors"],
             f"{r['rss_start_mb']:.0f} -> {r['rss_end_mb']:.0f}"] for runner, r in data["results"].items()]
    return (f"`{data['model']}`, {data['clients']} clients for {data['seconds']:g} s, "
            f"{data['threads_per_call']} threads per call:\n\n"
            + table(["server", "requests", "requests/s", "p50 ms", "p99 ms", "errors", "RSS MB (start -> end)"],
                    rows))


def render_winograd(data) -> str:
    rows = [[r["case"], f"{r['direct_us']:.0f}", f"{r['f2_us']:.0f}" if r.get("f2_us") else "-",
             f"{r['f4_us']:.0f}" if r.get("f4_us") else "-", r.get("picked", "-"),
             _err(r.get("max_abs_vs_direct"))] for r in data["results"]]
    return table(["3x3 conv", "direct us", "F(2x2) us", "F(4x4) us", "picked", "max abs diff vs direct"], rows)


def render_conv_transpose(data) -> str:
    rows = []
    for case, r in data.items():
        med = r["medians_ms"]
        rows.append([case, " ".join(_shape(v) for v in r["inputs"].values()), _ms(med.get("onnxruntime")),
                     _ms(med.get("stock_tvm")), _ms(med.get("tvm_fusion")),
                     _ms(r.get("tvm_fusion_dilated_schedule_ms")), _ratio(r["ratio_to_onnxruntime"]["tvm_fusion"])])
    return table(["case", "input", "ORT ms", "stock TVM ms", "tvm_fusion ms", "dilated schedule ms",
                  "ours / ORT"], rows)


def render_subnormals(data) -> str:
    rows = [[r["model"], r["subnormals"], _ms(r.get("kept_ms")), _ms(r.get("flushed_ms")), _ratio(r.get("ratio")),
             r.get("rounds", "-"), _err(r.get("max_abs_difference"))] for r in data]
    return table(["model", "subnormal weights", "kept ms", "flushed ms", "flushed / kept", "rounds",
                  "max abs difference"], rows)


def render_int8(data) -> str:
    rows = [[model, _ms(r["median_ms"]["float"]), _ms(r["median_ms"]["vnni"]), _ms(r["median_ms"].get("amx")),
             _ms(r["median_ms"]["ort"]), _ratio(r["int8_over_float"]), _ratio(r["int8_over_ort"])]
            for model, r in data["models"].items()]
    return (f"{data['threads']} thread(s), {data['repeat']} interleaved rounds, medians; int8 is tvm_fusion's "
            "default (AMX where the CPU has it, M=1 on VNNI):\n\n"
            + table(["QLinearMatMul chain", "float32 path ms", "int8 VNNI ms", "int8 AMX ms", "ONNX Runtime ms",
                     "int8 / float32", "int8 / ONNX Runtime"], rows))


BF16_BUILDS = {"bf16 amx": "bf16 AMX", "bf16 avx512": "bf16 AVX512_BF16", "bf16 generic": "bf16 generic"}


def render_bf16(data) -> str:
    """bench_bf16.py's builds that ran on the machine: AMX tiles, vdpbf16ps registers, generic."""
    shapes = data["shapes"].values()
    builds = [b for b in BF16_BUILDS if any(b in r["median_ms"] for r in shapes)]
    fast = [b for b in builds if b != "bf16 generic"]
    rows = [[label, _ms(r["median_ms"]["float32"]), *(_ms(r["median_ms"].get(b)) for b in builds),
             *(_ratio(r["median_ms"]["float32"] / r["median_ms"][b]) if b in r["median_ms"] else "-" for b in fast),
             *(_err(r["max_abs_error_vs_numpy"].get(b)) for b in fast)]
            for label, r in data["shapes"].items()]
    return (f"{data['threads']} thread(s), {data['repeat']} interleaved rounds, medians; a dense layer with bias and "
            "GELU (rows x K -> N); \"bf16 generic\" is the same bf16 kernel without AMX or AVX512_BF16 (bf16 "
            "weights, float32 FMAs); the error is against numpy on the bf16-rounded operands:\n\n"
            + table(["rows x K -> N", "float32 ms", *(f"{BF16_BUILDS[b]} ms" for b in builds),
                     *(f"float32 / {BF16_BUILDS[b]}" for b in fast), *(f"{BF16_BUILDS[b]} max abs error" for b in fast)],
                    rows))


def render_compile_memory(data) -> str:
    rows = [[r["source"], r.get("compile_s", "-"), r.get("peak_rss_mb", r.get("failure", "-")),
             "yes" if r.get("within_budget") else "no"] for r in data["rows"]]
    return (f"`{data['model']}` at {', '.join(data['input_shapes'])}: {data['weights_mb']} MB of weights, a budget of "
            f"{data['budget_mb']} MB (3x the weights + 1 GiB); compile with verification, in a worker process of its "
            "own, peak RSS of it and its children:\n\n"
            + table(["tvm_fusion", "compile s", "peak RSS MB", "within budget"], rows))


def render_ablate(data) -> str:
    rows = []
    for model, r in data["models"].items():
        for variant in r["variants"]:
            rows.append([model, variant["name"], variant["kernels"], _ms(variant["median_ms"]),
                         f"{variant['worth_percent']:+.0f} %" if variant["name"] != "all patterns" else "-"])
    return (f"Config `{data['config']}`, {data['rounds']} rounds. A variant's worth is what it adds to the "
            "all-patterns latency:\n\n" + table(["model", "variant", "kernels", "median ms", "worth"], rows))


def render_conformance(data) -> str:
    summary = data["summary"]
    rows = [[pipeline, s["cases"], s["imported"], s["passed"], s["failed"], s["not_imported"]]
            for pipeline, s in (("stock TVM", summary["stock"]), ("tvm_fusion", summary["tvm_fusion"]))]
    return (table(["pipeline", "cases", "imported", "passed", "failed", "not imported"], rows)
            + f"\n\nPassed by stock TVM but not by tvm_fusion: {len(summary['regressions'])}. "
            f"Passed by tvm_fusion but not by stock TVM: {len(summary['fixed'])}.")


def render_fused_onnx(data) -> str:
    rows = []
    for m in data["models"]:
        ops = ", ".join(f"{n} {op}" for op, n in m.get("fused_ops", {}).items())
        rows.append([m["model"], m["source"], "yes" if m.get("imports") else "no", "yes" if m.get("passed") else "no",
                     ops or "-", _err(m.get("max_abs_error")), len(m.get("kept", [])), m.get("error", "")])
    return (f"Config `{data['config']}`:\n\n"
            + table(["model", "source", "imports", "passes", "fused nodes", "max abs error", "kept as ONNX nodes",
                     "error"], rows))


def render_gpu_kernels(data: dict) -> str:
    """benchmarks/gpu_kernel_resources.py: ptxas figures, our GPU rule against dlight's default."""
    rows = []
    for k in data["kernels"]:
        ours, default = k["ours"], k["dlight"]
        rows.append([k["model"], f"`{k['kernel']}`"] + [
            f"{side['rule']}: {side['launches']} x {'/'.join(map(str, side['threads_per_block']))} thr, "
            f"{side['registers']} reg, {side['shared_bytes']} B smem, "
            f"{side['stack_bytes'] + side['spill_bytes']} B local, input read {side['input_reads']}x"
            for side in (ours, default)])
    return table(["model", "kernel", "tvm_fusion GPU rule", "dlight default"], rows)


RENDERERS: list[tuple[str, Callable]] = [  # (file name prefix, renderer), first match wins
    ("zoo", render_zoo), ("cnn", render_cnn), ("examples", render_examples), ("dynamic", render_dynamic),
    ("targets", render_targets), ("tuning", render_tuning), ("concurrency", render_concurrency),
    ("serve", render_serve), ("winograd", render_winograd), ("conv_transpose", render_conv_transpose),
    ("subnormals", render_subnormals), ("int8", render_int8), ("bf16", render_bf16),
    ("compile_memory", render_compile_memory), ("ablate", render_ablate),
    ("conformance", render_conformance), ("fused_onnx", render_fused_onnx), ("gpu_kernels", render_gpu_kernels),
]


def result_block(name: str) -> str:
    path = RESULTS / name
    if not path.is_file():
        raise DocsError(f"benchmarks/results/{name} does not exist")
    renderer = next((render for prefix, render in RENDERERS if name.startswith(prefix)), None)
    if renderer is None:
        raise DocsError(f"no table renderer for benchmarks/results/{name}: add one to RENDERERS in "
                        "scripts/gen_docs.py")
    return caption(name) + "\n\n" + renderer(json.loads(path.read_text()))


def results_index() -> str:
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        machine, date, how = provenance(path.name)
        rows.append([f"`{path.name}`", date, machine, how or "-"])
    return table(["file", "date", "machine", "run"], rows)


def headline() -> str:
    data = json.loads((RESULTS / HEADLINE_SOURCE).read_text())
    machine, date, how = provenance(HEADLINE_SOURCE)
    rows = [[m["model"], m["exporter"], _ms(m["ort_ms"]), _ms(m["ours_ms"]), _ratio(m["ratio_to_ort"]),
             _ms(m.get("openvino_ms")), _ratio(m.get("ratio_to_openvino"))] for m in data["models"]]
    return (f"Nine published CNNs of the model zoo, untuned, batch 1, medians of interleaved rounds, ONNX "
            f"Runtime and OpenVINO f32 in the same rounds ({how}). Machine: {machine}; date: {date}; "
            f"`benchmarks/results/{HEADLINE_SOURCE}`. Ratios are tvm_fusion's time over the other's: below "
            "1x, tvm_fusion is faster.\n\n"
            + table(["model", "exporter", "ONNX Runtime ms", "tvm_fusion ms", "x ORT", "OpenVINO f32 ms",
                     "x OpenVINO"], rows))


# --- catalogues from the registries -------------------------------------------------------------------
# tvm_fusion is imported inside the functions that read it: README's table and the benchmark pages
# need only the JSON, and importing TVM takes seconds.

def _escape(text: str) -> str:
    """Plain text safe in Markdown: no emphasis from ``x*y`` or ``a_b``, no link from ``[..](``."""
    return re.sub(r"([*_\[\]\\])", r"\\\1", text).replace("<", "&lt;")


def _markdown(doc: str) -> str:
    """A docstring as Markdown: reST's ``code`` becomes `code`, the prose around it escaped, a
    bullet (``* ``, ``- ``) kept a bullet."""
    lines = []
    for line in inspect.cleandoc(doc).splitlines():
        bullet = re.match(r"^(\s*[*-] )", line)
        head, rest = (bullet.group(1), line[bullet.end():]) if bullet else ("", line)
        parts = re.split(r"``(.+?)``|`(.+?)`", rest)
        out = []
        for index, part in enumerate(parts):
            if part is None:
                continue
            out.append(f"`{part}`" if index % 3 else _escape(part))
        lines.append(head + "".join(out))
    return "\n".join(lines)


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    if not doc:
        return "(no docstring)"
    first = inspect.cleandoc(doc).split("\n\n")[0]
    return _markdown(" ".join(line.strip() for line in first.splitlines()))


def _own_doc(cls: type) -> str | None:
    """The class's own docstring, not one it inherits."""
    return cls.__dict__.get("__doc__")


def _module_doc(cls: type) -> str | None:
    return sys.modules[cls.__module__].__doc__


def _names(names) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "-"


def builtin_patterns() -> list:
    """The built-in patterns in pipeline order (rewrites, then fusions), plugins left out."""
    from tvm_fusion.ordering import declared_order
    from tvm_fusion.patterns.base import FusionRule, RewriteRule
    from tvm_fusion.patterns.registry import builtin_rules

    rules = builtin_rules()
    rewrites = [r for r in rules if isinstance(r, RewriteRule)]
    fusions = [r for r in rules if isinstance(r, FusionRule)]
    return [*declared_order(rewrites, "pattern", elsewhere=frozenset(r.name for r in fusions)),
            *declared_order(fusions, "pattern", elsewhere=frozenset(r.name for r in rewrites))]


def fused_onnx_ops() -> dict[str, list[str]]:
    """Pattern name -> the ``tvm_fusion`` ONNX ops its matches are exported as (``inspect --onnx``),
    read from the fused-ONNX registry (each pattern's spec beside its builder)."""
    try:
        from tvm_fusion.onnx_export.registry import onnx_specs
    except ImportError as err:
        raise DocsError(f"cannot read the fused ONNX ops ({err}): adapt fused_onnx_ops in scripts/gen_docs.py") from err
    return {name: [op.__name__ for op in spec.ops] for name, spec in onnx_specs().items()}


def pattern_catalogue() -> str:
    from tvm_fusion.patterns.base import RewriteRule

    rules, exported = builtin_patterns(), fused_onnx_ops()
    rows, sections = [], []
    for position, rule in enumerate(rules, 1):
        cls = type(rule)
        kind = "rewrite" if isinstance(rule, RewriteRule) else "fusion"
        what = _escape(rule.description) if getattr(rule, "description", "") else _summary(
            _own_doc(cls) or _module_doc(cls))
        rows.append([position, f"[`{rule.name}`](#{rule.name})", kind, what])
        facts = [kind, f"`{cls.__module__}.{cls.__qualname__}`",
                 f"runs before {_names(getattr(cls, 'runs_before', ()))}",
                 f"runs after {_names(getattr(cls, 'runs_after', ()))}"]
        if getattr(rule, "absorbs_elementwise_tail", False):
            facts.append("takes the [element-wise tail](#element-wise-tails) after it")
        if exported.get(rule.name):
            ops = ", ".join(f"[`{op}`](onnx-ops.md#the-ops)" for op in exported[rule.name])
            facts.append(f"written by `inspect --onnx` as {ops}")
        body = [_markdown(_module_doc(cls) or "(no module docstring)")]
        if _own_doc(cls):
            body.append(f"`{cls.__qualname__}`: {_markdown(_own_doc(cls))}")
        sections.append(f"### {rule.name} {{#{rule.name}}}\n\n" + "; ".join(facts) + ".\n\n" + "\n\n".join(body))
    return table(["#", "pattern", "kind", "what it matches"], rows) + "\n\n" + "\n\n".join(sections)


SCHEDULE_KINDS = {"llvm": "CPU (`llvm` targets)", "cuda": "CUDA (`cuda` targets)"}


def builtin_schedule_rules(kind: str) -> list:
    """The rules asked for targets of ``kind``, in order, plugins left out (tvm_fusion's and TVM's own)."""
    from tvm_fusion.ordering import declared_order
    from tvm_fusion.schedules.registry import builtin_cpu_rules, rule_name, rules_for_kind

    if kind == "llvm":
        return declared_order(builtin_cpu_rules(), "schedule rule", rule_name)
    return [rule for rule in rules_for_kind(kind) if type(rule).__module__.startswith(("tvm_fusion.", "tvm."))]


def schedule_catalogue() -> str:
    from tvm_fusion.schedules.registry import rule_name

    parts = []
    for kind, title in SCHEDULE_KINDS.items():
        rules = builtin_schedule_rules(kind)
        rows, sections = [], []
        for position, rule in enumerate(rules, 1):
            cls, name = type(rule), rule_name(rule)
            ours = cls.__module__.startswith("tvm_fusion.")
            anchor = f"[`{name}`](#{kind}-{name.lower()})" if ours else f"`{name}`"
            rows.append([position, anchor, f"`{cls.__module__}`" + ("" if ours else " (TVM's dlight)"),
                         _names(getattr(cls, "runs_before", ())), _names(getattr(cls, "runs_after", ())),
                         _summary(_own_doc(cls) or _module_doc(cls))])
            if ours:
                body = [_markdown(_module_doc(cls) or "(no module docstring)")]
                if _own_doc(cls):
                    body.append(f"What it takes: {_markdown(_own_doc(cls))}")
                sections.append(f"#### {name} {{#{kind}-{name.lower()}}}\n\n`{cls.__module__}.{cls.__qualname__}`\n\n"
                                + "\n\n".join(body))
        parts.append(f"### {title}\n\n"
                     + table(["#", "rule", "module", "runs before", "runs after", "what it schedules"], rows)
                     + ("\n\n" + "\n\n".join(sections) if sections else ""))
    return "\n\n".join(parts)


# --- the source map, read from the package tree --------------------------------------------------------

def _file_summary(path: Path) -> str:
    """The first paragraph of a module's docstring, or of a C++/CMake file's leading comment."""
    text = path.read_text()
    if path.suffix == ".py":
        try:
            return _summary(ast.get_docstring(ast.parse(text)))
        except SyntaxError:
            return "(does not parse)"
    comment = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith(("//", "#")) or stripped in ("//", "#"):
            break
        comment.append(stripped.lstrip("/#").strip())
    return " ".join(comment) or "(no leading comment)"


def _tracked(path: Path) -> bool:
    return not path.name.startswith((".", "_")) or path.name == "__init__.py"


def _packages(folder: Path):
    """``folder`` and every package below it, parents first."""
    yield folder
    for child in sorted(folder.iterdir()):
        if child.is_dir() and _tracked(child) and (child / "__init__.py").exists():
            yield from _packages(child)


def source_map(package: Path = PACKAGE) -> str:
    sections = []
    for folder in _packages(package):
        rows = []
        for entry in sorted(folder.iterdir(), key=lambda p: (p.is_dir(), p.name)):
            if not _tracked(entry) or entry.name == "__init__.py":
                continue
            if entry.is_dir() and (entry / "__init__.py").exists():
                rows.append([f"`{entry.name}/`", _file_summary(entry / "__init__.py")])
            elif entry.suffix in (".py", ".cc") or entry.name == "CMakeLists.txt":
                rows.append([f"`{entry.name}`", _file_summary(entry)])
        relative = folder.relative_to(package.parent).as_posix() + "/"
        sections.append(f"### `{relative}`\n\n{_file_summary(folder / '__init__.py')}\n\n"
                        + table(["module", "what it is"], rows))
    return "\n\n".join(sections)


# --- blocks and the hook --------------------------------------------------------------------------------

BLOCKS: dict[str, Callable[[], str]] = {
    "patterns": pattern_catalogue,
    "schedule-rules": schedule_catalogue,
    "source-map": source_map,
    "results-index": results_index,
    "headline": headline,
}


def block(name: str, argument: str | None = None) -> str:
    if name == "result":
        if not argument:
            raise DocsError("<!-- gen:result --> needs a file name: <!-- gen:result zoo.json -->")
        return result_block(argument)
    if name not in BLOCKS:
        raise DocsError(f"unknown generated block {name!r} (known: result, {', '.join(BLOCKS)})")
    return BLOCKS[name]()


def expand(markdown: str) -> str:
    """Every ``<!-- gen:NAME [ARG] -->`` line of a page replaced by its block."""
    return MARKER.sub(lambda match: block(match.group(1), match.group(2)), markdown)


def on_page_markdown(markdown, page, config, files):  # MkDocs hook
    try:
        return expand(markdown)
    except DocsError as err:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{page.file.src_uri}: {err}") from err


# --- README's headline table ----------------------------------------------------------------------------

def readme_with_headline(text: str) -> str:
    begin, end = text.find(HEADLINE_BEGIN), text.find(HEADLINE_END)
    if begin < 0 or end < begin:
        raise DocsError(f"README.md has no headline markers ({HEADLINE_BEGIN} ... {HEADLINE_END})")
    return text[:begin] + HEADLINE_BEGIN + "\n" + headline() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--readme", action="store_true", help="rewrite README's headline table")
    what.add_argument("--check", action="store_true", help="exit 1 when README's headline table is stale")
    what.add_argument("--show", metavar="NAME", help=f"print one block: result:FILE.json, {', '.join(BLOCKS)}")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    try:
        if args.show:
            name, _, argument = args.show.partition(":")
            try:
                print(block(name, argument or None))
            except BrokenPipeError:  # `--show patterns | head`: the reader left
                pass
            return 0
        current = README.read_text()
        fresh = readme_with_headline(current)
        if args.check:
            if fresh != current:
                print("README.md's headline table is stale: run python scripts/gen_docs.py --readme", file=sys.stderr)
                return 1
            return 0
        README.write_text(fresh)
    except DocsError as err:
        print(f"gen_docs: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
