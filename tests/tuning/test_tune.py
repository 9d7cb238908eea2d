"""Real (tiny) MetaSchedule runs: kill -9 mid-run, reload, resume with the remaining budget.

One kernel of the test MLP (the other excluded by config), 2 trials per batch: a few
seconds of search per batch, plus the tensor-intrinsic import (a few seconds, tuning/intrinsics.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tuning_helpers import ADD, GELU, MLP_SHAPE, tuning_config

from tvm_fusion.tuning.store_contents import RECORD_FILE, read_store
from tvm_fusion.commands.tune import tune_model

BUDGET = 6
PER_ITER = 2
TUNE = """
import sys
from tvm_fusion.commands.tune import tune_model
tune_model(sys.argv[1], sys.argv[2], ["x:4x16"], show_progress=False)
"""


def _records(store: Path) -> int:
    path = store / RECORD_FILE
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def test_kill_9_keeps_records_and_a_rerun_spends_only_the_rest(tmp_path, mlp_path):
    config = tuning_config(tmp_path / "one-kernel.toml",
                           f'trials = {BUDGET}\ntrials_per_iter = {PER_ITER}\nexclude = ["*gelu*"]\n')
    tuner = subprocess.Popen([sys.executable, "-c", TUNE, str(mlp_path), str(config)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and tuner.poll() is None:
            stores = list((tmp_path / "logs").glob("*/"))
            store = stores[0] if stores else None
            if store is not None and _records(store) >= 1 + PER_ITER:  # hand record + one batch
                break
            time.sleep(0.2)
        assert tuner.poll() is None, "the tuning run ended before it could be killed"
        tuner.kill()  # SIGKILL: no handler runs
    finally:
        tuner.kill()
        tuner.wait(timeout=30)

    killed = read_store(store)
    assert all(p.line == _records(store) for p in killed.problems)  # at most a torn last line
    measured = len(killed.records)
    assert 1 + PER_ITER <= measured < BUDGET

    result = tune_model(mlp_path, config, MLP_SHAPE, show_progress=False)
    assert result.trials_before == measured
    assert result.excluded == {GELU: "*gelu*"}
    assert [t.name for t in result.tasks] == [ADD]
    resumed = read_store(store)
    assert len(resumed.records) == measured + result.trials_run  # nothing measured earlier was lost
    assert BUDGET <= len(resumed.records) < BUDGET + PER_ITER
    assert result.tasks[0].best_us is not None and result.tasks[0].hand_us is not None

    again = tune_model(mlp_path, config, MLP_SHAPE, show_progress=False)
    assert again.trials_run == 0 and "already spent" in again.stopped_by
    assert len(read_store(store).records) == len(resumed.records)


def test_a_budget_that_only_covers_the_baselines_says_so(tmp_path, mlp_path):
    """One trial: the hand schedule of the one kernel is measured and nothing is searched."""
    config = tuning_config(tmp_path / "baseline-only.toml",
                           f'trials = 1\ntrials_per_iter = {PER_ITER}\nexclude = ["*gelu*"]\n')
    result = tune_model(mlp_path, config, MLP_SHAPE, show_progress=False)
    assert result.trials_run == 1 and "hand schedules measured" in result.stopped_by
    (warning,) = [n for n in result.notes if "nothing was searched" in n]
    assert f"--trials 1 covered only the hand-schedule baselines of 1 kernel(s)" in warning
    assert f"--trials {1 + PER_ITER} gives each kernel one batch of {PER_ITER} candidates" in warning
