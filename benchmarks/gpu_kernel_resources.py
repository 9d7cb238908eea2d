"""Compile-only figures of the GPU rules' kernels against dlight's defaults, no GPU needed.

For each kernel of the bundled transformers (configs/cuda-sm90.toml, sequence 128) that a rule of
``tvm_fusion/schedules/gpu/`` takes, build it twice for sm_90: with that rule, and with the dlight
rule that scheduled it before (the first of dlight's GPU rules that answers). Record what ptxas
reports (registers a thread, shared memory a thread block, stack frame and spill bytes), the
thread block, the number of kernel launches and how many blocks read each input from global
memory. Writes benchmarks/results/gpu_kernels.json.

    .venv/bin/python benchmarks/gpu_kernel_resources.py
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from pathlib import Path

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport
from tvm_fusion.schedules.gpu import WarpNorm, WarpSoftmax
from tvm_fusion.targets.kernel_resources import kernel_resources

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "gpu_kernels.json"
MODELS = ("bert_tiny", "gpt2_tiny")
OURS = (WarpNorm(), WarpSoftmax())
DLIGHT = (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())


def first_answer(rules, func, target):
    for rule in rules:
        sch = rule.apply(func, target, False)
        if sch is not None:
            return type(rule).__name__, sch.mod["main"]
    return None, None


def figures(func: tirx.PrimFunc, target) -> dict:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main").with_attr("tirx.is_scheduled", True)})
    source = tvm.compile(mod, target=target).mod.imports[0].inspect_source()
    usage = kernel_resources(source, target.attrs["arch"])
    threads = sorted({int(n) for n in re.findall(r"__launch_bounds__\((\d+)\)", source)})
    return {"launches": len(usage), "threads_per_block": threads,
            "registers": max(u.registers for u in usage.values()),
            "shared_bytes": max(u.shared_bytes for u in usage.values()),
            "stack_bytes": max(u.stack_bytes for u in usage.values()),
            "spill_bytes": max(u.spill_store_bytes + u.spill_load_bytes for u in usage.values()),
            "input_reads": input_reads(func)}


def input_reads(func: tirx.PrimFunc) -> int:
    """The most blocks that read one input buffer: 1 when every input is read once."""
    sch = s_tir.Schedule(func)
    written, readers = set(), {}
    pending = [sch.get_sblock("root")]
    while pending:
        for block in sch.get_child_blocks(pending.pop()):
            pending.append(block)
            written.update(w.source.name for w in sch.get(block).writes)
            for region in sch.get(block).reads:
                readers[region.source.name] = readers.get(region.source.name, 0) + 1
    return max(count for name, count in readers.items() if name not in written)


def main() -> None:
    cfg = load_config(ROOT / "configs" / "cuda-sm90.toml")
    target = cfg.tvm_target()
    kernels = []
    for model in MODELS:
        prepared = api.prepare(ROOT / "examples" / "models" / f"{model}.onnx", cfg)
        lowered = fusion_pipeline(cfg, PatternReport(), phases=("canonicalize", "fuse", "lower"))(
            prepared.relax_module)
        for gvar, func in lowered.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            ours, ours_func = first_answer(OURS, func, target)
            if ours is None:
                continue
            default, default_func = first_answer(DLIGHT, func, target)
            kernels.append({"model": model, "kernel": gvar.name_hint,
                            "ours": {"rule": ours, **figures(ours_func, target)},
                            "dlight": {"rule": default, **figures(default_func, target)}})
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    RESULT.write_text(json.dumps({
        "machine": f"compile only, no GPU: ptxas for {target.attrs['arch']} ({nvcc})",
        "date": datetime.date.today().isoformat(),
        "config": "configs/cuda-sm90.toml", "kernels": kernels}, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)} ({len(kernels)} kernels)")


if __name__ == "__main__":
    main()
