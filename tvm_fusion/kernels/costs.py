"""Static costs of a kernel, read from its TIR before schedules: the FLOPs its blocks compute and
the bytes its parameters move (the compulsory traffic), which place it on the roofline; whether
it holds a contraction (a sum of products of two inputs: a matmul or conv in any spelling); and
a short label of its kind, for mining."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad


def kernel_costs(func, extent=int, integers: bool = False) -> tuple[int, int]:
    """(FLOPs, bytes): float arithmetic of every block times its iteration domain; every
    parameter buffer read or written once. ``extent`` turns a dim into an int (a symbolic one
    at some size). ``integers``: integer arithmetic counts too (an int8 kernel's products are
    the model's work, though no FLOPs)."""
    flops = 0
    for block in _blocks(func):
        value = getattr(block.body, "value", None)
        if value is None:
            continue
        size = 1
        for iv in block.iter_vars:
            size *= extent(iv.dom.extent)
        flops += size * _arith_ops(value, integers)
    return flops, param_bytes(func, extent)


def param_bytes(func, extent=int) -> int:
    """Bytes of every parameter buffer, each read or written once."""
    nbytes = 0
    for param in func.params:  # buffers in TVM 0.27
        if hasattr(param, "shape"):
            count = 1
            for dim in param.shape:
                count *= extent(dim)
            nbytes += count * ((tvm.runtime.DataType(str(param.dtype)).bits + 7) // 8)
    return nbytes


def has_contraction(func) -> bool:
    """Whether a block sums, over a reduction axis, the product of two loads that both read
    that axis: a matmul, a conv or an Einsum's contraction, however it was written."""
    for block in _blocks(func):
        reduced = {iv.var for iv in block.iter_vars if int(iv.iter_type) == tvm.tirx.IterVar.CommReduce}
        value = getattr(block.body, "value", None)
        if reduced and value is not None and _product_over(value, reduced):
            return True
    return False


def _blocks(func) -> list:
    blocks: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append))
    return blocks


def _product_over(expr, reduced: set) -> bool:
    """A Mul in ``expr`` whose two sides load different buffers at indices using a reduced var
    (not a sum of squares, whose sides read the same tensor)."""
    products: list = []
    tvm_ffi.structural_walk(expr, (tirx.Mul, products.append))
    for product in products:
        left, right = _buffers_over(product.a, reduced), _buffers_over(product.b, reduced)
        if left and right and not left & right:
            return True
    return False


def _buffers_over(expr, reduced: set) -> set[str]:
    """Names of the buffers ``expr`` loads at an index that uses a reduced var."""
    loads: list = []
    tvm_ffi.structural_walk(expr, (TensorLoad, loads.append))
    names = set()
    for load in loads:
        used: list = []
        for index in load.indices:
            tvm_ffi.structural_walk(index, (tirx.Var, lambda v: used.append(v) if any(v.same_as(r) for r in reduced)
                                            else None))
        if used:
            names.add(str(load.source.name))
    return names


def _arith_ops(expr, integers: bool = False) -> int:
    """Float (with ``integers``, also integer) arithmetic nodes in a stored value; index math
    inside loads is not counted.

    A worklist, not recursion: an unrolled graph's kernel can sum thousands of terms in one
    expression (SLANet's table head)."""
    count, pending = 0, [expr]
    while pending:
        node = pending.pop()
        kind = type(node).__name__
        if kind == "BufferLoad" or not hasattr(node, "ty"):
            continue
        if kind == "Select":  # one branch runs (a Winograd transform picks a point's own sum)
            count += max(_arith_ops(node.true_value, integers), _arith_ops(node.false_value, integers))
            continue
        counted = "float" in str(node.ty) or (integers and "int" in str(node.ty) and "bool" not in str(node.ty))
        op = str(getattr(node.op, "name", "")) if kind == "Call" else ""
        # a reinterpret is a bit cast, no arithmetic (bf16 kernels read their operands' bits so)
        count += int(counted and kind in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Call")
                     and not op.endswith("reinterpret"))
        if kind == "Call" and counted and op.endswith("fma"):
            count += 1  # a multiply-add is two
        pending += [getattr(node, field) for field in ("a", "b", "value", "condition", "true_value", "false_value")
                    if hasattr(getattr(node, field, None), "ty")]
        if kind == "Call":
            pending += list(node.args)
    return count


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
