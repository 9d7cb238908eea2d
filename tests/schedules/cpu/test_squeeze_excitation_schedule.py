"""SqueezeExcitation: the fused SE gate kernel (global pool + two 1x1 convs) gets vector
partial sums for the pool and the convs, channels across cores."""

import numpy as np
import pytest
import tvm
from loop_structure import loop_kinds
from machine import host_target
from tvm import relax
from tvm.relax.op import add, mean, nn, sigmoid

from tvm_fusion.config import parse_config
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport
from tvm_fusion.schedules.cpu import Fallback, SqueezeExcitation


def squeeze_excitation(x, w1, b1, w2, b2):
    pooled = mean(x, axis=[2, 3], keepdims=True)
    hidden = nn.relu(add(nn.conv2d(pooled, w1), b1))
    return sigmoid(add(nn.conv2d(hidden, w2), b2))


def fused_gate_kernel(channels: int, squeezed: int, size: int):
    """The one PrimFunc the squeeze_excitation pattern makes of the gate, and its input shapes."""
    shapes = {"x": (1, channels, size, size), "w1": (squeezed, channels, 1, 1), "b1": (1, squeezed, 1, 1),
              "w2": (channels, squeezed, 1, 1), "b2": (1, channels, 1, 1)}
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            out = builder.emit_output(squeeze_excitation(*params))
        builder.emit_func_output(out)
    config = parse_config({"target": host_target(),
                           "pipeline": {"patterns": ["squeeze_excitation"]}}, name="test")
    mod = fusion_pipeline(config, PatternReport(), phases=("canonicalize", "fuse", "lower"))(builder.get())
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return kernel, shapes


def run_kernel(func, shapes, target) -> np.ndarray:
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in shapes.values()]
    out = tvm.runtime.tensor(np.zeros(shapes["b2"], "float32"))  # one gate per channel
    tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"](*args, out)
    return out.numpy()


# (channels, squeezed, map size): MobileNetV3 stage shapes; the last one has a tail large
# enough to run across cores, and a 7x7 map that does not split into whole vectors.
@pytest.mark.parametrize("channels, squeezed, size", [(16, 8, 56), (96, 24, 16), (512, 128, 7)])
def test_gate_matches_the_unscheduled_kernel(target, lanes, channels, squeezed, size):
    kernel, shapes = fused_gate_kernel(channels, squeezed, size)
    sch = SqueezeExcitation().apply(kernel, target, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    # The pool's channels across cores, and each conv across cores once it has 2**16 MACs; each
    # reduction (map, input channels, squeezed channels) that is two or more whole vectors long
    # is summed in a vector of partial sums, its update and init vectorized.
    tail_parallel = [squeezed, channels] if channels * squeezed >= 1 << 16 else []
    split = [n for n in (size * size, channels, squeezed) if n % lanes == 0 and n >= 2 * lanes]
    loops = loop_kinds(scheduled)
    assert loops.parallel == [channels, *tail_parallel]
    assert loops.vectorized == [lanes] * 2 * len(split)
    expected = run_kernel(Fallback().apply(kernel, target, False).mod["main"], shapes, target)
    np.testing.assert_allclose(run_kernel(scheduled, shapes, target), expected, rtol=1e-5, atol=1e-5)


def test_declines_a_plain_global_pool_and_a_conv(lowered, prim_funcs, target):
    pool = lowered(lambda x: mean(x, axis=[2, 3], keepdims=True), x=(1, 16, 8, 8))
    conv = lowered(lambda x, w: nn.conv2d(x, w), x=(1, 16, 8, 8), w=(8, 16, 1, 1))
    for mod in (pool, conv):
        for func in prim_funcs(mod).values():
            assert SqueezeExcitation().apply(func, target, False) is None
