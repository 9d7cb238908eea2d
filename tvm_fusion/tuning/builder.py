"""An in-process MetaSchedule builder.

The stock LocalBuilder starts a worker pool per batch and each worker imports TVM's tensor
intrinsics (19-48 s on a 2-core machine), so its builds time out here. Building in the
tuning process pays that import once, in a few seconds through ``intrinsics.py``; measuring
still happens in the runner's process (or on an RPC board).

A candidate for an AMX target carries the constructor that asks Linux for the tile state
(``targets/amx.py``): the runner's worker, or the board, never asked for it, and without it the
first tile instruction kills the worker (every AMX hand schedule was measured as a failure).
"""

from __future__ import annotations

import os
import tempfile
import warnings

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import default_build
from tvm.support.tar import tar
from tvm.target import Target

from ..kernels.cpu_features import has_amx_bf16, has_amx_int8
from ..targets.amx import PERMISSION_SOURCE
from .intrinsics import import_tensor_intrinsics


@derived_object
class InProcessBuilder(PyBuilder):
    """MetaSchedule's own default_build + default_export, one candidate after another."""

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        import_tensor_intrinsics()  # default_build would import them the slow way (intrinsics.py)
        results = []
        for build_input in build_inputs:
            try:
                with warnings.catch_warnings():  # MetaSchedule's default_build calls the deprecated tvm.build
                    warnings.simplefilter("ignore", DeprecationWarning)
                    module = default_build(build_input.mod, build_input.target, None)
                results.append(BuilderResult(_export(module, build_input.target), None))
            except Exception as err:  # a candidate that fails to build is a normal search outcome
                results.append(BuilderResult(None, f"{type(err).__name__}: {err}"))
        return results


def _export(module, target: Target) -> str:
    """MetaSchedule's export (a tar of objects, linked where it runs), with the AMX permission's
    source added for a target with AMX tiles."""
    path = os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod." + tar.output_format)
    addons = [str(PERMISSION_SOURCE)] if has_amx_int8(target) or has_amx_bf16(target) else []
    module.export_library(path, fcompile=tar, addons=addons)
    return path
