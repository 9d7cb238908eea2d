"""FoldConstantsSafely: FoldConstant, kept only when its result is a well-formed module.

The canonicalize phase folds the importer's constant computations (Clip bounds, shape
arithmetic) so rewrite rules see plain constants. In TVM 0.27, FoldConstant on a module with
``dynamic_strided_slice`` (ONNX Slice with run-time starts) leaves a call to a ``shape_func``
it never defines, and the build fails later; such a module is kept unfolded instead.
"""

from __future__ import annotations

import tvm
from tvm import relax


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.FoldConstantsSafely")
class FoldConstantsSafely:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        folded = relax.transform.FoldConstant()(mod)
        return folded if relax.analysis.check_well_formed(folded) else mod
