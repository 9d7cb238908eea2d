"""QLinearMatMul chains: our float32-products path vs our int8 kernels (VNNI, AMX) vs ONNX Runtime.

    TVM_NUM_THREADS=1 python benchmarks/bench_int8.py [--repeat 100] [--out benchmarks/results/int8.json]

Each model is a chain of QLinearMatMul pairs at transformer FFN shapes (``rows x hidden ->
4*hidden -> hidden``, uint8 activations, int8 per-channel weights), generated with fixed seeds.
The runs of each, in one process, interleaved round by round, medians:

    float   tvm_fusion with the integer sums as float32 products of whole numbers (what every
            quantized matmul ran as before the int8 kernel; ``INT8_KERNELS = False``)
    vnni    uint8 x int8 -> int32 sums on ``vpdpbusd`` (``Int8MatmulVnni``), AMX tiles off
            (``int8_matmul_amx.AMX_TILES = False``): where the target CPU has AVX512-VNNI
            (elsewhere the import keeps the float path)
    amx     tvm_fusion's default, only where the target CPU has AMX-INT8: the same sums on AMX
            tiles (``Int8MatmulAmx``) where the rows fill a tile, ``vpdpbusd`` elsewhere (M=1)
    ort     ONNX Runtime (CPUExecutionProvider, its default optimizations), same thread count

Every tvm_fusion output is checked equal to ONNX Runtime's, bit for bit, before timing.
Target: the default config's (this host's CPU). Threads: TVM_NUM_THREADS (default 2), and as
many for ONNX Runtime; the recorded results use 1, on a 2-core machine whose other core ran
other jobs (a TVM thread pool of 2 then waits on the busy core: field guide, section 14), so
they compare the kernels per core, not the machine's throughput.
"""

import argparse
import os

os.environ.setdefault("TVM_NUM_THREADS", "2")  # must precede the first TVM run

import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import tvm  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_fusion.config import host_cpu_name, load_config  # noqa: E402
from tvm_fusion.frontend import integer_matmul  # noqa: E402
from tvm_fusion.report import table, write_json  # noqa: E402
from tvm_fusion.schedules.cpu import int8_matmul_amx  # noqa: E402
from tvm_fusion.session import ModelSession  # noqa: E402
from tvm_fusion.kernels.cpu_features import has_amx_int8  # noqa: E402
from tvm_fusion.verify import onnxruntime_session, reference_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# name -> (rows, hidden, layers): BERT-tiny's FFN at sequence 128, one token (a decoder step),
# BERT-small's and BERT-base's FFN (weights of 1 MB and 2.3 MB: past the L2 share of a core),
# ViT-S/16's FFN at its 197 tokens (a prime row count: AMX tiles of 16 rows and a tail)
MODELS = {"ffn 128x256x1024, 2 layers": (128, 256, 2), "ffn 1x256x1024, 2 layers": (1, 256, 2),
          "ffn 128x512x2048, 1 layer": (128, 512, 1), "ffn 128x768x3072, 1 layer": (128, 768, 1),
          "ffn 197x384x1536, 1 layer": (197, 384, 1)}


def qlinear_chain(rows: int, hidden: int, layers: int) -> onnx.ModelProto:
    """x -> [QLinearMatMul hidden->4h, QLinearMatMul 4h->hidden] * layers, uint8 activations,
    int8 per-channel weights, output scales that keep the values spread."""
    rng = np.random.default_rng(0)
    nodes, inits, current, width = [], [], "x", hidden
    x_scale = 0.02
    inits.append(numpy_helper.from_array(np.float32(x_scale), "s0"))
    inits.append(numpy_helper.from_array(np.uint8(128), "z0"))
    for index in range(2 * layers):
        out_width = 4 * hidden if index % 2 == 0 else hidden
        w = rng.integers(-127, 128, (width, out_width), dtype=np.int8)
        w_scale = rng.uniform(0.002, 0.006, out_width).astype(np.float32)
        y_scale = np.float32(x_scale * 0.004 * 74 * 64 * np.sqrt(width) / 40)  # ~40 steps of spread
        names = [f"w{index}", f"sw{index}", f"zw{index}", f"s{index + 1}", f"z{index + 1}"]
        inits += [numpy_helper.from_array(w, names[0]), numpy_helper.from_array(w_scale, names[1]),
                  numpy_helper.from_array(np.zeros(out_width, np.int8), names[2]),
                  numpy_helper.from_array(y_scale, names[3]), numpy_helper.from_array(np.uint8(128), names[4])]
        output = f"y{index}" if index < 2 * layers - 1 else "y"
        nodes.append(helper.make_node("QLinearMatMul", [current, f"s{index}", f"z{index}", *names], [output],
                                      name=f"qmm{index}"))
        current, width, x_scale = output, out_width, float(y_scale)
    graph = helper.make_graph(nodes, "qlinear_chain", [helper.make_tensor_value_info("x", TensorProto.UINT8,
                                                                                     [rows, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [rows, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def build(path: Path, shape: str, int8: bool, amx: bool = True):
    """(VM, schedule rules) of tvm_fusion's build, the int8 kernel and AMX tiles on or off."""
    integer_matmul.INT8_KERNELS, int8_matmul_amx.AMX_TILES = int8, amx
    try:
        session = ModelSession(path, [shape])
        rules = session.scheduled().schedule_rules
        return relax.VirtualMachine(session.built(), tvm.cpu()), rules
    finally:
        integer_matmul.INT8_KERNELS, int8_matmul_amx.AMX_TILES = True, True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "int8.json"))
    args = parser.parse_args()
    threads = int(os.environ["TVM_NUM_THREADS"])
    tvm_target = load_config(None).tvm_target()
    target, amx = str(tvm_target), has_amx_int8(tvm_target)
    results = {"machine": {"cpu": host_cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
               "date": time.strftime("%Y-%m-%d"), "threads": threads, "target": target, "repeat": args.repeat,
               "models": {}}
    rows_out = []
    work = Path(tempfile.mkdtemp(prefix="bench_int8_"))
    for label, (rows, hidden, layers) in MODELS.items():
        model = qlinear_chain(rows, hidden, layers)
        path = work / f"chain_{rows}_{hidden}_{layers}.onnx"
        onnx.save(model, path)
        x = np.random.default_rng(1).integers(0, 256, (rows, hidden), dtype=np.uint8)
        expected = reference_outputs(model, {"x": x})["y"]
        shape = f"x:{rows}x{hidden}"
        builds = {"float": build(path, shape, False), "vnni": build(path, shape, True, amx=False)}
        if amx:
            builds["amx"] = build(path, shape, True)
        feeds = [tvm.runtime.tensor(x)]
        for name, (vm, _) in builds.items():
            np.testing.assert_array_equal(vm["main"](*feeds).numpy(), expected, err_msg=name)
        ort = onnxruntime_session(model, threads)
        runs = {name: (lambda vm=vm: vm["main"](*feeds)) for name, (vm, _) in builds.items()}
        runs["ort"] = lambda: ort.run(None, {"x": x})
        np.testing.assert_array_equal(runs["ort"]()[0], expected, err_msg="ort default")
        times = {name: [] for name in runs}
        for round_index in range(5 + args.repeat):  # 5 warm-up rounds
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if round_index >= 5:
                    times[name].append(time.perf_counter() - start)
        medians = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        macs = 2 * layers * rows * hidden * 4 * hidden
        best = "amx" if amx else "vnni"  # what tvm_fusion runs by default here
        results["models"][label] = {
            "rows_hidden_layers": [rows, hidden, layers], "median_ms": medians,
            "int8_over_float": medians[best] / medians["float"], "int8_over_ort": medians[best] / medians["ort"],
            "int8_gops": 2 * macs / medians[best] / 1e6,
            "schedules": {name: rules for name, (_, rules) in builds.items()}, "outputs_equal_to_ort": True}
        if amx:
            results["models"][label]["amx_over_vnni"] = medians["amx"] / medians["vnni"]
        rows_out.append([label, medians["float"], medians["vnni"], medians.get("amx", "-"), medians["ort"],
                         medians[best] / medians["float"], medians[best] / medians["ort"]])
    print(f"threads {threads}, target {target}, {args.repeat} interleaved rounds, medians; "
          f"outputs equal to ONNX Runtime's bit for bit")
    print(table(["model", "float ms", "vnni ms", "amx ms", "ort ms", "int8/float", "int8/ort"], rows_out))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
