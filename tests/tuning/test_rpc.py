"""Device farm: a TVM RPC tracker and two servers on 127.0.0.1, measured through TVM's RPCRunner.

Everything is bounded in time and stopped by PID, the servers' popen_worker children too.
"""

from __future__ import annotations

import socket

import psutil
import pytest
from tuning_helpers import ADD, MLP_SHAPE, tuning_config

from tvm_fusion.errors import TuningLogError
from tvm_fusion.tuning import farm
from tvm_fusion.tuning.store_contents import read_store
from tvm_fusion.commands.tune import RpcSettings, tune_model

KEY = "tvm-fusion-test"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((farm.LOOPBACK, 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def device_farm():
    """(tracker port, [processes]); every process and its children are gone afterwards."""
    processes = []
    port = _free_port()
    try:
        processes.append(farm.start_tracker(port))
        for _ in range(2):
            processes.append(farm.start_server(f"{farm.LOOPBACK}:{port}", KEY, _free_port(), threads=2))
        farm.wait_for_servers(farm.LOOPBACK, port, KEY, 2, timeout_s=60)
        yield port, processes
    finally:
        family = []
        for process in processes:
            try:
                family += [process.pid, *(c.pid for c in psutil.Process(process.pid).children(recursive=True))]
            except psutil.NoSuchProcess:
                pass
            farm.stop(process)
        assert not [pid for pid in family if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def _listening_addresses(process) -> set[str]:
    family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    return {c.laddr.ip for p in family for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_unknown_rpc_key_is_a_clear_error(tmp_path, mlp_path, device_farm):
    port, _ = device_farm
    config = tuning_config(tmp_path / "rpc.toml", 'exclude = ["*gelu*"]\n')
    with pytest.raises(TuningLogError, match=f"no RPC server is registered under key 'nope'.*{KEY}"):
        tune_model(mlp_path, config, MLP_SHAPE, trials=2, show_progress=False,
                   rpc=RpcSettings(farm.LOOPBACK, port, "nope"))


def test_rpc_loopback_tuning_produces_records(tmp_path, mlp_path, device_farm):
    port, processes = device_farm
    for process in processes:  # TVM's defaults would listen on every interface
        assert _listening_addresses(process) <= {farm.LOOPBACK}
    assert _listening_addresses(processes[0]) == {farm.LOOPBACK}

    config = tuning_config(tmp_path / "rpc.toml", 'exclude = ["*gelu*"]\n')
    result = tune_model(mlp_path, config, MLP_SHAPE, trials=5, trials_per_iter=4, show_progress=False,
                        rpc=RpcSettings(farm.LOOPBACK, port, KEY))
    assert [t.name for t in result.tasks] == [ADD]
    contents = read_store(result.store)
    measured = [r for r in contents.records if not r.failed]
    assert len(contents.records) == result.trials_run >= 5
    assert len(measured) >= 2  # the hand schedule and at least one tuned candidate ran on the boards

