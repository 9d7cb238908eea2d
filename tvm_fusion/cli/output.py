"""What each ``tvm-fusion`` command prints: one function per command, taking what the API returned.

Tables go to stdout; notes about the input (damaged tuning-log lines, skipped records) to stderr.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from ..accuracy.bf16_gate import Bf16Tolerance, format_bf16
from ..dispatch.buckets import bucket_text
from ..commands.peers import OPENVINO_ROWS
from ..runtime.latency import LatencyStats
from ..report import cut_middle, table
from ..verify import format_comparisons


def _fired_table(fusions: dict[str, int]) -> str:
    fused = [[name, count] for name, count in fusions.items()]
    return table(["pattern", "fired"], fused) if fused else "no fusion pattern fired"


def _notes(notes) -> None:
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


def print_generic_kernels(kernels: list[dict]) -> None:
    """The generic-rule guard (commands/generic_kernels.py): kernels no specific rule claimed."""
    if kernels:
        print(f"WARNING: {len(kernels)} kernel(s) that only a generic schedule rule took (far off the roof; "
              "report the model):")
        print(table(["kernel", "rule", "FLOPs", "share", "contraction", "ONNX nodes"],
                    [[cut_middle(k["kernel"], 48), k["rule"], k["flops"], f"{100 * k['flop_share']:.1f} %",
                      "yes" if k["contraction"] else "no", ", ".join(k["onnx_nodes"][:3]) or "-"] for k in kernels]))


def print_rule_errors(errors: list[dict]) -> None:
    """Schedule rules that raised on a kernel, one line each: ``schedules.RuleError.line()``, written
    here again because this module stays clear of TVM."""
    for error in errors:
        instead = f"{error['scheduled_by']} scheduled it instead" if error["scheduled_by"] else "no rule scheduled it"
        print(f"WARNING: schedule rule {error['rule']} failed on kernel {error['kernel']} ({error['error']}); "
              f"{instead} (report the model)")


def print_compile(result) -> None:
    """One target: the artifact, fusions, kernels, fusion gate, tuning log and verification."""
    meta = result.metadata
    print(f"artifact: {result.artifact}")
    print(_fired_table(meta["fusions"]))
    print(f"kernels per call: {meta['kernels']}")
    for bucket in meta.get("buckets", []):
        print(f"bucket {bucket_text(bucket['sizes'])}: static kernels, {bucket['kernels']} per call")
    print_generic_kernels(meta.get("generic_kernels", []))
    print_rule_errors(meta.get("schedule_rule_errors", []))
    if meta.get("fusion_gate"):
        gate = meta["fusion_gate"]
        print(f"fusion gate: {gate['checked']} fused instance(s) checked against their unfused nodes, "
              f"{len(gate['undone'])} undone")
        if gate["undone"]:
            print(table(["undone", "ONNX nodes", "max abs error", "allowed"],
                        [[u["variant"], ", ".join(u["onnx_nodes"] or u["bindings"]), u["max_abs_error"],
                          u["allowed"]] for u in gate["undone"]]))
    if meta.get("tuning"):
        tuning = meta["tuning"]
        tuned, hand = tuning["tuned_kernels"], tuning["hand_schedule_measured_fastest"]
        if Path(tuning["log"]).is_dir():
            print(f"tuning log {tuning['log']}: {len(tuned)} kernel(s) tuned"
                  f"{': ' + ', '.join(tuned) if tuned else ''}; {len(hand)} kept the hand schedule (measured fastest)")
        else:
            print(f"tuning log: no records for {tuning['target_key']}: hand schedules (`tvm-fusion tune` tunes them)")
    if meta.get("precision_fallback"):
        print(f"precision auto: {meta['precision_fallback']['reason']}")
    if result.comparisons and meta["verification"].get("bf16_gate"):
        print(format_bf16(result.comparisons, Bf16Tolerance(**meta["verification"]["bf16_gate"])))
    elif result.comparisons:
        print(format_comparisons(result.comparisons, meta["verification"]["rtol"],
                                 meta["verification"]["atol"]))
    elif meta["verification"] is None:
        print("verification: skipped (--no-verify)")
    else:
        print(f"verification: NOT RUN: {meta['verification']['reason']}")


def print_compile_targets(results) -> None:
    """Several targets: the fusions (the same for all), then one row per target; a failed
    target's error to stderr."""
    built = [r for r in results if r.error is None]
    if built:
        print(_fired_table(built[0].metadata["fusions"]))
    rows = [[r.target, str(r.artifact) if r.artifact else "-",
             r.metadata.get("platform", {}).get("arch", "-") if r.metadata else "-",
             r.verification if r.error is None else "FAILED"] for r in results]
    print(table(["target", "artifact", "arch", "verification"], rows))
    for result in results:
        if result.error is not None:
            print(f"tvm-fusion: error: target {result.target}: {result.error}", file=sys.stderr)


def print_run(outputs: dict, times: list[float]) -> None:
    """Each output's shape, dtype, mean and std; with more than one run, the median latency."""
    for name, value in outputs.items():
        print(f"{name}: shape {list(value.shape)} dtype {value.dtype} "
              f"mean {float(np.mean(value)):.6g} std {float(np.std(value)):.6g}")
    if len(times) > 1:
        print(f"latency: {LatencyStats.of(times).line()}")


def print_inspect(result, graph: str | None = None, exported=None) -> None:
    """``inspect``'s tables: counts, fusions and what they absorbed, coverage, near misses,
    Relax ops before and after; the drawn graph and the fused ONNX file if made."""
    print(f"model: {result.model}")
    print(f"ONNX nodes: {sum(result.onnx_ops.values())} as exported, "
          f"{sum(result.onnx_ops_simplified.values())} after shape simplification")
    print(f"kernels per call: tvm_fusion {result.kernels}, stock TVM FuseOps {result.stock_kernels}\n")
    fired = sorted(result.report.fired.items())
    rows = [[name, count] for name, count in fired]
    print(table(["pattern", "fired"], rows) if rows else "no pattern fired")
    variants = sorted([name, count] for name, count in result.report.variants.items())
    if variants:
        print("\n" + table(["fused variant", "count"], variants))
    if result.instances:
        print("\n" + table(["fused", "ONNX nodes absorbed"],
                           [[i.variant, ", ".join(i.nodes) or "-"] for i in result.instances]))
    _print_coverage(result.coverage)
    print_generic_kernels([dataclasses.asdict(k) for k in result.generic_kernels])
    print_rule_errors([dataclasses.asdict(e) for e in result.schedule_rule_errors])
    if result.report.near_misses:
        print("\nnear misses (matched, but the check declined):")
        print(table(["pattern", "where", "reason"],
                    [[m.pattern, m.where, m.reason] for m in result.report.near_misses]))
    ops = sorted(set(result.relax_ops) | set(result.fused_ops),
                 key=lambda op: -result.relax_ops.get(op, 0))
    print("\n" + table(["Relax op / composite", "before", "after"],
                       [[op, result.relax_ops.get(op, 0), result.fused_ops.get(op, 0)] for op in ops]))
    if graph:
        print(f"\nfused graph drawn: {graph}")
    if exported:
        _print_fused_onnx(exported)


def _print_coverage(coverage) -> None:
    targets = sorted(coverage.targeted)
    print(f"\ncoverage: {coverage.fused_compute_nodes} of {coverage.compute_nodes} ONNX compute nodes "
          f"({coverage.compute_share:.0%}) run in kernels our fusions built; "
          f"{sum(coverage.fused.values())} of {sum(coverage.targeted.values())} targeted chains fused "
          f"({coverage.targeted_share:.0%})")
    if targets:
        print(table(["targeted chain", "found", "fused"],
                    [[t, coverage.targeted[t], coverage.fused.get(t, 0)] for t in targets]))
    if coverage.unfused:
        print("\nchains left unfused:")
        print(table(["chain", "ONNX nodes", "why"],
                    [[u.target, ", ".join(u.nodes), u.reason] for u in coverage.unfused]))


def _print_fused_onnx(exported) -> None:
    ops = ", ".join(f"{count} {op}" for op, count in exported.fused_ops.items()) or "no fused node"
    print(f"\nfused ONNX graph: {exported.path} ({ops})")
    if exported.kept:
        print(table(["kept as ONNX nodes", "ONNX nodes", "why"],
                    [[k.variant, ", ".join(k.nodes), k.reason] for k in exported.kept]))
    if exported.comparisons is not None:
        print("onnx.reference (tvm_fusion ops) vs ONNX Runtime:")
        print(format_comparisons(exported.comparisons, exported.rtol, exported.atol))


def print_bench(result) -> None:
    ratios = result.ratios()
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v))}" for k, v in result.inputs.items())
    print(f"model {result.model} ({shapes}), {result.threads} threads, {result.rounds} interleaved rounds")
    stats = result.stats
    # ONNX Runtime's own row is the reference: no error. 1 - cosine: the cosine's digits that matter.
    rows = [[name, stats[name].median_ms, stats[name].min_ms, stats[name].p90_ms, stats[name].p99_ms,
             stats[name].max_ms, round(stats[name].per_s), ratios[name], result.max_abs_error.get(name, 0.0),
             result.max_rel_error.get(name, 0.0), 1.0 - result.cosine_similarity.get(name, 1.0)]
            for name in result.medians_ms]
    print(table(["runtime", "median ms", "min", "p90", "p99", "max", "calls/s", "x ONNX Runtime",
                 "max abs err vs ORT", "max rel err", "1 - cosine"], rows, "lrrrrrrrrrr"))
    print("x ONNX Runtime: ratio of medians; errors: against ONNX Runtime float32 on the same inputs, "
          "the worst output's")
    if "tvm_fusion_bf16" in result.samples_ms:
        print(f"tvm_fusion_bf16: {len(result.bf16_kernels)} kernels sum bf16 products (AMX-BF16 or AVX512_BF16; "
              "float32 sums), the rest compute in float32; tvm_fusion: all float32")
    if result.peer_precision:
        pinned = dict(OPENVINO_ROWS)
        print("inference precision: " + ", ".join(
            f"{name} {chosen} ({'pinned' if pinned.get(name) else 'its default'})"
            for name, chosen in result.peer_precision.items()))
    warning = result.noise_warning()
    if warning:
        print(f"note: {warning}", file=sys.stderr)
    peak = result.peak
    print(f"this machine ({peak.target_key}): {peak.gflops:.0f} GFLOP/s FMA peak, {peak.gbytes_per_s:.1f} GB/s "
          f"triad, {peak.l2_gbytes_per_s:.0f} GB/s L2{peak.dot_product_roofs()} (probed {peak.probed_at})")


def print_tune(result) -> None:
    _notes(result.notes)
    rows = [[t.name, t.weight, t.trials_before, t.trials_run, t.hand_us if t.hand_us is not None else "-",
             t.best_us if t.best_us is not None else "-",
             t.hand_us / t.best_us if t.hand_us and t.best_us else "-"] for t in result.tasks]
    print(table(["kernel", "calls", "trials before", "trials now", "hand us", "best us", "speed-up"], rows,
                "lrrrrrr"))
    if result.excluded:
        print("excluded (hand schedules): " + ", ".join(f"{k} ({p})" for k, p in sorted(result.excluded.items())))
    print(f"{result.trials_run} trials in {result.wall_s:.0f} s ({result.trials_before + result.trials_run}"
          f" of {result.budget} in the log); stopped: {result.stopped_by}")
    print(f"tuning log: {result.store}")


def print_log_show(rows, notes) -> None:
    """``tuning-log show``: one row per kernel and store."""
    _notes(notes)
    print(table(["store", "kernel", "models", "trials", "failed", "best us", "hand us", "status"],
                [[Path(r.store).name, r.kernel, ",".join(r.models), r.trials, r.failed,
                  r.best_us if r.best_us is not None else "-", r.hand_us if r.hand_us is not None else "-",
                  r.status] for r in rows], "lllrrrrl"))


def print_log_merge(report) -> None:
    _notes(report.problems)
    print(table(["store", "records kept"], [[k, v] for k, v in report.written.items()]))
    print(f"{report.read} good records read")


def print_log_prune(reports) -> None:
    for report in reports:
        dropped = ", ".join(f"{n} {why}" for why, n in report.dropped.items()) or "nothing"
        print(f"{report.directory}: kept {report.kept}, dropped {dropped}")


def print_log_diff(rows) -> None:
    print(table(["kernel", "A best us", "B best us", "A/B", "A trials", "B trials"],
                [[r.kernel, r.best_a_us if r.best_a_us is not None else "-",
                  r.best_b_us if r.best_b_us is not None else "-",
                  r.speedup if r.speedup is not None else "-", r.trials_a, r.trials_b] for r in rows],
                "lrrrrr"))


def print_profile(result, top: int) -> None:
    """The ``top`` kernels by time, the end-to-end gap, and the mined chains if asked for."""
    peak = result.peak
    if result.artifact:
        print(f"artifact: {result.artifact} (its library timed end to end and per kernel)")
    print(f"model: {result.model}, {result.threads} threads; this machine ({peak.target_key}): "
          f"{peak.gflops:.0f} GFLOP/s FMA peak, {peak.gbytes_per_s:.1f} GB/s triad, ridge {peak.ridge:.1f} FLOP/B, "
          f"{peak.l2_gbytes_per_s:.0f} GB/s L2{peak.dot_product_roofs()}")
    rows = [[cut_middle(k.name, 48), k.pattern, k.rule, k.calls, k.us_per_call, k.us_in_model, f"{100 * k.share:.1f}",
             k.flops / 1e6, k.bytes / 1e6, k.gflops, k.gbytes_per_s,
             f"{k.bound} {k.roof_percent:.0f}%{' !' if k.far_off_roof else ''}",
             ", ".join(k.onnx_nodes[-2:]) + (f" (+{len(k.onnx_nodes) - 2})" if len(k.onnx_nodes) > 2 else "")]
            for k in result.kernels[:top]]
    print(table(["kernel", "pattern", "rule", "calls", "us/call", "us in model", "%", "MFLOP", "MB",
                 "GFLOP/s", "GB/s", "bound, % of roof", "ONNX nodes (last 2)"], rows, align="lllrrrrrrrrll"))
    if len(result.kernels) > top:
        print(f"... {len(result.kernels) - top} more kernels (--top, --json)")
    int8_roofs = sorted({k.compute_roof for k in result.kernels[:top] if k.roof_kind == "int8"})
    if int8_roofs:
        print(f"{' and '.join(int8_roofs)} kernels (int8 sums): MFLOP and GFLOP/s count integer operations, "
              "a multiply and an add per uint8 x int8 product")
    far = result.far_off_roof_line()
    if far:
        print(far)
    if result.end_to_end is not None:
        print(f"end to end: {result.end_to_end.line()}")
    print(result.gap.line())
    if result.chains is not None:
        print("\nunfused chains of adjacent kernels (candidates for the next pattern):")
        print(table(["chain", "us", "DRAM bytes saved", "est. gain us", "kernels"],
                    [[c.label, c.us, c.saved_bytes, c.gain_us, " -> ".join(cut_middle(n, 40) for n in c.kernels)]
                     for c in result.chains], align="lrrrl") if result.chains else "none")


def print_ablate(result) -> None:
    full = result.full.median_ms
    print(table(["variant", "kernels", "median ms", "vs all patterns"],
                [[v.name, v.kernels, v.median_ms, "-" if v is result.full else f"{v.worth(full):+.0f} %"]
                 for v in result.variants], align="lrrr"))
    print("\n".join(result.lines()))
    if result.not_fired:
        print(f"did not fire on this model: {', '.join(result.not_fired)}")


def print_configs(configs) -> None:
    """``configs``: the shipped configs, by the name ``--config`` takes, and where their files are."""
    def cut(text: str, width: int = 64) -> str:
        return text if len(text) <= width else text[:width - 3].rstrip() + "..."

    print(table(["name", "target", "for"], [[c.name, c.target, cut(c.summary)] for c in configs]))
    if configs:
        print(f"files: {configs[0].path.parent}/NAME.toml (copy one to edit it, then pass its path)")
