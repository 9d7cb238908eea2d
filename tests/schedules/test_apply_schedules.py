"""ApplySchedules: every PrimFunc of a transformer block ends up scheduled, by the expected rule."""

import numpy as np
import tvm
from tvm import relax
from tvm.relax.op import add, divide, matmul, nn, permute_dims, reshape

import tvm_fusion.schedules as schedules_module
from tvm_fusion.schedules import ApplySchedules, ScheduleMemo, schedule_rules
from tvm_fusion.schedules.registry import builtin_cpu_rules

SEQ, HIDDEN, HEADS, FFN = 32, 64, 4, 128


def _bert_layer() -> tvm.IRModule:
    """One BERT encoder layer with constant weights, as Relax."""
    rng = np.random.default_rng(0)

    def weight(*shape):
        return relax.const((rng.standard_normal(shape) * 0.1).astype("float32"))

    def heads(t):
        return permute_dims(reshape(t, (1, SEQ, HEADS, HIDDEN // HEADS)), (0, 2, 1, 3))

    x = relax.Var("x", relax.TensorType((1, SEQ, HIDDEN), "float32"))
    mask = relax.Var("mask", relax.TensorType((1, 1, 1, SEQ), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, mask]):
        with bb.dataflow():
            q, k, v = (bb.emit(heads(add(matmul(x, weight(HIDDEN, HIDDEN)), weight(HIDDEN))))
                       for _ in range(3))
            scores = divide(matmul(q, permute_dims(k, (0, 1, 3, 2))), relax.const(4.0))
            probs = bb.emit(nn.softmax(add(scores, mask), axis=-1))
            context = reshape(permute_dims(matmul(probs, v), (0, 2, 1, 3)), (1, SEQ, HIDDEN))
            attn = add(add(matmul(context, weight(HIDDEN, HIDDEN)), weight(HIDDEN)), x)
            h = bb.emit(nn.layer_norm(attn, weight(HIDDEN), weight(HIDDEN), axes=[-1]))
            up = nn.gelu(add(matmul(h, weight(HIDDEN, FFN)), weight(FFN)))
            down = add(add(matmul(up, weight(FFN, HIDDEN)), weight(HIDDEN)), h)
            out = bb.emit_output(nn.layer_norm(down, weight(HIDDEN), weight(HIDDEN), axes=[-1]))
        bb.emit_func_output(out)
    return bb.get()


def test_leaves_no_primfunc_unscheduled(target):
    schedules = ApplySchedules(target)
    mod = tvm.transform.Sequential([relax.get_pipeline("zero"), schedules])(_bert_layer())
    prim_funcs = {gv.name_hint: f for gv, f in mod.functions_items()
                  if isinstance(f, tvm.tirx.PrimFunc)}
    assert prim_funcs
    assert all(f.attrs["tirx.is_scheduled"] for f in prim_funcs.values())
    assert set(schedules.applied) == set(prim_funcs)
    assert schedules.applied["softmax"] == "Softmax"
    assert schedules.applied["layer_norm"] == "Reduction"
    assert "MatmulEpilogue" in schedules.applied.values()
    assert "Injective" in schedules.applied.values()
    assert isinstance(mod["main"], relax.Function)


def test_scheduled_layer_matches_unscheduled(target):
    lowered = relax.get_pipeline("zero")(_bert_layer())
    scheduled = ApplySchedules(target)(lowered.clone())
    dev = tvm.cpu()
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((1, SEQ, HIDDEN)).astype("float32"),
              np.zeros((1, 1, 1, SEQ), "float32")]
    outputs = []
    for mod in (lowered, scheduled):
        vm = relax.VirtualMachine(tvm.compile(mod, target=target), dev)
        outputs.append(vm["main"](*[tvm.runtime.tensor(a, dev) for a in inputs]).numpy())
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


def test_skips_functions_already_scheduled(target, lowered, prim_funcs):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(8, 32))
    for gvar, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            mod[gvar] = func.with_attr("tirx.is_scheduled", True)
    schedules = ApplySchedules(target)
    schedules(mod)
    assert schedules.applied == {}


def test_rule_lists_per_target_family():
    cpu = schedule_rules(tvm.target.Target({"kind": "llvm"}))
    names = [type(r).__name__ for r in cpu]
    # Every rule class in schedules/cpu/ is found, each once; the general rules come last.
    assert sorted(names) == sorted({cls.__name__ for cls in map(type, builtin_cpu_rules())})
    assert names[-3:] == ["Reduction", "Injective", "Fallback"]
    assert names[0] == "WinogradConv2dNCHWc"  # runs_before = ("*",): asked before every other rule
    for index, rule in enumerate(cpu):
        for later in getattr(rule, "runs_before", ()):
            assert later == "*" or names.index(later) > index, (names[index], later)
    assert names.index("Attention") < names.index("Softmax")
    assert names.index("MatmulMultiOutput") < names.index("MatmulEpilogue")
    assert names.index("SqueezeExcitation") < names.index("Pooling")
    cuda = schedule_rules(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    names = [type(r).__name__ for r in cuda]  # ours (schedules/gpu/) first, then dlight's, Fallback last
    assert names[:3] == ["WarpNorm", "WarpSoftmax", "Matmul"] and names[-1] == "Fallback"


def _asked(monkeypatch) -> list:
    """The kernels the rules are asked about (the memo answers the rest)."""
    asked: list = []
    original = schedules_module._schedule_kernel
    monkeypatch.setattr(schedules_module, "_schedule_kernel",
                        lambda func, target: asked.append(func) or original(func, target))
    return asked


def test_a_memo_answers_for_a_kernel_scheduled_before_under_the_name_asked(target, monkeypatch):
    """The fusion gate's, the bf16 gate's and the final build schedule the same kernels again:
    the second time the rules are not asked, and each kernel keeps its own name."""
    asked, memo = _asked(monkeypatch), ScheduleMemo()
    lowered = relax.get_pipeline("zero")(_bert_layer())
    first = ApplySchedules(target, memo=memo)(lowered)
    kernels = [func for func in lowered.functions.values() if isinstance(func, tvm.tirx.PrimFunc)]
    assert len(asked) == len(kernels) > 3
    asked.clear()
    again = ApplySchedules(target, memo=memo)(lowered)
    assert asked == []
    tvm.ir.assert_structural_equal(again, first)
    named = tvm.IRModule({tvm.ir.GlobalVar(name): lowered["softmax"].with_attr("global_symbol", name)
                          for name in ("first", "second")})
    answered = ApplySchedules(target, memo=memo)(named)
    assert asked == []  # the symbol aside, the softmax kernel scheduled first
    assert [answered[name].attrs["global_symbol"] for name in ("first", "second")] == ["first", "second"]
    tvm.ir.assert_structural_equal(answered["second"].without_attr("global_symbol"), first["softmax"])


def test_a_memo_asks_anew_under_other_rules(target, monkeypatch):
    asked, memo = _asked(monkeypatch), ScheduleMemo()
    lowered = relax.get_pipeline("zero")(_bert_layer())
    ApplySchedules(target, memo=memo)(lowered)
    asked.clear()
    original = schedules_module.rules_for_kind
    monkeypatch.setattr(schedules_module, "rules_for_kind", lambda kind: original(kind)[::-1])
    ApplySchedules(target, memo=memo)(lowered)
    assert len(asked) > 3
