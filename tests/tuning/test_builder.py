"""The tuning builder (tuning/builder.py): a candidate for an AMX target carries the request for
the tile state, so the runner's worker can run it; on an AMX host, the AMX hand schedule of a
kernel is measured, not recorded as a failure."""

from __future__ import annotations

import tarfile

import pytest
import tvm
from tuning_helpers import tuning_config
from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.script import tirx as T

from machine import host_target
from tvm_fusion.commands.tune import tune_model
from tvm_fusion.kernels.cpu_features import has_amx_bf16
from tvm_fusion.tuning.builder import InProcessBuilder
from tvm_fusion.tuning.store_contents import read_store, workload_id

HOST = tvm.target.Target(host_target())


@T.prim_func(s_tir=True)
def _double(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
    for i in range(16):
        with T.sblock("double"):
            vi = T.axis.spatial(16, i)
            b[vi] = a[vi] * T.float32(2)


@pytest.mark.parametrize("mcpu, asks", [("sapphirerapids", True), ("znver4", False)])
def test_an_amx_targets_candidate_carries_the_permission_request(mcpu, asks):
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    (result,) = InProcessBuilder().build([BuilderInput(tvm.IRModule({"main": _double}), target)])
    assert result.error_msg is None
    with tarfile.open(result.artifact_path) as artifact:
        names = artifact.getnames()
    assert ("amx_permission.cc" in names) == asks


@pytest.mark.skipif(not has_amx_bf16(HOST), reason="the host CPU has no AMX-BF16: no tile kernel runs here")
def test_an_amx_hand_schedule_is_measured(tmp_path, mlp_path):
    """The bf16 MLP's matmul on AMX tiles, at 256 rows (a smaller sum goes to vdpbf16ps
    registers): its hand record has a time (it was 1e10 s, a failure, before the runner's worker
    could use the tiles) and is the kernel's hand_us."""
    config = tuning_config(tmp_path / "amx.toml", 'trials = 1\nexclude = ["*gelu*"]\n')
    result = tune_model(mlp_path, config, ["x:256x16"], show_progress=False, precision="bf16")
    (task,) = result.tasks
    contents = read_store(result.store)
    (kernel,) = [k for k in contents.kernels.values() if k["name"] == task.name]
    assert kernel["hand_rule"] == "Bf16MatmulAmx"
    (record,) = contents.records
    assert not record.failed and task.hand_us is not None and task.hand_us < 1e6
    assert workload_id(contents.workloads[record.workload_index].mod) in contents.kernels
