"""Fixtures shared by the schedule tests: lower small Relax graphs, run them, compare runs."""

import numpy as np
import pytest
import tvm
from tvm import relax

from loop_structure import float_lanes
from machine import host_target

TARGET = tvm.target.Target(host_target())  # the code is run here


def _lower(fn, **shapes) -> tvm.IRModule:
    """`fn(*params)` as the body of a one-function Relax module, lowered by the zero pipeline."""
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(fn(*params))
        bb.emit_func_output(out)
    return relax.get_pipeline("zero")(bb.get())


def _schedule_with(rule, mod: tvm.IRModule) -> tvm.IRModule:
    scheduled = mod.clone()
    for gvar, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            sch = rule.apply(func, TARGET, False)
            assert sch is not None, f"{type(rule).__name__} declined {gvar.name_hint}"
            scheduled[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return scheduled


def _run(mod: tvm.IRModule, inputs: list) -> np.ndarray:
    """The function's output; a tuple of outputs (a split) stacked, each flattened."""
    dev = tvm.cpu()
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), dev)
    out = vm["main"](*[tvm.runtime.tensor(x, dev) for x in inputs])
    return out.numpy() if hasattr(out, "numpy") else np.concatenate([part.numpy().ravel() for part in out])


@pytest.fixture
def run_kernel():
    """run_kernel(func, shapes, result_shape) -> the output of one PrimFunc built for the host,
    called on seeded random inputs of ``shapes`` (by parameter) and an output buffer."""

    def run(func, shapes: dict, result_shape) -> np.ndarray:
        rng = np.random.default_rng(0)
        args = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in shapes.values()]
        out = tvm.runtime.tensor(np.zeros(result_shape, "float32"))
        tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)["main"](*args, out)
        return out.numpy()

    return run


@pytest.fixture
def target():
    return TARGET


@pytest.fixture
def lanes():
    """float32 lanes of one vector register of the host target (8 on AVX2, 16 on AVX-512)."""
    return float_lanes(TARGET)


@pytest.fixture
def lowered():
    """lowered(fn, x=shape, w=shape...) -> IRModule after the zero pipeline."""
    return _lower


@pytest.fixture
def prim_funcs():
    """prim_funcs(mod) -> {name: PrimFunc}."""
    return lambda mod: {
        gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    }


@pytest.fixture
def assert_schedule_matches():
    """Schedule every PrimFunc of the lowered graph with `rule` (it must answer for each),
    build both modules and compare their outputs on random inputs; returns the scheduled
    PrimFuncs by name, for the test to check the loop structure the rule promises."""

    def check(rule, fn, rtol=1e-5, atol=1e-5, **shapes):
        mod = _lower(fn, **shapes)
        rng = np.random.default_rng(0)
        inputs = [rng.standard_normal(shape).astype("float32") for shape in shapes.values()]
        expected = _run(mod, inputs)
        scheduled = _schedule_with(rule, mod)
        np.testing.assert_allclose(_run(scheduled, inputs), expected, rtol=rtol, atol=atol)
        return {gv.name_hint: f for gv, f in scheduled.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}

    return check
