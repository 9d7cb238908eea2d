#!/usr/bin/env python3
"""Run a GPU-check pack (scripts/gpu_pack/pack.py wrote it; run.sh starts this file).

Needs Python 3.10+ and numpy, nothing else: no TVM, no tvm_fusion. Each artifact runs in the
pack's runner (bin/runner, the TVM runtime alone) on the pack's device, its outputs are compared
with ONNX Runtime's float32 references at the config's tolerance, and it is timed (TVM's timer:
CUDA events on a GPU; warm-up, then the median of the runs). Where torch is installed, the same
models run as torch modules with the same weights, eager and under torch.compile, timed the
same way. Everything goes into one JSON file, rewritten after each step, so a run cut short
still leaves what it measured. A failing model, or a failing torch.compile, is recorded and
the run goes on. Exit status: 0 when every artifact matched its reference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

RESERVE_S = 15  # left at the end for writing the results
TORCH_FLOAT16_TOL = 2e-2  # rtol and atol for torch modules whose weights were stored as float16


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _tail(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _load_input(pack: Path, spec: dict) -> np.ndarray:
    return np.fromfile(pack / spec["file"], dtype=spec["dtype"]).reshape(spec["shape"])


def compare(actual: np.ndarray, reference: np.ndarray, rtol: float, atol: float) -> dict:
    """tvm_fusion's verification rule: every element within atol + rtol * |reference|."""
    if actual.shape != reference.shape:
        return {"ok": False, "max_abs_err": None, "max_rel_err": None,
                "note": f"shape {list(actual.shape)} != {list(reference.shape)}"}
    a, e = actual.astype(np.float64), reference.astype(np.float64)
    both = np.isfinite(a) & np.isfinite(e)
    finite = bool(np.array_equal(a[~both], e[~both], equal_nan=True))
    diff, e = np.abs(a[both] - e[both]), e[both]
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / np.maximum(np.abs(e), 1e-12)).max()) if diff.size else 0.0
    outside = int((diff > atol + rtol * np.abs(e)).sum())
    note = "" if finite else "non-finite values differ"
    if outside:
        note = f"{outside} of {diff.size} elements outside atol + rtol * |reference|"
    return {"ok": finite and not outside, "max_abs_err": max_abs, "max_rel_err": max_rel, "note": note}


def compare_all(outputs: list[np.ndarray], model: dict, pack: Path, rtol: float | None = None,
                atol: float | None = None) -> dict:
    rtol = model["rtol"] if rtol is None else rtol
    atol = model["atol"] if atol is None else atol
    checks = []
    for index, spec in enumerate(model["outputs"]):
        reference = np.load(pack / spec["reference"], allow_pickle=False)
        if index >= len(outputs):
            checks.append({"name": spec["name"], "ok": False, "note": "missing"})
            continue
        checks.append({"name": spec["name"], **compare(outputs[index], reference, rtol, atol)})
    errors = [c["max_abs_err"] for c in checks if c.get("max_abs_err") is not None]
    return {"ok": bool(checks) and all(c["ok"] for c in checks),
            "max_abs_err": max(errors) if len(errors) == len(checks) else None, "outputs": checks}


def timing(times_ms: list[float]) -> dict:
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms),
            "runs": len(times_ms)}


# --- the machine -----------------------------------------------------------------------------------

def machine(device: str) -> dict:
    info = {"hostname": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": os.cpu_count()}
    if device == "cuda":
        query = "name,driver_version,compute_cap,memory.total"
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30)
            fields = [f.strip() for f in done.stdout.splitlines()[0].split(",")]
            info.update(gpu=fields[0], driver=fields[1], compute_capability=fields[2], gpu_memory=fields[3])
        except (OSError, IndexError, subprocess.SubprocessError) as err:
            info["gpu_error"] = f"nvidia-smi: {err}"
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --- the runner ------------------------------------------------------------------------------------

def runner_env(pack: Path) -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(pack / "lib"), env.get("LD_LIBRARY_PATH")]))
    return env


def usable_runner(pack: Path, scratch: Path, log: dict) -> Path:
    """The shipped runner, or, when it cannot start here (an older C library, say), one built
    from the shipped source with this machine's g++."""
    shipped = pack / "bin" / "runner"
    probe = subprocess.run([str(shipped)], capture_output=True, text=True, env=runner_env(pack), timeout=60)
    if probe.returncode == 2 and "usage" in probe.stderr:
        log["runner"] = "shipped"
        return shipped
    log["runner_shipped_error"] = _tail(probe.stderr.strip())
    rebuilt = scratch / "runner"
    command = ["g++", "-O2", "-std=c++17", "-I", str(pack / "src" / "include"), str(pack / "src" / "runner.cc"),
               "-o", str(rebuilt), "-L", str(pack / "lib"), "-Wl,--no-as-needed", "-ltvm_runtime", "-ltvm_ffi",
               "-Wl,--as-needed", "-ldl", f"-Wl,-rpath,{pack / 'lib'}"]
    built = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if built.returncode != 0:
        raise RuntimeError(f"the shipped runner does not start ({log['runner_shipped_error']}) and "
                           f"rebuilding it failed: {_tail(built.stderr)}")
    log["runner"] = "rebuilt here with g++"
    return rebuilt


def run_artifact(runner: Path, pack: Path, model: dict, device: str, settings: dict, scratch: Path,
                 timeout: float) -> dict:
    out = scratch / model["name"]
    out.mkdir(parents=True, exist_ok=True)
    inputs = [f"{s['dtype']}:{'x'.join(map(str, s['shape']))}:{pack / s['file']}" for s in model["inputs"]]
    command = [str(runner), str(pack / model["artifact"]), device, str(out),
               str(settings["warmup"]), str(settings["repeat"]), *inputs]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=runner_env(pack), timeout=timeout)
    result: dict = {"wall_s": round(time.perf_counter() - started, 2)}
    if done.returncode != 0:
        return {**result, "status": "error", "error": _tail(done.stderr.strip() or f"exit {done.returncode}")}
    outputs, times = [], []
    for line in done.stdout.splitlines():
        words = line.split()
        if words[:1] == ["output"]:
            shape = [int(d) for d in words[3].split("x") if d]
            outputs.append(np.fromfile(out / f"output{words[1]}.bin", dtype=words[2]).reshape(shape))
        elif words[:1] == ["times_ms"]:
            times = [float(t) for t in words[1:]]
    check = compare_all(outputs, model, pack)
    result.update(status="pass" if check["ok"] else "mismatch", **check)
    if times:
        result.update(timing(times), timer="CUDA events (TVM runtime timer)" if device == "cuda"
                      else "steady clock (TVM runtime timer)")
    return result


# --- torch -----------------------------------------------------------------------------------------

def run_torch(pack: Path, model: dict, device: str, settings: dict, scratch: Path, timeout: float,
              compile_model: bool) -> dict:
    """The torch baselines in a child process (a crash or hang there costs only this entry)."""
    result_file = scratch / f"{model['name']}.torch.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--pack", str(pack), "--torch-child", model["name"],
               "--child-result", str(result_file)] + ([] if compile_model else ["--no-compile"])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        failure = None if done.returncode == 0 else _tail(done.stderr.strip() or f"exit {done.returncode}")
    except subprocess.TimeoutExpired:
        failure = f"timed out after {timeout:.0f} s"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if failure is not None:
        result.setdefault("error", failure)
        for mode in ("eager", "compile"):
            result.setdefault(mode, {"status": "not run", "error": failure})
    return result


def torch_child(pack: Path, name: str, result_file: Path, compile_model: bool) -> int:
    """Child mode: eager, then torch.compile, each written to ``result_file`` as it finishes."""
    manifest = json.loads((pack / "manifest.json").read_text())
    model = next(m for m in manifest["models"] if m["name"] == name)
    settings, device = manifest["settings"], manifest["pack"]["device"]
    result: dict = {}

    def save():
        result_file.write_text(json.dumps(result, indent=1))

    import torch  # the GPU machine's torch; an optional baseline, so imported only in this child
    sys.path.insert(0, str(pack))
    import torch_models  # shipped beside this file; imports torch

    result.update(torch=torch.__version__, cuda=torch.version.cuda, tf32=False,
                  device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
    # float32 as TVM computes it: no TF32 in matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    weights = dict(np.load(pack / model["torch"]["weights"], allow_pickle=False))
    # Weights stored as float16 (to keep the pack small) are float32 in the module but rounded, so
    # its outputs are held to a looser tolerance: enough to catch a port that computes otherwise.
    exact = model["torch"].get("weights_dtype", "float32") == "float32"
    rtol, atol = (None, None) if exact else (TORCH_FLOAT16_TOL, TORCH_FLOAT16_TOL)
    result["weights_dtype"] = model["torch"].get("weights_dtype", "float32")
    module = torch_models.build(name, weights).float().to(dev)
    args = [torch.from_numpy(_load_input(pack, spec)).to(dev) for spec in model["inputs"]]

    def measure(fn) -> dict:
        with torch.inference_mode():
            started = time.perf_counter()
            output = fn(*args)
            if device == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - started
            for _ in range(settings["warmup"]):
                fn(*args)
            times = []
            for _ in range(settings["repeat"]):
                if device == "cuda":
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn(*args)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    started = time.perf_counter()
                    fn(*args)
                    times.append((time.perf_counter() - started) * 1e3)
        outputs = output if isinstance(output, (tuple, list)) else [output]
        check = compare_all([o.detach().float().cpu().numpy() for o in outputs], model, pack, rtol, atol)
        return {"status": "pass" if check["ok"] else "mismatch", "first_call_s": round(first_s, 3),
                **check, **timing(times), "timer": "CUDA events" if device == "cuda" else "perf_counter"}

    for mode in ("eager", "compile"):
        if mode == "compile" and not compile_model:
            result[mode] = {"status": "skipped", "error": "--no-compile"}
            save()
            continue
        try:
            result[mode] = measure(module if mode == "eager" else torch.compile(module))
        except Exception as err:  # torch.compile can fail in many ways; record it and go on
            result[mode] = {"status": "error", "error": _tail(f"{type(err).__name__}: {err}\n"
                                                              + traceback.format_exc())}
        save()
    return 0


# --- the run ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else PACK/results)")
    parser.add_argument("--budget-s", type=float, default=450, help="stop starting new steps after this")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--only", action="append", help="run only this model (repeatable)")
    parser.add_argument("--torch-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pack = args.pack.resolve()
    if args.torch_child:
        return torch_child(pack, args.torch_child, args.child_result, not args.no_compile)

    deadline = time.monotonic() + args.budget_s
    manifest = json.loads((pack / "manifest.json").read_text())
    device, settings = manifest["pack"]["device"], manifest["settings"]
    out = (args.out or Path(os.environ.get("OUT") or pack / "results")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results: dict = {"started": _now(), "pack": manifest["pack"], "settings": settings,
                     "machine": machine(device), "models": {}}

    def save():
        results["updated"] = _now()
        staging = results_path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(results, indent=1) + "\n")
        os.replace(staging, results_path)

    models = [m for m in manifest["models"] if not args.only or m["name"] in args.only]
    with tempfile.TemporaryDirectory(prefix="gpu_pack.") as scratch_name:
        scratch = Path(scratch_name)
        try:
            runner = usable_runner(pack, scratch, results["machine"])
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            runner, results["error"] = None, f"no runner: {err}"
        save()
        # Every artifact first: the correctness results must not wait behind torch.compile.
        for model in models:
            entry = results["models"].setdefault(model["name"], {"inputs": {s["name"]: s["shape"] for s in
                                                                            model["inputs"]}})
            left = deadline - time.monotonic() - RESERVE_S
            if runner is None or left < 5:
                entry["tvm_fusion"] = {"status": "not run", "error": results.get("error", "out of time")}
            else:
                try:
                    entry["tvm_fusion"] = run_artifact(runner, pack, model, device, settings, scratch,
                                                       min(left, 120))
                except Exception as err:  # one model's failure must not stop the others
                    entry["tvm_fusion"] = {"status": "error", "error": f"{type(err).__name__}: {err}"}
            print(f"{model['name']}: tvm_fusion {_summary(entry['tvm_fusion'])}", flush=True)
            save()
        torch_here = importable("torch") if not args.no_torch else False
        for model in models:
            entry = results["models"][model["name"]]
            left = deadline - time.monotonic() - RESERVE_S
            if not model.get("torch"):
                entry["torch"] = {"status": "not available as a torch module"}
            elif not torch_here:
                entry["torch"] = {"status": "skipped", "error": "--no-torch" if args.no_torch
                                  else "torch is not installed"}
            elif left < 10:
                entry["torch"] = {"status": "not run", "error": "out of time"}
            else:
                entry["torch"] = run_torch(pack, model, device, settings, scratch, min(left, 240),
                                           not args.no_compile)
                print(f"{model['name']}: torch eager {_summary(entry['torch'].get('eager', {}))}, "
                      f"torch.compile {_summary(entry['torch'].get('compile', {}))}", flush=True)
            save()
    passed = sum(1 for e in results["models"].values() if e.get("tvm_fusion", {}).get("status") == "pass")
    results["summary"] = {"artifacts": len(models), "passed": passed, "all_passed": passed == len(models)}
    results["finished"] = _now()
    save()
    print(f"{passed} of {len(models)} artifacts match their references; results: {results_path}")
    return 0 if passed == len(models) else 1


def importable(name: str) -> bool:
    done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, timeout=120)
    return done.returncode == 0


def _summary(entry: dict) -> str:
    status = entry.get("status", "?")
    if "median_ms" in entry:
        err = entry.get("max_abs_err")
        return f"{status}, median {entry['median_ms']:.3f} ms" + (f", max abs err {err:.2e}" if err is not None else "")
    lines = [line for line in entry.get("error", "").splitlines() if line.strip()]
    return status + (f" ({lines[-1][:200]})" if lines else "")


if __name__ == "__main__":
    sys.exit(main())
