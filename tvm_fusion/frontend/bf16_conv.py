"""A dense conv2d by a constant float32 weight as the bf16 matmul kernel (``--precision bf16``).

The conv is a matmul of its input's patches (``conv_patches.py``): the kernel's prologue rounds
the input to bf16 bits once and copies them into the patch matrix (zero outside the padded
input), the sum is ``bf16_matmul.py``'s (so ``Bf16MatmulAmx`` puts it on AMX-BF16 tiles), and a
last block writes each output pixel's channels to the conv's output layout.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te

from .bf16_matmul import DEPTH_BLOCK, PROLOGUE_NAME, bf16_bits, pack_weight, sum_te
from .conv_geometry import ConvGeometry
from .conv_patches import PatchOperand, output_te, patches_te

PRIMFUNC_NAME = "bf16_conv2d"  # the kernel's: inspect credits the epilogue FuseOps gives it
BF16_PATCHES = PatchOperand("uint16", DEPTH_BLOCK, bf16_bits, 0, "bf16_conv_input", PROLOGUE_NAME, "bf16_conv_output")


def conv_te(data: te.Tensor, packed: te.Tensor, geometry: ConvGeometry) -> te.Tensor:
    """Patches, sum and output layout in one kernel."""
    return output_te(sum_te(patches_te(data, geometry, BF16_PATCHES), packed), geometry, BF16_PATCHES.output_name)


def emit_bf16_conv2d(bb: relax.BlockBuilder, data: relax.Expr, geometry: ConvGeometry, weight: np.ndarray,
                     packed: relax.Expr | None = None, name: str = "") -> relax.Expr:
    """The conv of ``data`` by ``weight`` (``[K, Co]``, ``weight_matrix``'s) as one bf16 kernel;
    ``packed`` what holds ``pack_weight(weight)`` (a composite's parameter), default a constant;
    ``name`` the kernel call's binding (the conv's, so its kernel traces back to its node)."""
    if packed is None:
        packed = relax.const(tvm.runtime.tensor(pack_weight(weight)))
    return bb.emit_te(lambda d, w: conv_te(d, w, geometry), data, packed, primfunc_name_hint=PRIMFUNC_NAME,
                      name_hint=name)
