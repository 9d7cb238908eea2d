"""``profile --plot``: the roofline (one dot per kernel, sized by time) and the top kernels by time.

The top kernels' dots carry only their rank (a short number beside the dot); the names are on
the bar chart, rank first, so no long label sits in the dots' cloud.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...render.plotting import check_drawing_path, save_figure

FORMATS = (".svg", ".png")
LABELLED = 5
BARS = 10
ROOF_COLORS = {"bf16": "tab:purple", "int8": "tab:green"}  # the dashed roofs of bf16 and int8 kernels


def check_plot_path(path: str | Path) -> Path:
    """The plot's path if its format is one we draw; raises ArtifactError otherwise (before the profile runs)."""
    return check_drawing_path(path, FORMATS, "the plot", "--plot")


def _short(kernel) -> str:
    """A readable label: the pattern variant (or op kind) and where its last ONNX node sits
    (the node name's first scope and its last one, e.g. features.2/block.1.2)."""
    what = kernel.pattern if kernel.pattern not in ("tvm FuseOps", "single op") else kernel.kind
    if not kernel.onnx_nodes:
        return f"{what} ({kernel.name[:24]})"
    parts = [p for p in kernel.onnx_nodes[-1].split("/") if p]
    where = f"{parts[1]}/{parts[-2]}" if len(parts) >= 4 else "/".join(parts)
    return f"{what} @ {where}"


def plot_profile(report, path: str | Path) -> Path:
    # deferred: matplotlib takes ~0.3 s to import, which every `import tvm_fusion` (and so
    # `tvm-fusion --help`) would pay; only --plot needs it.
    from matplotlib.figure import Figure

    path = check_plot_path(path)
    peak = report.peak
    kernels = [k for k in report.kernels if k.flops and k.us_per_call > 0]
    fig = Figure(figsize=(15, 6.2))
    roof, bars = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.25, 1]})
    # The roofs bf16 and int8 kernels are set against (profile's roof_position); int8's in
    # integer operations, which their dots count too. The x axis reaches past each roof's ridge.
    other_roofs = sorted({(k.roof_kind, k.compute_roof, k.compute_roof_gflops) for k in kernels
                          if k.compute_roof != "FMA"})
    ridges = [peak.ridge * 10] + [2 * gflops / peak.gbytes_per_s for *_, gflops in other_roofs]
    # Roofline.
    lo = min([k.intensity for k in kernels] + [peak.ridge / 10]) / 2
    hi = max([k.intensity for k in kernels] + ridges) * 2
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    roof.plot(x, np.minimum(peak.gflops, x * peak.gbytes_per_s), color="black", lw=1.5,
              label=f"roof: {peak.gflops:.0f} GFLOP/s FMA, {peak.gbytes_per_s:.1f} GB/s triad")
    for kind, name, gflops in other_roofs:
        roof.plot(x, np.minimum(gflops, x * peak.gbytes_per_s), color=ROOF_COLORS[kind], lw=1.5, ls="--",
                  label=f"{kind} kernels' roof: {gflops:.0f} {'GOP/s' if kind == 'int8' else 'GFLOP/s'} {name}")
    total = max(k.total_us for k in kernels) if kernels else 1.0
    sizes = [30 + 400 * k.total_us / total for k in kernels]
    colors = ["tab:orange" if k.bound.endswith("memory") else "tab:blue" for k in kernels]
    roof.scatter([k.intensity for k in kernels], [k.gflops for k in kernels], s=sizes, c=colors, alpha=0.6,
                 edgecolors="black", linewidths=0.5)
    roof.set_xscale("log")
    roof.set_yscale("log")
    roof.set_xlim(lo, hi)
    ymin = min([k.gflops for k in kernels] + [peak.gflops / 100]) / 2
    roof.set_ylim(ymin, max([peak.gflops, *(gflops for *_, gflops in other_roofs)]) * 3)
    int8 = "; int8 kernels: integer ops" if any(k.roof_kind == "int8" for k in kernels) else ""
    roof.set_xlabel(f"arithmetic intensity (FLOP / byte, parameters moved once{int8})")
    roof.set_ylabel(f"achieved GFLOP/s (kernel alone{int8})")
    roof.set_title(f"{report.model}: roofline ({report.threads} threads, {peak.target_key})", fontsize=11)
    roof.grid(True, which="major", alpha=0.3)
    top = sorted(kernels, key=lambda k: -k.total_us)[:LABELLED]
    for rank, kernel in enumerate(top, 1):
        roof.annotate(str(rank), (kernel.intensity, kernel.gflops), xytext=(7, -3 - 4 * (rank % 2)),
                      textcoords="offset points", fontsize=10, fontweight="bold")
    roof.scatter([], [], c="tab:orange", label="memory-bound")
    roof.scatter([], [], c="tab:blue", label="compute-bound")
    roof.legend(loc="upper left", fontsize=9)
    # Top kernels by time.
    ranked = sorted(report.kernels, key=lambda k: -k.total_us)[:BARS][::-1]
    bars.barh(range(len(ranked)), [k.total_us for k in ranked],
              color=["tab:orange" if k.bound.endswith("memory") else "tab:blue" for k in ranked])
    bars.set_yticks(range(len(ranked)))
    ranks = {id(k): rank for rank, k in enumerate(top, 1)}
    bars.set_yticklabels([(f"{ranks[id(k)]}. " if id(k) in ranks else "") + _short(k)
                          + (f" x{k.calls}" if k.calls > 1 else "") for k in ranked], fontsize=8.5)
    for index, kernel in enumerate(ranked):
        bars.text(kernel.total_us, index, f" {100 * kernel.share:.0f}%", va="center", fontsize=8.5)
    bars.set_xlim(0, max(k.total_us for k in ranked) * 1.15 if ranked else 1)
    bars.set_xlabel("us per model run (kernel alone x calls)")
    gap = report.gap
    bars.set_title(f"top kernels; end to end {gap.end_to_end_ms:.2f} ms, kernels {gap.kernels_alone_ms:.2f} ms",
                   fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path, "the plot", "--plot")
