"""The tuning driver: MetaSchedule + XGBoost over our fused kernels, into a tuning-log store.

* Budget: total trials, a cap per kernel and a time limit, all counted over the store, so a
  second run (after a kill, or with a larger budget) spends only what is left.
* Every kernel's hand schedule is measured first and stored as an ordinary record: the search
  starts from that known-good point (evolutionary search seeds its population with the
  store's best records), and compile can never pick a tuned schedule measured slower than it.
* Every measurement is appended to the store as soon as it is made (StoreDatabase), so a
  SIGINT or SIGKILL loses at most the batch being measured.

This module is the driver: what to tune, how much, and what the run did. How a candidate or
a hand schedule is measured is ``measure.py``'s; which kernel gets the next batch, and when to
stop, is ``scheduler.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

from tvm.s_tir import meta_schedule as ms

from ..tuning.intrinsics import import_tensor_intrinsics
from ..native_log import captured_native_stderr, summarize
from ..config import with_precision
from ..preparation import at_one_size, resolve_config
from ..runtime import set_threads
from ..session import ModelSession
from ..tuning.builder import InProcessBuilder
from ..tuning.measure import HandSchedules, ProgressCallback, RemeasureHand, RpcSettings, make_runner
from ..tuning.progress import TaskProgress, TuningProgress
from ..tuning.scheduler import BudgetScheduler, stop_on_sigint
from ..tuning.search_space import space_generator
from ..tuning.store import TuningStore
from ..tuning.store_contents import read_store, target_key, workload_id
from ..tuning.store_database import StoreDatabase
from ..tuning.tasks import kernel_tasks


@dataclasses.dataclass
class TaskSummary:
    name: str
    weight: int
    trials_before: int
    trials_run: int
    hand_us: float | None
    best_us: float | None


@dataclasses.dataclass
class TuneResult:
    store: Path
    target_key: str
    tasks: list[TaskSummary]
    excluded: dict[str, str]      # kernel -> the exclude pattern that matched it
    trials_before: int
    trials_run: int
    budget: int
    wall_s: float
    stopped_by: str
    notes: list[str]


def _task_loggers(log_dir: Path, names: list[str]) -> list[logging.Logger]:
    """MetaSchedule's per-task log files, without its console handler (we draw progress)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    root = "tvm.s_tir.meta_schedule"
    loggers = [f"{root}.logging.task_{i:03d}_{name[:100]}" for i, name in enumerate(names)]
    ms.logging.create_loggers(
        log_dir=str(log_dir),
        params=[{"log_dir": str(log_dir), "logger_name": name} for name in loggers],
        logger_config={"loggers": {root: {"level": "DEBUG", "handlers": [f"{root}.file"],
                                          "propagate": False}}})
    return [logging.getLogger(name) for name in loggers]


def _has_search_space(context: ms.TuneContext, name: str, notes: list[str]) -> bool:
    """MetaSchedule's default rules fail on some fused kernels (a ScheduleError while building
    the design space); such a kernel keeps its hand schedule instead of stopping the whole run."""
    try:
        return len(context.clone().generate_design_space()) > 0
    except RuntimeError as err:  # ScheduleError and TVMError both derive from it
        notes.append(f"{name}: MetaSchedule cannot build a search space ({str(err).splitlines()[0][:120]}); "
                     "it keeps its hand schedule")
        return False


def tune_model(model_path: str | Path, config=None, input_shapes=None, *, trials: int | None = None,
               per_task_trials: int | None = None, time_limit_s: float | None = None,
               trials_per_iter: int | None = None, log_dir: str | Path | None = None,
               rpc: RpcSettings | None = None, seed: int = 0, show_progress: bool = True,
               live: bool | None = None, say=lambda message: None, precision: str | None = None) -> TuneResult:
    """Tune the model's fused kernels for the config's target into ``<log_dir>/<target key>/``.

    Arguments left None come from the config's ``[tuning]`` section (``precision``: its
    ``[pipeline]``; a bf16 kernel is another workload than its float32 twin, so their records
    stay apart in one store). Budgets count trials
    already in the store: the result says how many were there and how many this run added.
    """
    started = time.monotonic()
    session = ModelSession(model_path, input_shapes, say)
    prepared = session.prepared(with_precision(resolve_config(config), precision))
    # MetaSchedule in TVM 0.27 tunes static loop nests only (its DisallowDynamicLoop postproc);
    # kernels of a model compiled for a range get the hand schedules.
    at_one_size(prepared, "tune")
    cfg = prepared.config
    settings = cfg.tuning
    trials = settings.trials if trials is None else trials
    per_task = settings.per_task_trials if per_task_trials is None else per_task_trials
    limit = settings.time_limit_s if time_limit_s is None else time_limit_s
    per_iter = settings.trials_per_iter if trials_per_iter is None else trials_per_iter
    target = cfg.tvm_target()
    key = target_key(target)
    store = TuningStore(Path(log_dir if log_dir is not None else settings.log_dir) / key)

    native: list[str] = []
    with captured_native_stderr(native):
        say("extracting kernels after the fuse and lower phases")
        all_tasks = kernel_tasks(session.tuning_module(cfg), target, settings.exclude)
        contents = read_store(store.directory)
        notes = [str(p) for p in contents.problems] + contents.foreign(key)
        done: dict[str, int] = {}
        for record in contents.usable(key):
            shash = workload_id(contents.workloads[record.workload_index].mod)
            done[shash] = done.get(shash, 0) + 1
        tasks = [t for t in all_tasks if t.excluded_by is None]
        before = {t.name: done.get(workload_id(t.mod), 0) for t in tasks}
        store.create()
        store.update_kernels({workload_id(t.mod): {"name": t.name, "models": [prepared.name],
                                                   "hand_rule": t.hand_rule} for t in all_tasks})
        remaining = trials - sum(before.values())
        open_tasks = [t for t in tasks if per_task - before[t.name] > 0]
        summary: dict[str, Any] = dict(store=store.directory, target_key=key,
                                       excluded={t.name: t.excluded_by for t in all_tasks if t.excluded_by},
                                       trials_before=sum(before.values()), budget=trials, notes=notes)
        if remaining <= 0 or not open_tasks:
            why = "the trial budget is already spent" if remaining <= 0 else "every kernel is at its cap"
            best = _best_us(contents, key)
            return TuneResult(tasks=[TaskSummary(t.name, t.weight, before[t.name], 0,
                                                 contents.kernels.get(workload_id(t.mod), {}).get("hand_us"),
                                                 best.get(workload_id(t.mod))) for t in tasks],
                              trials_run=0, wall_s=time.monotonic() - started, stopped_by=why, **summary)

        set_threads(cfg.threads)  # the runner measures at the thread count the model will run with
        database = StoreDatabase(store, contents, key)
        builder, runner = InProcessBuilder(), make_runner(rpc)
        spent = dict(before)
        unseeded = [t for t in open_tasks if before[t.name] == 0]
        # Fastest hand measurement per kernel (kernels.json keeps it across runs), updated as we go.
        hand_us = {t.name: contents.kernels.get(workload_id(t.mod), {}).get("hand_us") for t in open_tasks}
        hand = HandSchedules(open_tasks, target, builder, runner, database, hand_us)
        # closing: the hand runner's workers go however this ends; store_errors: a full disk under
        # the store is its path and the fix (exit 6), not MetaSchedule's RuntimeError.
        with contextlib.closing(hand), database.store_errors():
            if unseeded:
                say(f"measuring the hand schedules of {len(unseeded)} kernel(s)")
                for name in hand.measure([t.name for t in unseeded]):
                    spent[name] += 1
            remaining = trials - sum(spent.values())
            open_tasks = [t for t in open_tasks if per_task - spent[t.name] > 0]
            progress = TuningProgress(
                [TaskProgress(t.name, t.weight, per_task - spent[t.name], spent[t.name], hand_us.get(t.name))
                 for t in open_tasks], max(remaining, 0), limit or None, enabled=show_progress, live=live)
            scheduler = BudgetScheduler(progress, started + limit if limit else None)
            stopped_by = "budget"
            if remaining > 0 and open_tasks:
                say(f"tuning {len(open_tasks)} kernel(s): {remaining} trials, at most "
                    f"{per_task} per kernel, {per_iter} per batch" + (f", {limit:.0f} s limit" if limit else ""))
                import_tensor_intrinsics()  # before TuneContext does it the slow way (intrinsics.py)
                contexts = [ms.TuneContext(mod=t.mod, target=target, space_generator=space_generator(target),
                                           search_strategy="evolutionary", task_name=t.name, logger=logger,
                                           rand_state=seed + i, num_threads=cfg.threads).clone()
                            for i, (t, logger) in enumerate(zip(open_tasks, _task_loggers(
                                store.directory / "logs", [t.name for t in open_tasks])))]
                keep = [i for i, ctx in enumerate(contexts) if _has_search_space(ctx, open_tasks[i].name, notes)]
                contexts, open_tasks = [contexts[i] for i in keep], [open_tasks[i] for i in keep]
                progress.tasks = [progress.tasks[i] for i in keep]
            if remaining > 0 and open_tasks:
                progress.show()
                try:
                    with stop_on_sigint(scheduler, say):
                        ms.tune_tasks(
                            tasks=contexts, task_weights=[float(t.weight) for t in open_tasks],
                            work_dir=str(store.directory), max_trials_global=remaining,
                            max_trials_per_task=max(p.cap for p in progress.tasks), num_trials_per_iter=per_iter,
                            builder=builder, runner=runner, database=database,
                            cost_model=ms.cost_model.XGBModel(num_tuning_cores=cfg.threads),
                            measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"),
                                               ProgressCallback(progress), RemeasureHand(hand, progress)],
                            task_scheduler=scheduler)
                    stopped_by = scheduler.stopped_by
                except KeyboardInterrupt:
                    stopped_by = "interrupted"
            elif remaining <= 0:
                stopped_by = "the trial budget is spent (hand schedules measured)"
                if unseeded:  # this run measured baselines and nothing else: say what a search needs
                    needed = sum(spent.values()) + per_iter * max(len(open_tasks), len(unseeded))
                    notes.append(f"--trials {trials} covered only the hand-schedule baselines of {len(unseeded)} "
                                 f"kernel(s): nothing was searched; --trials {needed} gives each kernel one "
                                 f"batch of {per_iter} candidates")
            else:
                stopped_by = "no kernel left with a MetaSchedule search space (see the notes)"
    if (store.directory / "logs").is_dir():  # TVM's native warnings: for the log, not the console
        with open(store.directory / "logs" / "native.log", "a") as log:
            log.writelines(line + "\n" for line in summarize(native))
    best = _best_us(read_store(store.directory), key)
    run_now = {p.name: p.trials for p in progress.tasks}
    for name in spent:
        run_now[name] = run_now.get(name, 0) + spent[name] - before[name]
    return TuneResult(
        tasks=[TaskSummary(t.name, t.weight, before[t.name], run_now.get(t.name, 0), hand_us.get(t.name),
                           best.get(workload_id(t.mod))) for t in tasks],
        trials_run=sum(run_now.values()), wall_s=time.monotonic() - started, stopped_by=stopped_by,
        **summary)


def _best_us(contents, key: str) -> dict[str, float]:
    """Best successful latency (us) per kernel (structural hash) among the usable records."""
    best: dict[str, float] = {}
    for record in contents.usable(key):
        if not record.failed:
            shash = workload_id(contents.workloads[record.workload_index].mod)
            best[shash] = min(best.get(shash, math.inf), record.mean_secs * 1e6)
    return best
