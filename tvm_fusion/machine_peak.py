"""This machine's roofline: FMA throughput, DRAM bandwidth and L2 bandwidth, and the bf16 and
int8 dot products' throughput on AMX tiles (on AVX512_BF16 and AVX512-VNNI registers where there
are no tiles) where the target has them, measured once per machine class (the FMA peak again in
each process, keeping the best, and the register dot-product peaks with it when it rises).

``profile`` sets each kernel against the FMA and DRAM roofs, a bf16 kernel (``--precision
bf16``) against the AMX-BF16 and DRAM roofs (``compute_roof``): its products run as
``tdpbf16ps`` on AMX tiles, far above the float32 FMA roof; on a target without AMX-BF16,
against the AVX512_BF16 roof (``vdpbf16ps``, twice the FMAs' multiply-adds per instruction). An int8 kernel (a quantized
matmul's or conv's uint8 x int8 -> int32 sum) is set against the AMX-INT8 roof (``tdpbusd``),
or the AVX512-VNNI one (``vpdpbusd``) on a target without AMX-INT8, in integer operations per
second, not FLOPs. The L2 roof is for kernels whose
tasks work in cache, depthwise convs above all: they read each input value for 9-25
multiply-adds, in rows that their task has just brought into cache, so DRAM does not bound them
(``benchmarks/bench_cnn.py`` sets them against it). All are probed with TVM-compiled kernels
at the config's thread count (the code our kernels are, not a vendor's datasheet), and cached in
``~/.cache/tvm_fusion/peak-<target key>.v<PROBE_VERSION>.json``: the target key (``kind-mcpu-Nc``, as the tuning
store uses) names the machine class, so a cache never crosses machines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import relax
from tvm.script import tirx as T

from .config import PipelineConfig
from .report import write_json
from .session import through_pipeline
from .kernels.avx512_bf16 import DPBF16PS_LLVM, IMPORT_ANNOTATION, dpbf16ps
from .kernels.cpu_features import has_amx_bf16, has_amx_int8, has_avx512_bf16, has_vnni
from .targets.amx import request_amx_permission
from .targets.target_info import vector_lanes
from .tuning.store_contents import target_key

# Fresh probes on a busy machine undershoot, never overshoot: keep the best of a few runs.
# Part of the cache file's name: a changed probe measures afresh instead of reading the old numbers.
# 2: the FMA coefficients are constants (loaded from a buffer, they kept LLVM from holding the
# chains in registers: a load, store and two broadcasts per FMA, 2.5x under the real peak).
# 3: 20x the iterations: a 0.3 ms run measured the thread pool's wake-up as much as the FMAs
# (230-460 GFLOP/s from one process to the next here; 460-475 at 6 ms).
# 4: the L2 bandwidth probe.
# 5: the AMX-BF16 probe.
# 6: the AMX-INT8 probe (the AVX512-VNNI one without it).
# 7: the AVX512_BF16 probe (without AMX-BF16).
PROBE_VERSION = 7
PROBE_RUNS = 7
FASTER = 1.1  # an FMA probe this much above the cached one: the register dot probes are taken again
FMA_ACCUMULATORS = 12       # independent vector chains per thread: more than FMA latency x ports
FMA_ITERATIONS = 4_000_000
TRIAD_ELEMENTS = 16 * 1024 * 1024  # float32: 64 MiB per array, far beyond any L3 here
L2_SHARE = 4                  # each thread's two arrays fill a quarter of its L2: no eviction
L2_DEFAULT_BYTES = 256 * 1024  # where the OS does not say (the smallest L2 of recent x86 and Arm cores)
L2_BYTES_PER_RUN = 256 * 1024 * 1024  # per thread: a few milliseconds, far above the fork/join cost
AMX_ITERATIONS = 500_000   # 4 tile products each: tens of milliseconds, as the FMA probe
AMX_TILE_ROWS, AMX_TILE_BYTES = 16, 64  # the largest tile: 16 rows of 64 bytes (32 bf16, 64 int8, 16 float32)
VNNI_LANES = 16            # int32 sums per vpdpbusd, each adding 4 uint8 x int8 products
# The compute roofs a kernel can be set against, by what its sum multiplies (``compute_roof``).
ROOF_KINDS = ("float32", "bf16", "int8")


@dataclasses.dataclass
class MachinePeak:
    target_key: str
    threads: int
    gflops: float          # float32 FMA throughput, all threads
    gbytes_per_s: float    # STREAM-like triad a = b + 3c, 3 arrays counted
    l2_gbytes_per_s: float  # x = 0.999 x + y on arrays in each thread's L2, 3 streams counted
    probed_at: str
    amx_bf16_gflops: float | None = None  # tdpbf16ps on AMX tiles, all threads; None: no AMX-BF16
    amx_int8_gops: float | None = None  # tdpbusd on AMX tiles (integer ops), all threads; None: no AMX-INT8
    # vpdpbusd (integer ops), all threads; probed only where the AMX-INT8 probe gave none
    vnni_int8_gops: float | None = None
    # vdpbf16ps, all threads; probed only where the AMX-BF16 probe gave none
    avx512_bf16_gflops: float | None = None

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the two roofs meet."""
        return self.gflops / self.gbytes_per_s

    def compute_roof(self, kind: str = "float32") -> tuple[str, float]:
        """(name, GFLOP/s or GOP/s) of the compute roof a kernel is set against, by ``kind``
        (``ROOF_KINDS``): one that sums bf16 products against the AMX-BF16 peak (AVX512_BF16's
without AMX-BF16), one that sums
        uint8 x int8 products against the AMX-INT8 peak (AVX512-VNNI's without AMX-INT8), where
        probed: their instructions run far above the float32 FMAs. The FMA peak otherwise."""
        if kind not in ROOF_KINDS:
            raise ValueError(f"no compute roof for {kind!r}: one of {', '.join(ROOF_KINDS)}")
        if kind == "bf16" and self.amx_bf16_gflops:
            return "AMX-BF16", self.amx_bf16_gflops
        if kind == "bf16" and self.avx512_bf16_gflops:
            return "AVX512_BF16", self.avx512_bf16_gflops
        if kind == "int8" and self.amx_int8_gops:
            return "AMX-INT8", self.amx_int8_gops
        if kind == "int8" and self.vnni_int8_gops:
            return "AVX512-VNNI", self.vnni_int8_gops
        return "FMA", self.gflops

    def dot_product_roofs(self) -> str:
        """The probed bf16 and int8 peaks as the headers of ``bench`` and ``profile`` list them
        (after the FMA peak): ``""`` where none was probed."""
        roofs = [(self.amx_bf16_gflops, "GFLOP/s AMX-BF16"), (self.avx512_bf16_gflops, "GFLOP/s AVX512_BF16"),
                 (self.amx_int8_gops, "GOP/s AMX-INT8"), (self.vnni_int8_gops, "GOP/s AVX512-VNNI")]
        return "".join(f", {value:.0f} {name}" for value, name in roofs if value)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvm_fusion"


# (target key, threads) -> peaks already read or probed by this process: every bench and
# profile call carries them, and none should pay for them twice.
_IN_PROCESS: dict[tuple[str, int], MachinePeak] = {}


def machine_peak(config: PipelineConfig, refresh: bool = False) -> MachinePeak:
    """The cached peaks for the config's target (probing and caching them the first time)."""
    key = target_key(config.tvm_target())
    if not refresh and (key, config.threads) in _IN_PROCESS:
        return _IN_PROCESS[key, config.threads]
    path = cache_dir() / f"peak-{key}.v{PROBE_VERSION}.json"
    cached = None if refresh else _read_cache(path, config.threads)
    if cached is not None:
        # A probe taken while other work shared the cores undershoots, and a cache would keep
        # it for good. The FMA probe costs about 0.1 s, so each process takes it again; the
        # best one stays.
        fma = probe_fma(config)
        if fma <= cached.gflops:
            return _IN_PROCESS.setdefault((key, config.threads), cached)
        peak = dataclasses.replace(cached, gflops=fma, probed_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                                   **(_register_dots_again(config, cached) if fma > FASTER * cached.gflops else {}))
    else:
        amx_bf16, amx_int8 = probe_amx_bf16(config), probe_amx_int8(config)
        peak = MachinePeak(key, config.threads, probe_fma(config), probe_triad(config), probe_l2(config),
                           time.strftime("%Y-%m-%dT%H:%M:%S"), amx_bf16, amx_int8,
                           None if amx_int8 else probe_vnni_int8(config),
                           None if amx_bf16 else probe_avx512_bf16(config))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, dataclasses.asdict(peak), flag="$XDG_CACHE_HOME")
    _IN_PROCESS[key, config.threads] = peak
    return peak


def _register_dots_again(config: PipelineConfig, cached: MachinePeak) -> dict:
    """The register-chain dot-product peaks (``vpdpbusd``, ``vdpbf16ps``) probed again, each
    the best of the new and the cached: the FMA probe found the host faster than when they were
    cached, so they undershoot too (a host here ran at half speed for an hour). They cost about
    as little as the FMA probe; the AMX probes are left as they are."""
    again = {}
    for field, probe in (("vnni_int8_gops", probe_vnni_int8), ("avx512_bf16_gflops", probe_avx512_bf16)):
        if getattr(cached, field):
            again[field] = max(getattr(cached, field), probe(config) or 0.0)
    return again


def _read_cache(path: Path, threads: int) -> MachinePeak | None:
    """The cached peaks at ``threads``; None when there are none (or the file is damaged: it is
    probed again and rewritten)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return MachinePeak(**data) if data.get("threads") == threads else None
    except (ValueError, TypeError):
        return None


def probe_fma(config: PipelineConfig) -> float:
    """GFLOP/s of independent vector FMA chains held in registers, one per thread."""
    target = config.tvm_target()
    lanes = vector_lanes(target, "float32")
    threads, accs, iters = config.threads, FMA_ACCUMULATORS, FMA_ITERATIONS
    vector = f"float32x{lanes}"

    # Constant coefficients (x -> 0.999 x + 0.001 converges, never overflows): read from a
    # buffer, they would be reloaded before every FMA, and the chains spilled around them.
    @T.prim_func
    def fma(out: T.Buffer((threads, accs * lanes), "float32")):
        for p in T.parallel(threads):
            acc = T.alloc_buffer((accs,), vector, scope="local")
            for a in T.unroll(accs):
                acc[a] = T.Broadcast(T.Cast("float32", a), lanes)
            for _ in range(iters):
                for a in T.unroll(accs):
                    acc[a] = T.fma(acc[a], T.Broadcast(T.float32(0.999), lanes),
                                   T.Broadcast(T.float32(0.001), lanes))
            for a in T.unroll(accs):
                out[p, T.Ramp(a * lanes, 1, lanes)] = acc[a]

    library = tvm.compile(tvm.IRModule({"main": fma}), target=target)
    out = tvm.runtime.tensor(np.zeros((threads, accs * lanes), "float32"))
    best = _best_seconds(lambda: library["main"](out))
    return 2.0 * threads * accs * lanes * iters / best / 1e9


def probe_triad(config: PipelineConfig) -> float:
    """GB/s of ``a = b + 3c`` compiled by our pipeline (parallel, vectorized) on 64 MiB arrays."""
    b, c = (relax.Var(n, relax.TensorType((TRIAD_ELEMENTS,), "float32")) for n in "bc")
    builder = relax.BlockBuilder()
    with builder.function("main", [b, c]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.add(b, relax.op.multiply(c, relax.const(3.0, "float32"))))
        builder.emit_func_output(out)
    module = through_pipeline(builder.get(), dataclasses.replace(config, patterns=()))
    vm = relax.VirtualMachine(tvm.compile(module, target=config.tvm_target()), tvm.cpu())
    arrays = [tvm.runtime.tensor(np.ones(TRIAD_ELEMENTS, "float32")) for _ in range(2)]
    best = _best_seconds(lambda: vm["main"](*arrays))
    return 3 * TRIAD_ELEMENTS * 4 / best / 1e9


def probe_l2(config: PipelineConfig) -> float:
    """GB/s of ``x = 0.999 x + y`` (2 loads and a store per element, vectorized) over arrays
    that fill a quarter of each thread's L2, swept again and again: each sweep reads what the
    last wrote, so no sweep can be skipped."""
    lanes = vector_lanes(config.tvm_target(), "float32")
    threads = config.threads
    elements = max(lanes, l2_bytes() // L2_SHARE // 8 // lanes * lanes)  # two float32 arrays
    sweeps = max(1, L2_BYTES_PER_RUN // (12 * elements))

    @T.prim_func
    def sweep(x: T.Buffer((threads, elements), "float32"), y: T.Buffer((threads, elements), "float32")):
        for p in T.parallel(threads):
            for _ in range(sweeps):
                for i in range(elements // lanes):
                    for lane in T.vectorized(lanes):
                        x[p, i * lanes + lane] = x[p, i * lanes + lane] * T.float32(0.999) + y[p, i * lanes + lane]

    library = tvm.compile(tvm.IRModule({"main": sweep}), target=config.tvm_target())
    x, y = (tvm.runtime.tensor(np.ones((threads, elements), "float32")) for _ in range(2))
    best = _best_seconds(lambda: library["main"](x, y))
    return 12.0 * threads * elements * sweeps / best / 1e9


def probe_amx_bf16(config: PipelineConfig) -> float | None:
    """GFLOP/s of ``tdpbf16ps`` (C += A x B on 16 x 32 bf16 tiles into 16 x 16 float32); None
    where the target has no AMX-BF16 or Linux does not grant this process the tile state."""
    if not has_amx_bf16(config.tvm_target()):
        return None
    # bf16 0x3A83 is about 0.001: the sums grow by 3.2e-5 per product, far from overflow.
    return _probe_amx_tiles(config, "llvm.x86.tdpbf16ps", "uint16", 0x3A83, "float32")


def probe_amx_int8(config: PipelineConfig) -> float | None:
    """GOP/s (a multiply and an add per product) of ``tdpbusd`` (C += A x B on a 16 x 64 uint8
    tile by a 64 x 16 int8 one into 16 x 16 int32); None where the target has no AMX-INT8 or
    Linux does not grant this process the tile state."""
    if not has_amx_int8(config.tvm_target()):
        return None
    # Ones: each sum grows by 64 per product, 3.2e7 in all, far from int32's overflow.
    return _probe_amx_tiles(config, "llvm.x86.tdpbusd", "int8", 1, "int32")


def _probe_amx_tiles(config: PipelineConfig, instruction: str, operand_dtype: str, operand_value: int,
                     sum_dtype: str) -> float | None:
    """GFLOP/s or GOP/s (a multiply and an add per product) of the AMX tile product
    ``instruction`` with four independent accumulator tiles per thread, each product's latency
    hidden behind the other three; None where Linux does not grant this process the tile state."""
    if not request_amx_permission():
        return None
    target = config.tvm_target()
    threads, iters, rows, width = config.threads, AMX_ITERATIONS, AMX_TILE_ROWS, AMX_TILE_BYTES
    depth = width // np.dtype(operand_dtype).itemsize  # operands per tile row: the product's k
    # ldtilecfg's 64 bytes: palette 1, then every tile (0-3 the sums, 4-7 the operands) full size.
    layout = bytearray(64)
    layout[0] = 1
    for index in range(8):
        layout[16 + 2 * index:18 + 2 * index] = width.to_bytes(2, "little")
        layout[48 + index] = rows
    tile_config = np.frombuffer(bytes(layout), "int64")

    @T.macro
    def load(tile: int, address):
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(tile), address, T.int64(width)))

    @T.macro
    def product(c: int, a: int, b: int):
        T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(c), T.int8(a), T.int8(b)))

    @T.prim_func
    def products(layout: T.Buffer((8,), "int64"), operands: T.Buffer((threads, 2, rows, depth), operand_dtype),
                 sums: T.Buffer((threads, 4, rows, width // 4), sum_dtype)):
        for p in T.parallel(threads):
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(layout[0])))
            for c in T.unroll(4):
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(c)))
            load(4, T.address_of(operands[p, 0, 0, 0]))  # A tiles 4 and 7, B tiles 5 and 6
            load(5, T.address_of(operands[p, 1, 0, 0]))
            load(6, T.address_of(operands[p, 1, 0, 0]))
            load(7, T.address_of(operands[p, 0, 0, 0]))
            for _ in range(iters):
                product(0, 4, 5)
                product(1, 4, 6)
                product(2, 7, 5)
                product(3, 7, 6)
            for c in T.unroll(4):
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(c),
                                              T.address_of(sums[p, c, 0, 0]), T.int64(width)))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    library = tvm.compile(tvm.IRModule({"main": products}), target=target)
    args = [tvm.runtime.tensor(tile_config),
            tvm.runtime.tensor(np.full((threads, 2, rows, depth), operand_value, operand_dtype)),
            tvm.runtime.tensor(np.zeros((threads, 4, rows, width // 4), sum_dtype))]
    best = _best_seconds(lambda: library["main"](*args))
    m, n, k = rows, width // 4, depth  # one product: an m x k tile by a k x n one
    return 4 * 2.0 * m * n * k * threads * iters / best / 1e9


def probe_vnni_int8(config: PipelineConfig) -> float | None:
    """GOP/s (a multiply and an add per product) of independent ``vpdpbusd`` chains held in
    registers, one per thread: each adds 4 uint8 x int8 products into each of 16 int32 lanes.
    None where the target has no AVX512-VNNI."""
    if not has_vnni(config.tvm_target()):
        return None
    # Ones: each lane grows by 4 per instruction, 1.6e7 in all, far from int32's overflow.
    ones = T.Broadcast(T.int8(1), 4 * VNNI_LANES)
    return _probe_register_chains(config, "int32", 4, lambda sums: T.call_llvm_pure_intrin(
        f"int32x{VNNI_LANES}", "llvm.x86.avx512.vpdpbusd.512", sums, ones, ones))


def probe_avx512_bf16(config: PipelineConfig) -> float | None:
    """GFLOP/s of independent ``vdpbf16ps`` chains held in registers, one per thread: each adds
    2 bf16 x bf16 products into each of 16 float32 lanes. None where the target has no
    AVX512_BF16."""
    if not has_avx512_bf16(config.tvm_target()):
        return None
    # A pair of bf16 0x3A83 (about 0.001) in each lane: the sums grow by 2e-6 per instruction,
    # far from overflow.
    pairs = T.Broadcast(T.int32(0x3A833A83), VNNI_LANES)
    return _probe_register_chains(config, "float32", 2, lambda sums: dpbf16ps(sums, pairs, pairs),
                                  {IMPORT_ANNOTATION: DPBF16PS_LLVM})


def _probe_register_chains(config: PipelineConfig, sum_dtype: str, products: int, step,
                           annotations: dict | None = None) -> float:
    """GOP/s or GFLOP/s (a multiply and an add per product) of ``FMA_ACCUMULATORS`` independent
    chains of ``sums = step(sums)``, each a vector of ``VNNI_LANES`` ``sum_dtype`` lanes plus
    ``products`` products a lane, held in registers, one set per thread; ``annotations`` on the
    thread loop (the LLVM IR ``step`` calls). The operands are constants, as the FMA probe's
    coefficients: loaded from a buffer, they were kept in memory and the sums stored back after
    every instruction."""
    target = config.tvm_target()
    threads, accs, iters, lanes = config.threads, FMA_ACCUMULATORS, FMA_ITERATIONS, VNNI_LANES
    zeros = T.Broadcast(tvm.tirx.const(0, sum_dtype), lanes)

    @T.prim_func
    def dots(out: T.Buffer((threads, accs * lanes), sum_dtype)):
        for p in T.parallel(threads, annotations=annotations or {}):
            acc = T.alloc_buffer((accs,), f"{sum_dtype}x{lanes}", scope="local")
            for a in T.unroll(accs):
                acc[a] = zeros
            for _ in range(iters):
                for a in T.unroll(accs):
                    acc[a] = step(acc[a])
            for a in T.unroll(accs):
                out[p, T.Ramp(a * lanes, 1, lanes)] = acc[a]

    library = tvm.compile(tvm.IRModule({"main": dots}), target=target)
    out = tvm.runtime.tensor(np.zeros((threads, accs * lanes), sum_dtype))
    best = _best_seconds(lambda: library["main"](out))
    return 2.0 * products * lanes * threads * accs * iters / best / 1e9


def l2_bytes() -> int:
    """The first CPU's L2 size from sysfs (Linux); ``L2_DEFAULT_BYTES`` where it is not there."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip()
                units = {"K": 1024, "M": 1024 * 1024}
                return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            break
    return L2_DEFAULT_BYTES


def _best_seconds(run) -> float:
    run()
    samples = []
    for _ in range(PROBE_RUNS):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return min(samples)
