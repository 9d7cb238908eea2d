"""Tuned tvm_fusion vs untuned tvm_fusion vs ONNX Runtime vs stock TVM tuned with the same budget.

Per model, in one process, at the config's thread count (2 on the bundled host config):

* tvm_fusion tuned: ``tune_model`` into ``--tuning-log`` (default: the committed tuning_logs/;
  budgets count what is already there, so committed logs are reused and only topped up);
* tvm_fusion untuned: the same pipeline with the hand schedules only;
* stock TVM tuned: TVM's own FuseOps kernels (no tvm_fusion patterns or schedules), tuned by
  ``ms.relax_integration.tune_relax`` with the same trial budget, per-kernel cap, batch size,
  builder (in-process), runner and XGBoost cost model, then built by ``compile_relax``;
* ONNX Runtime.

Runtimes are timed interleaved round by round (medians). Tuning results are cached under
``--work-dir`` (stock) and the tuning log (ours); delete them to re-tune. Writes a table to
stdout and benchmarks/results/tuning.json (atomically).

    .venv/bin/python benchmarks/bench_tuning.py [--trials 200] [--repeat 30] [--models bert_tiny gpt2_tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from tvm_fusion import api
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.native_log import captured_native_stderr
from tvm_fusion.report import table, write_json
from tvm_fusion.runtime import CompiledModel, set_threads
from tvm_fusion.commands.tune import tune_model
from tvm_fusion.verify import onnxruntime_session

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"bert_tiny": ["input_ids:1x128", "attention_mask:1x128"], "gpt2_tiny": ["input_ids:1x128"]}
# CNN examples a colleague may add: benchmarked when present, at their own input shape.
OPTIONAL_MODELS = {"resnet_tiny": ["input:1x3x224x224"], "mobilenetv3_tiny": ["input:1x3x224x224"]}


def tune_stock(prepared, trials: int, per_task: int, per_iter: int, work_dir: Path) -> dict:
    """MetaSchedule on TVM's stock-fused kernels; cached in ``work_dir`` (summary.json)."""
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from tvm_fusion.tuning.builder import InProcessBuilder

    summary_path = work_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if summary["trials_budget"] == trials:
            return summary
    work_dir.mkdir(parents=True, exist_ok=True)
    cfg = prepared.config
    set_threads(cfg.threads)
    started = time.monotonic()
    fused = relax.get_pipeline("zero")(prepared.relax_module)
    database = ms.relax_integration.tune_relax(
        fused, params={}, target=cfg.tvm_target(), work_dir=str(work_dir), max_trials_global=trials,
        max_trials_per_task=per_task, num_trials_per_iter=per_iter, builder=InProcessBuilder(),
        runner=ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(
            number=3, repeat=1, min_repeat_ms=100, enable_cpu_cache_flush=False)),
        cost_model=ms.cost_model.XGBModel(num_tuning_cores=cfg.threads), seed=0)
    summary = {"trials_budget": trials, "trials_run": len(database.get_all_tuning_records()),
               "tasks": len(ms.relax_integration.extract_tasks(fused, cfg.tvm_target())),
               "wall_s": time.monotonic() - started}
    staging = summary_path.with_name(".summary.json.tmp")
    staging.write_text(json.dumps(summary))
    os.replace(staging, summary_path)
    return summary


def build_stock_tuned(prepared, work_dir: Path):
    from tvm.s_tir import meta_schedule as ms

    database = ms.database.JSONDatabase(work_dir=str(work_dir))
    return ms.relax_integration.compile_relax(database, prepared.relax_module, prepared.config.tvm_target(), None)


def time_interleaved(runners: dict, repeat: int, warmup: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(warmup + repeat):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) * 1e3 for name, values in times.items()}


def bench(name: str, shapes: list[str], args) -> dict:
    model = ROOT / "examples" / "models" / f"{name}.onnx"
    say = lambda message: print(f"[{name}] {message}", flush=True)  # noqa: E731
    ours = tune_model(model, args.config, shapes, trials=args.trials, per_task_trials=args.per_task_trials,
                      trials_per_iter=args.trials_per_iter, log_dir=args.tuning_log, say=say)
    say(f"tvm_fusion tuning: {ours.trials_run} new trials ({ours.trials_before} already logged) "
        f"in {ours.wall_s:.0f} s")
    prepared = api.prepare(model, args.config, shapes)
    cfg = prepared.config
    stock = tune_stock(prepared, args.trials, args.per_task_trials, args.trials_per_iter,
                       Path(args.work_dir) / name / "stock")
    say(f"stock tuning: {stock['trials_run']} trials over {stock['tasks']} kernels in {stock['wall_s']:.0f} s")

    set_threads(cfg.threads)
    meta = {"inputs": [s.to_json() for s in prepared.inputs], "outputs": [{"name": n} for n in prepared.output_names],
            "threads": cfg.threads}
    with captured_native_stderr([]):
        untuned = api.optimize(prepared, tuning_log=False)
        tuned = api.optimize(prepared, tuning_log=args.tuning_log)
        models = {"tvm_fusion untuned": CompiledModel(api.build(untuned.module, cfg), meta),
                  "tvm_fusion tuned": CompiledModel(api.build(tuned.module, cfg), meta),
                  "stock TVM tuned": CompiledModel(build_stock_tuned(prepared, Path(args.work_dir) / name / "stock"),
                                                   meta)}
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, prepared.inputs, cfg.seed)
    session = onnxruntime_session(prepared.onnx_model, cfg.threads)
    output_names = [o.name for o in session.get_outputs()]
    reference = dict(zip(output_names, session.run(output_names, inputs)))
    runners = {"onnxruntime": lambda: session.run(output_names, inputs)}
    errors = {}
    for label, compiled in models.items():
        produced = compiled.run(inputs)
        errors[label] = max(float(np.abs(produced[k] - reference[k]).max()) for k in reference)
        runners[label] = (lambda m, t: lambda: m.run_prepared(t))(compiled, compiled.prepare(inputs))
    say(f"timing {args.repeat} interleaved rounds at {cfg.threads} threads")
    medians = time_interleaved(runners, args.repeat, args.warmup)
    return {"threads": cfg.threads, "medians_ms": medians, "max_abs_error": errors,
            "tvm_fusion_tuning": {"trials_budget": args.trials, "trials_in_log": ours.trials_before + ours.trials_run,
                                  "trials_this_run": ours.trials_run, "wall_s_this_run": ours.wall_s,
                                  "kernels_tuned": sorted(tuned.tuned), "kernels_excluded": sorted(ours.excluded),
                                  "kernels_hand": sorted(k for k, rule in tuned.schedule_rules.items() if rule != "tuned")},
            "stock_tuning": stock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help="default: bert_tiny gpt2_tiny (+ CNNs present)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "x86_64-host.toml"))
    parser.add_argument("--trials", type=int, default=200, help="budget per model, for both tuners")
    parser.add_argument("--per-task-trials", type=int, default=64)
    parser.add_argument("--trials-per-iter", type=int, default=16)
    parser.add_argument("--tuning-log", default=str(ROOT / "tuning_logs"))
    parser.add_argument("--work-dir", default=str(ROOT / "build" / "bench_tuning"))
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tuning.json"))
    args = parser.parse_args()
    available = {**MODELS, **{k: v for k, v in OPTIONAL_MODELS.items()
                              if (ROOT / "examples" / "models" / f"{k}.onnx").exists()}}
    names = args.models or list(available)

    results, rows = {}, []
    for name in names:
        result = results[name] = bench(name, available[name], args)
        m, tuning = result["medians_ms"], result["tvm_fusion_tuning"]
        rows.append([name, result["threads"], m["onnxruntime"], m["stock TVM tuned"], m["tvm_fusion untuned"],
                     m["tvm_fusion tuned"], m["tvm_fusion untuned"] / m["tvm_fusion tuned"],
                     m["stock TVM tuned"] / m["tvm_fusion tuned"], m["tvm_fusion tuned"] / m["onnxruntime"],
                     tuning["trials_in_log"], result["stock_tuning"]["trials_run"]])
    print(table(["model", "threads", "ORT ms", "stock tuned ms", "ours untuned ms", "ours tuned ms",
                 "tuning gain", "vs stock tuned", "ours tuned/ORT", "our trials", "stock trials"], rows))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
