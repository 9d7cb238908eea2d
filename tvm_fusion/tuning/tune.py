"""The tuning driver: MetaSchedule + XGBoost over our fused kernels, into a tuning-log store.

* Budget: total trials, a cap per kernel and a time limit, all counted over the store, so a
  second run (after a kill, or with a larger budget) spends only what is left.
* Every kernel's hand schedule is measured first and stored as an ordinary record: the search
  starts from that known-good point (evolutionary search seeds its population with the
  store's best records), and compile can never pick a tuned schedule measured slower than it.
* Every measurement is appended to the store as soon as it is made (StoreDatabase), so a
  SIGINT or SIGKILL loses at most the batch being measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.s_tir.meta_schedule.task_scheduler import PyTaskScheduler
from tvm.target import Target

from ..native_log import captured_native_stderr, summarize
from ..runtime import set_threads
from .builder import InProcessBuilder
from .progress import TaskProgress, TuningProgress
from .store import FAILED_RUN_SECS, StoreDatabase, TuningLogError, TuningStore, read_store, target_key, workload_id
from .tasks import KernelTask, kernel_tasks, lowered_module


@dataclasses.dataclass(frozen=True)
class RpcSettings:
    """Measure on boards registered with a TVM RPC tracker under ``key`` (TVM's RPCRunner)."""

    tracker_host: str
    tracker_port: int
    key: str
    session_timeout_s: int = 60


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


def _latencies_us(runner_results) -> list[float | None]:
    values = []
    for result in runner_results:
        secs = [float(s) for s in (result.run_secs or [])]
        ok = secs and result.error_msg is None and min(secs) < FAILED_RUN_SECS
        values.append(sum(secs) / len(secs) * 1e6 if ok else None)
    return values


@derived_object
class ProgressCallback(PyMeasureCallback):
    """Feeds each measured batch into the progress display."""

    def __init__(self, progress: TuningProgress):
        self.progress = progress

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        self.progress.measured(int(task_id), _latencies_us(runner_results))


@derived_object
class BudgetScheduler(PyTaskScheduler):
    """Picks the next kernel: each once in turn, then where the most time is, within budget.

    After a first pass over all kernels, the next batch goes to the kernel with the largest
    ``calls x best latency`` (its share of the model's time), discounted by the batches it
    already had. Kernels at their cap are retired; past the deadline nothing new starts.
    """

    def __init__(self, progress: TuningProgress, deadline: float | None):
        super().__init__()
        self.progress = progress
        self.deadline = deadline
        self.stopped_by = "budget"
        self.interrupted = False
        self._batches: dict[int, int] = {}
        self._sent: set[int] = set()

    def next_task_id(self) -> int:
        outer = self._outer()
        records = outer.tasks_
        for task_id in sorted(self._sent):  # serial: a batch is measured before the next starts
            self._sent.discard(task_id)
            if not records[task_id].is_terminated:
                outer.join_running_task(task_id)
        for task_id, record in enumerate(records):
            state = self.progress.tasks[task_id]
            if not record.is_terminated and state.trials >= state.cap:
                outer.terminate_task(task_id)
            if records[task_id].is_terminated:
                self.progress.finished(task_id)
        if self.interrupted:
            self.stopped_by = "interrupted"
            return -1
        if self.progress.trials >= self.progress.budget:  # hand re-measurements count too
            self.stopped_by = "budget"
            return -1
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.stopped_by = "time limit"
            return -1
        live = [i for i, record in enumerate(records) if not record.is_terminated]
        if not live:
            self.stopped_by = "every kernel reached its cap or exhausted its search space"
            return -1
        fresh = [i for i in live if i not in self._batches]
        choice = fresh[0] if fresh else max(live, key=self._priority)
        self._batches[choice] = self._batches.get(choice, 0) + 1
        self._sent.add(choice)
        return choice

    def _priority(self, task_id: int) -> float:
        task = self.progress.tasks[task_id]
        best = task.best_overall_us
        share = task.weight * (best if math.isfinite(best) else 1e9)
        return share / (1 + self._batches[task_id])


@contextlib.contextmanager
def _stop_on_sigint(scheduler, say):
    """First Ctrl-C: start no new batch (the one being measured is kept); second: stop at once.

    A KeyboardInterrupt raised inside MetaSchedule's C++ loop is swallowed there, so the
    scheduler is asked to stop instead; every record measured so far is already on disk.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(_signum, _frame):
        scheduler.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        say("interrupted: finishing the batch being measured (Ctrl-C again stops at once)")

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _runner(rpc: RpcSettings | None):
    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=100,
                                          enable_cpu_cache_flush=False)
    if rpc is None:
        return ms.runner.LocalRunner(evaluator_config=evaluator)
    config = ms.runner.RPCConfig(tracker_host=rpc.tracker_host, tracker_port=rpc.tracker_port,
                                 tracker_key=rpc.key, session_priority=1,
                                 session_timeout_sec=rpc.session_timeout_s)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator,
                               max_workers=_rpc_boards(rpc))


def _rpc_boards(rpc: RpcSettings) -> int:
    """How many servers the tracker has under the key (one runner worker each)."""
    from tvm import rpc as tvm_rpc

    try:
        summary = tvm_rpc.connect_tracker(rpc.tracker_host, rpc.tracker_port).summary()
    except (OSError, RuntimeError, tvm.error.TVMError) as err:
        raise TuningLogError(f"cannot reach the RPC tracker at {rpc.tracker_host}:{rpc.tracker_port}: {err}",
                             "start it (python -m tvm_fusion.tuning.farm tracker) or fix --rpc-tracker") from err
    queue = summary.get("queue_info", {}).get(rpc.key)
    if not queue or int(queue.get("free", 0)) + int(queue.get("pending", 0)) < 1:
        keys = ", ".join(sorted(summary.get("queue_info", {}))) or "none"
        raise TuningLogError(f"no RPC server is registered under key {rpc.key!r} at "
                             f"{rpc.tracker_host}:{rpc.tracker_port} (keys there: {keys})",
                             "start servers with that key or pass the right --rpc-key")
    return max(1, int(queue.get("free", 0)))


class HandSchedules:
    """The kernels' hand schedules, built once, measured on demand and stored as records.

    Measured again after every tuning batch of their kernel: on a shared machine one
    measurement can be slowed by another process, and the best of many tuned candidates
    would then beat the hand schedule by luck. Re-measuring gives both sides as many draws.
    """

    def __init__(self, tasks: list[KernelTask], target: Target, builder, runner, database: StoreDatabase,
                 best_us: dict[str, float | None]):
        self.target, self.runner, self.database = target, runner, database
        self.best_us = best_us  # kernel name -> fastest hand measurement so far (kernels.json)
        scheduled = [task for task in tasks if task.hand_schedule is not None]
        built = builder.build([ms.builder.BuilderInput(t.hand_schedule.mod, target) for t in scheduled])
        self.artifacts = {task.name: (task, result.artifact_path,
                                      ms.arg_info.ArgInfo.from_entry_func(task.hand_schedule.mod, remove_preproc=True))
                          for task, result in zip(scheduled, built) if result.error_msg is None}

    def measure(self, names: list[str]) -> dict[str, float | None]:
        """Latency in us (None: the run failed) per kernel measured; each stored as a record."""
        owners = [self.artifacts[name] for name in names if name in self.artifacts]
        inputs = [ms.runner.RunnerInput(path, _device_type(self.target), args) for _, path, args in owners]
        results = [future.result() for future in self.runner.run(inputs)] if inputs else []
        latencies = {}
        for (task, _, args), latency in zip(owners, _latencies_us(results)):
            workload = self.database.commit_workload(task.mod)
            run_secs = [latency * 1e-6] if latency is not None else [FAILED_RUN_SECS]
            self.database.commit_tuning_record(ms.database.TuningRecord(
                task.hand_schedule.trace, workload, run_secs, self.target, args))
            latencies[task.name] = latency
            if latency is not None and (self.best_us.get(task.name) is None or latency < self.best_us[task.name]):
                self.best_us[task.name] = latency
                self.database.store.update_kernels({workload_id(task.mod): {"hand_us": latency}})
        return latencies

    def close(self) -> None:
        for _, path, _ in self.artifacts.values():
            _remove_artifact(path)


@derived_object
class RemeasureHand(PyMeasureCallback):
    """After each tuning batch, one more measurement of that kernel's hand schedule."""

    def __init__(self, hand: HandSchedules, progress: TuningProgress):
        self.hand = hand
        self.progress = progress

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        task = self.progress.tasks[int(task_id)]
        latencies = self.hand.measure([task.name])
        if task.name in latencies:
            self.progress.hand_measured(int(task_id), latencies[task.name])


def _has_search_space(context: ms.TuneContext, name: str, notes: list[str]) -> bool:
    """MetaSchedule's default rules fail on some fused kernels (a ScheduleError while building
    the design space); such a kernel keeps its hand schedule instead of stopping the whole run."""
    try:
        return len(context.clone().generate_design_space()) > 0
    except RuntimeError as err:  # ScheduleError and TVMError both derive from it
        notes.append(f"{name}: MetaSchedule cannot build a search space ({str(err).splitlines()[0][:120]}); "
                     "it keeps its hand schedule")
        return False


def _device_type(target: Target) -> str:
    """The runner's device name for the target ("cpu" for llvm), as MetaSchedule passes it."""
    return str(tvm.runtime.Device(target.get_target_device_type(), 0)).split(":")[0]


def _remove_artifact(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def tune_model(model_path: str | Path, config=None, input_shapes=None, *, trials: int | None = None,
               per_task_trials: int | None = None, time_limit_s: float | None = None,
               trials_per_iter: int | None = None, log_dir: str | Path | None = None,
               rpc: RpcSettings | None = None, seed: int = 0, show_progress: bool = True,
               live: bool | None = None, say=lambda message: None) -> TuneResult:
    """Tune the model's fused kernels for the config's target into ``<log_dir>/<target key>/``.

    Arguments left None come from the config's ``[tuning]`` section. Budgets count trials
    already in the store: the result says how many were there and how many this run added.
    """
    from ..preparation import at_one_size, prepare

    started = time.monotonic()
    prepared = prepare(model_path, config, input_shapes, say)
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
        all_tasks = kernel_tasks(lowered_module(prepared), target, settings.exclude)
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
        summary = dict(store=store.directory, target_key=key,
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
        builder, runner = InProcessBuilder(), _runner(rpc)
        spent = dict(before)
        unseeded = [t for t in open_tasks if before[t.name] == 0]
        # Fastest hand measurement per kernel (kernels.json keeps it across runs), updated as we go.
        hand_us = {t.name: contents.kernels.get(workload_id(t.mod), {}).get("hand_us") for t in open_tasks}
        hand = HandSchedules(open_tasks, target, builder, runner, database, hand_us)
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
            contexts = [ms.TuneContext(mod=t.mod, target=target, space_generator="post-order-apply",
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
                with _stop_on_sigint(scheduler, say):
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
        else:
            stopped_by = "no kernel left with a MetaSchedule search space (see the notes)"
        hand.close()
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
