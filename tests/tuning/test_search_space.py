"""tune's search space (tuning/search_space.py): the int8 and bf16 kernels' candidates are
tensorized with our intrinsics, build for named targets (assembly read, nothing run), and their
traces replay from the store's JSON as compile replays them."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import tirx
from tvm import relax
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.tirx import ForKind

from tvm_fusion.frontend.bf16_matmul import emit_bf16_matmul
from tvm_fusion.frontend.integer_matmul import emit_integer_matmul
from tvm_fusion.kernels.avx512_bf16 import DPBF16PS_FUNCTION, IMPORT_ANNOTATION
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.schedules.cpu.bf16_matmul_avx512 import DPBF16PS_INTRIN
from tvm_fusion.schedules.cpu.int8_matmul_vnni import VNNI_INTRIN
from tvm_fusion.tuning.search_space import dot_intrinsics, space_generator
from tvm_fusion.tuning.tasks import kernel_tasks


def _target(mcpu: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})


ZEN4, SAPPHIRE_RAPIDS, ICELAKE, ZEN3 = (_target(c) for c in ("znver4", "sapphirerapids", "icelake-server", "znver3"))


def _lowered(emit, dtype: str) -> tvm.IRModule:
    """main(a[33, 100]) through one kernel ``emit`` makes (an int8 or bf16 sum of 64 columns)."""
    a = relax.Var("a", relax.TensorType((33, 100), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [a]):
        with bb.dataflow():
            out = bb.emit_output(emit(bb, a))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get())


WEIGHT = np.random.default_rng(0).integers(-100, 100, (100, 64))
KERNELS = {
    "int8": (lambda: _lowered(lambda bb, a: emit_integer_matmul(bb, a, 3, WEIGHT), "uint8"), "int8_matmul",
             VNNI_INTRIN, "vpdpbusd"),
    "bf16": (lambda: _lowered(lambda bb, a: emit_bf16_matmul(bb, a, WEIGHT.astype(np.float32)), "float32"),
             "bf16_matmul", DPBF16PS_INTRIN, "vdpbf16ps"),
}


def _candidates(kind: str, target, seeds=range(3)) -> list[Schedule]:
    """The design spaces of the kind's kernel (their tile sizes sampled from each seed), each
    post-processed as the search does."""
    make, name, _, _ = KERNELS[kind]
    (task,) = [t for t in kernel_tasks(make(), target) if name in t.name]
    done = []
    for seed in seeds:
        context = ms.TuneContext(mod=task.mod, target=target, space_generator=space_generator(target),
                                 search_strategy="evolutionary", task_name=task.name, rand_state=seed,
                                 num_threads=2).clone()
        for space in context.generate_design_space():
            candidate = space.copy()
            assert all(postproc.apply(candidate) for postproc in context.space_generator.postprocs)
            done.append(candidate)
    return done


def _assembly(mod: tvm.IRModule, target) -> str:
    return tvm.tirx.build(mod, target=target).inspect_source("s")


@pytest.mark.parametrize("kind, target", [("int8", ZEN4), ("int8", SAPPHIRE_RAPIDS), ("int8", ICELAKE),
                                          ("bf16", ZEN4), ("bf16", SAPPHIRE_RAPIDS)],
                         ids=["int8-znver4", "int8-sapphirerapids", "int8-icelake", "bf16-znver4", "bf16-sapphirerapids"])
def test_candidates_are_tensorized_with_our_intrinsic_and_build(kind, target):
    _, _, intrinsic, instruction = KERNELS[kind]
    candidates = _candidates(kind, target)
    traces = [str(c.trace) for c in candidates]
    assert any(intrinsic in trace for trace in traces)
    assert not any("dot_16x4_vnni" in trace for trace in traces)  # TVM's: LLVM rejects its operand types
    assemblies = [_assembly(c.mod, target) for c in candidates]  # every candidate builds
    assert any(instruction in asm for asm in assemblies)
    assert not any(f"call\t{DPBF16PS_FUNCTION}" in asm for asm in assemblies)  # the imported IR is inlined


def test_a_tiles_column_blocks_around_the_intrinsic_are_unrolled_not_vectorized():
    """The search's own vectorizer vectorizes a tile's column blocks around the intrinsic (which
    fails to build); they are unrolled instead, and such candidates build."""
    unrolled = []
    for candidate in _candidates("int8", ZEN4, seeds=range(8)):
        loops: list[tirx.For] = []
        tvm_ffi.structural_walk(candidate.mod["main"].body, (tirx.For, loops.append))
        around = [loop for loop in loops if "vpdpbusd" in str(loop.body)]
        assert not any(loop.kind == ForKind.VECTORIZED for loop in around)
        if any(loop.kind == ForKind.UNROLLED and int(loop.extent) > 1 for loop in around):
            unrolled.append(candidate)
    assert unrolled  # the case arose among the sampled tiles
    assert all("vpdpbusd" in _assembly(c.mod, ZEN4) for c in unrolled)


def test_a_bf16_candidate_imports_its_llvm_and_replays_from_json():
    """The store keeps a record's trace as JSON; compile replays it on the unscheduled kernel:
    the import annotation is in the trace, so the replayed kernel builds with ``vdpbf16ps``."""
    make, name, intrinsic, _ = KERNELS["bf16"]
    candidate = next(c for c in _candidates("bf16", ZEN4) if intrinsic in str(c.trace))
    assert IMPORT_ANNOTATION in str(candidate.trace)
    (task,) = [t for t in kernel_tasks(make(), ZEN4) if name in t.name]
    replayed = Schedule(task.mod)
    tvm.s_tir.schedule.Trace.apply_json_to_schedule(candidate.trace.as_json(remove_postproc=False), replayed)
    assert "vdpbf16ps" in _assembly(replayed.mod, ZEN4)


@pytest.mark.parametrize("target, expected", [
    (ZEN4, [VNNI_INTRIN, DPBF16PS_INTRIN]), (SAPPHIRE_RAPIDS, [VNNI_INTRIN, DPBF16PS_INTRIN]),
    (ICELAKE, [VNNI_INTRIN]), (ZEN3, []), (tvm.target.Target("cuda"), [])])
def test_which_targets_get_which_intrinsics(target, expected):
    assert dot_intrinsics(target) == expected
    assert (space_generator(target) == "post-order-apply") == (not expected)
