"""Static costs of a kernel, read from its TIR before schedules: the FLOPs its blocks compute and
the bytes its parameters move (the compulsory traffic), which place it on the roofline; and a
short label of its kind, for mining."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir


def kernel_costs(func) -> tuple[int, int]:
    """(FLOPs, bytes): float arithmetic of every block times its iteration domain; every
    parameter buffer read or written once."""
    blocks: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append))
    flops = 0
    for block in blocks:
        value = getattr(block.body, "value", None)
        if value is None:
            continue
        size = 1
        for iv in block.iter_vars:
            size *= int(iv.dom.extent)
        flops += size * _arith_ops(value)
    nbytes = 0
    for param in func.params:  # buffers in TVM 0.27
        if hasattr(param, "shape"):
            count = 1
            for dim in param.shape:
                count *= int(dim)
            nbytes += count * ((tvm.runtime.DataType(str(param.dtype)).bits + 7) // 8)
    return flops, nbytes


def _arith_ops(expr) -> int:
    """Float arithmetic nodes in a stored value; index math inside loads is not counted."""
    kind = type(expr).__name__
    if kind == "BufferLoad" or not hasattr(expr, "ty"):
        return 0
    if kind == "Select":  # one branch runs (a Winograd transform picks a point's own sum)
        return max(_arith_ops(expr.true_value), _arith_ops(expr.false_value))
    is_float = "float" in str(expr.ty)
    own = int(is_float and kind in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Call"))
    if kind == "Call" and is_float and str(getattr(expr.op, "name", "")).endswith("fma"):
        own = 2
    children = [getattr(expr, field) for field in ("a", "b", "value", "condition", "true_value", "false_value")
                if hasattr(getattr(expr, field, None), "ty")]
    if kind == "Call":
        children += list(expr.args)
    return own + sum(_arith_ops(child) for child in children)


def kernel_kind(name: str, func, pattern: str) -> str:
    """A short label for mining: the op class of the kernel's heaviest work."""
    for key, kind in (("conv2d_transpose", "conv_transpose"), ("conv", "conv"), ("matmul", "matmul"),
                      ("dense", "matmul"), ("pool", "pool"), ("softmax", "softmax"),
                      ("layer_norm", "norm"), ("rms_norm", "norm")):
        if key in name:
            return kind
    if pattern not in ("tvm FuseOps", "single op"):
        return pattern.split(".")[0]
    op_pattern = int(func.attrs["op_pattern"]) if func.attrs and "op_pattern" in func.attrs else 8
    return {0: "injective", 1: "injective", 2: "injective", 3: "reduction", 4: "conv/matmul"}.get(
        op_pattern, "opaque")
