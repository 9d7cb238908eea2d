"""Flattened Linear: Reshape -> Gemm -> Reshape back -> plain matmul (+ bias) on the N-D input.

PyTorch's ``addmm``-based layers (GPT-2's Conv1D, ``nn.Linear`` on old exporters) export as
Reshape(x, [B*S, K]) -> Gemm -> Reshape(., [B, S, N]). The reshapes hide the bias and the
activation that follows from the GEMM epilogue fusion; matmul broadcasts over leading dims,
so matmul on the input viewed as [..., K] computes the same values without two copies.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .base import RewriteRule, dims_text, same_dim, same_dims, same_size, shape_dims


class FlattenedLinear(RewriteRule):
    name = "flattened_linear"
    description = "reshape(matmul(reshape(x, [M, K]), W) [+ b], [..., N]) -> matmul(x, W) [+ b]"

    def variants(self):
        variants = []
        for with_bias in (True, False):
            x, flat_shape, weight, bias, out_shape = (wildcard(), wildcard(), wildcard(),
                                                      wildcard(), wildcard())
            flat = is_op("relax.reshape")(x, flat_shape)
            out = is_op("relax.matmul")(flat, weight)
            named = {"x": x, "flat": flat, "weight": weight}
            if with_bias:
                out = is_op("relax.add")(out, bias)
                named["bias"] = bias
            named["unflat"] = is_op("relax.reshape")(out, out_shape)
            variants.append((named["unflat"], named))
        return variants

    def check(self, matched):
        # Symbolic leading dims (batch, sequence) are fine: the flattened rows need only provably
        # be the product of the unflattened ones, and the rewritten matmul keeps them.
        x_shape, weight_shape, flat_shape, out_shape = (
            shape_dims(matched[name]) for name in ("x", "weight", "flat", "unflat"))
        if None in (x_shape, weight_shape, flat_shape, out_shape):
            return "the ranks of the reshapes and the matmul are not known"
        if len(weight_shape) != 2 or len(x_shape) < 2:
            return f"weight shape {dims_text(weight_shape)} is not 2-D"
        if len(flat_shape) != 2 or len(out_shape) < 2 or not same_dim(out_shape[-1], weight_shape[1]):
            return (f"reshapes {dims_text(x_shape)} -> {dims_text(flat_shape)} -> {dims_text(out_shape)} "
                    "are not a flatten/unflatten pair")
        if not same_size(out_shape[:-1], flat_shape[:1]):
            return (f"the last reshape {dims_text(out_shape)} does not restore the {flat_shape[0]} "
                    "flattened rows")
        if "bias" in matched:
            bias_shape = shape_dims(matched["bias"])
            if bias_shape is None or len(bias_shape) > 1 and not all(same_dim(d, 1) for d in bias_shape[:-1]):
                return f"bias shape {dims_text(bias_shape)} would not broadcast the same way on the N-D output"
        return None

    def rewrite(self, matched):
        x = matched["x"]
        rows_shape = (*shape_dims(matched["unflat"])[:-1], shape_dims(matched["flat"])[1])
        if not same_dims(shape_dims(x), rows_shape):  # e.g. [B, S, H, D] -> [B, S, H*D]: a free view
            x = relax.op.reshape(x, rows_shape)
        out = relax.op.matmul(x, matched["weight"])
        if "bias" in matched:
            out = relax.op.add(out, matched["bias"])
        return out
