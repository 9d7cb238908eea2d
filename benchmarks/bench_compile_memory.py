"""Peak memory and wall time of ``compile`` on one model, against the budget of 3x its weights + 1 GiB.

    python benchmarks/bench_compile_memory.py MODEL --input-shape NAME:DIMS [--source [LABEL=]DIR ...]
                                              [--out benchmarks/results/compile_memory.json]

The compile (verification against ONNX Runtime included) runs in a spawned worker of its own,
whose peak RSS is measured as the zoo report measures it: the larger of the worker's and of its
children's (the export's forked child). Weights are the model's initializer bytes, its external
data included. ``--source`` compiles with the tvm_fusion of another checkout (a worktree of an
earlier commit), once per directory, for a before/after in one results file; ``LABEL=DIR`` names
a row (default: ``git describe`` of the directory).

The large model of the recorded results is GPT-2 at its real width with 2 layers
(``scripts/export_gpt2_layers.py``, made on demand: it is not shipped).
"""

import argparse
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from isolated import run_in_worker  # noqa: E402  (scripts/isolated.py)


def weight_bytes(path: Path) -> int:
    """Initializer bytes from their types and dims (external data is not read)."""
    from tvm_fusion.frontend.initializers import tensor_bytes
    model = onnx.load(str(path), load_external_data=False)
    return sum(tensor_bytes(init) for init in model.graph.initializer)


def compile_once(source: str, path: str, shapes: list[str], queue) -> None:
    sys.path.insert(0, source)
    from tvm_fusion import api
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = api.compile_model(path, None, shapes, output_dir=out)
        seconds = time.perf_counter() - started
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    queue.put({"compile_s": round(seconds, 1), "peak_rss_mb": round(peak / 1024, 1),
               "verification": result.verification})


def commit_of(source: str) -> str:
    return subprocess.run(["git", "-C", source, "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False).stdout.strip() or "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--input-shape", action="append", default=[])
    parser.add_argument("--source", action="append",
                        help="a checkout to import tvm_fusion from, as DIR or LABEL=DIR (default: this one)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/compile_memory.json"))
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tvm_fusion.config import host_cpu_name
    from tvm_fusion.report import table, write_json

    path = Path(args.model).resolve()
    weights_mb = weight_bytes(path) / 2**20
    budget_mb = 3 * weights_mb + 1024
    rows = []
    for source in args.source or [str(ROOT)]:
        label, _, folder = source.rpartition("=")
        result, failure = run_in_worker(compile_once, (str(Path(folder).resolve()), str(path), args.input_shape),
                                        args.timeout)
        row = {"source": label or commit_of(folder), **(result or {"failure": failure})}
        if result:
            row["within_budget"] = result["peak_rss_mb"] <= budget_mb
        rows.append(row)
        print(f"{row['source']}: {row}", flush=True)
    data = {"machine": {"cpu": host_cpu_name(), "platform": platform.platform()}, "date": date.today().isoformat(),
            "model": path.name, "input_shapes": args.input_shape, "weights_mb": round(weights_mb, 1),
            "budget_mb": round(budget_mb, 1), "rows": rows}
    write_json(args.out, data)
    print(table(["source", "compile s", "peak RSS MB", "budget MB", "within"],
                [[r["source"], r.get("compile_s", "-"), r.get("peak_rss_mb", r.get("failure")), data["budget_mb"],
                  r.get("within_budget", "-")] for r in rows]))
    return 0 if all(r.get("within_budget") for r in rows[-1:]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
