"""Hand-written TE kernels, and how the stages after the one that makes a kernel recognize it.

The frontend emits some (``eye_like``, ``dropout_training``) and the patterns then recognize
them: each is emitted with the PrimFunc attribute ``tvm_fusion.kernel`` (``KERNEL_ATTR``) set
to its name, so a pattern can tell it from another function that happens to share a name
prefix (``kernel_kind``), whatever name the module gave it.

The blocked conv's legalization emits the Winograd conv (``winograd_conv2d``), which the
weight precomputation and the CPU schedule rule know by its block names. What passes and
schedule rules both read of a kernel lies here too, below ``passes/`` and ``schedules/``: its
blocks (``blocks``) and a matmul's axes (``matmul``).
"""

from __future__ import annotations

import tvm

KERNEL_ATTR = "tvm_fusion.kernel"
# TVM's Clip converter emits topi.maximum (the lower bound), then topi.minimum (the upper bound);
# the frontend marks the two kernels with these kinds, by topi function name.
CLIP_KERNELS = {"maximum": "clip_maximum", "minimum": "clip_minimum"}


def kernel_attrs(kind: str) -> dict[str, str]:
    """The ``primfunc_attrs`` of ``BlockBuilder.call_te`` that mark a kernel as ours."""
    return {KERNEL_ATTR: kind}


def kernel_kind(module: tvm.IRModule, callee) -> str | None:
    """The ``tvm_fusion.kernel`` of the PrimFunc ``callee`` (a GlobalVar of ``module``), or None."""
    if not isinstance(callee, tvm.ir.GlobalVar) or callee not in module:
        return None
    func = module[callee]
    if not isinstance(func, tvm.tirx.PrimFunc) or not func.attrs:
        return None
    kind = func.attrs.get(KERNEL_ATTR)
    return None if kind is None else str(kind)


__all__ = ["CLIP_KERNELS", "KERNEL_ATTR", "kernel_attrs", "kernel_kind"]
