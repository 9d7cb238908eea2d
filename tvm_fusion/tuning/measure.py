"""Measuring: the runner (local, or boards behind an RPC tracker), and the hand schedules.

Every kernel's hand schedule is measured first and stored as an ordinary record, then again
after each tuning batch of its kernel, so compile never picks a tuned schedule that only won
by luck against one slow measurement of the hand schedule.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import tvm
from tvm import rpc as tvm_rpc
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.target import Target

from ..errors import TuningLogError
from .progress import TuningProgress
from .store_contents import FAILED_RUN_SECS, workload_id
from .store_database import StoreDatabase
from .tasks import KernelTask


@dataclasses.dataclass(frozen=True)
class RpcSettings:
    """Measure on boards registered with a TVM RPC tracker under ``key`` (TVM's RPCRunner)."""

    tracker_host: str
    tracker_port: int
    key: str
    session_timeout_s: int = 60


def make_runner(rpc: RpcSettings | None):
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


def _latencies_us(runner_results) -> list[float | None]:
    values = []
    for result in runner_results:
        secs = [float(s) for s in (result.run_secs or [])]
        ok = secs and result.error_msg is None and min(secs) < FAILED_RUN_SECS
        values.append(sum(secs) / len(secs) * 1e6 if ok else None)
    return values


def _device_type(target: Target) -> str:
    """The runner's device name for the target ("cpu" for llvm), as MetaSchedule passes it."""
    return str(tvm.runtime.Device(target.get_target_device_type(), 0)).split(":")[0]


def _remove_artifact(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@derived_object
class ProgressCallback(PyMeasureCallback):
    """Feeds each measured batch into the progress display."""

    def __init__(self, progress: TuningProgress):
        self.progress = progress

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        self.progress.measured(int(task_id), _latencies_us(runner_results))


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
