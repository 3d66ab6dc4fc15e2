"""Devices for the roofline: what an accelerator (or this CPU) can do.

`DeviceSpec` holds the achievable FLOP/s and bandwidths the roofline charges kernels at
(`av_jax.costs.roofline`); `DEVICES` the named accelerators (vendor peaks, fractions
measured on an H200); `cpu_spec` this machine's CPU, measured by start-up
microbenchmarks (`measure_cpu`). `knee_tokens` is the packed-token count where a dense
pass turns from memory- to compute-bound. Units as in `av_jax.costs`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "float8": 1.0, "int8": 1.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
  """What one accelerator (or this CPU) can do, for the roofline.

  Achievable rates are `peak x fraction`: vendor peaks are never reached by real kernels,
  and the fractions say by how much, from a measurement where one exists.
  """
  name: str                        # registry name ("h200", "cpu", ...)
  peak_flops: Mapping[str, float]  # dtype -> dense matmul FLOP/s (vendor peak, or measured)
  memory_bandwidth: float          # bytes/s, main memory (HBM, DRAM) streaming reads
  flops_fraction: float = 1.0      # achievable fraction of peak_flops for large matmuls
  bandwidth_fraction: float = 1.0  # achievable fraction of memory_bandwidth
  write_bandwidth: float | None = None  # bytes/s of streaming writes; None: memory_bandwidth
  # Elements/s of a gather that also transposes (XLA:CPU's loop fusion for av_jax's
  # per-token cache gather, `Implementation.kv_reads == "per_token"`) by the size of the
  # buffer it writes: ((bytes, elements/s), ...), ascending sizes, log-interpolated and
  # clamped at the ends (a cache-resident output is written faster). Empty: the gather
  # streams at the bandwidth (charged by its bytes alone).
  gather_curve: tuple[tuple[float, float], ...] = ()
  # A program whose temporaries total at least `first_touch_threshold` bytes gets fresh
  # pages for them on every run (glibc serves allocations >= 32 MiB with mmap), and pays
  # their page faults: temporaries / `first_touch_bandwidth`. math.inf: never (device
  # allocators pool their buffers).
  first_touch_bandwidth: float = math.inf
  first_touch_threshold: float = math.inf
  step_overhead_s: float = 0.0     # fixed cost of launching one program (host dispatch)
  layer_overhead_s: float = 0.0    # per transformer layer of a program (kernel launches)
  source: str = ""                 # where every figure comes from

  def __post_init__(self):
    if not self.peak_flops:
      raise ValueError(f"peak_flops: expected at least one dtype, got {self.peak_flops!r}")
    for dtype, flops in self.peak_flops.items():
      _positive(f"peak_flops[{dtype!r}]", flops)
    _positive("memory_bandwidth", self.memory_bandwidth)
    _fraction("flops_fraction", self.flops_fraction)
    _fraction("bandwidth_fraction", self.bandwidth_fraction)
    if self.write_bandwidth is not None:
      _positive("write_bandwidth", self.write_bandwidth)
    for size, rate in self.gather_curve:
      _positive("gather_curve size", size)
      _positive("gather_curve rate", rate)
    if list(self.gather_curve) != sorted(self.gather_curve):
      raise ValueError(f"gather_curve: expected ascending sizes, got {self.gather_curve}")
    _positive("first_touch_bandwidth", self.first_touch_bandwidth)
    _positive("first_touch_threshold", self.first_touch_threshold)
    _non_negative("step_overhead_s", self.step_overhead_s)
    _non_negative("layer_overhead_s", self.layer_overhead_s)

  def flops(self, dtype: str) -> float:
    """Achievable matmul FLOP/s in `dtype`."""
    if dtype not in self.peak_flops:
      raise ValueError(f"dtype: device {self.name!r} has no peak FLOP/s for {dtype!r}; "
                       f"known: {sorted(self.peak_flops)}")
    return self.peak_flops[dtype] * self.flops_fraction

  @property
  def read_rate(self) -> float:
    """Achievable bytes/s of streaming reads."""
    return self.memory_bandwidth * self.bandwidth_fraction

  @property
  def write_rate(self) -> float:
    """Achievable bytes/s of streaming writes to main memory."""
    write = self.memory_bandwidth if self.write_bandwidth is None else self.write_bandwidth
    return write * self.bandwidth_fraction

  def gather_rate(self, block_bytes: float) -> float:
    """Elements/s of a transposing gather writing `block_bytes` (inf: no curve)."""
    if not self.gather_curve:
      return math.inf
    sizes = np.log([size for size, _ in self.gather_curve])
    rates = np.log([rate for _, rate in self.gather_curve])
    return float(np.exp(np.interp(math.log(max(block_bytes, 1.0)), sizes, rates)))


def _positive(name: str, value: float) -> None:
  if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
    raise ValueError(f"{name}: expected a positive number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
  if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
    raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")


def _fraction(name: str, value: float) -> None:
  if not (isinstance(value, (int, float)) and 0 < value <= 1):
    raise ValueError(f"{name}: expected a fraction in (0, 1], got {value!r}")


# Measured on this workplace's lent H200 (the device tool's KINDS.md): an 8192^3 bf16
# matmul at 769-798 TFLOP/s and a device-to-device copy at ~4.3 TB/s (read + write).
_H200_MATMUL_FLOPS = 784e12   # mid-range of 769-798 TFLOP/s
_H200_COPY_BYTES_S = 4.3e12   # read + write bytes per second of a large copy
_VENDOR_HOPPER_BF16 = 989e12  # dense bf16 (no sparsity), H100 SXM and H200
_HOPPER_FLOPS_FRACTION = _H200_MATMUL_FLOPS / _VENDOR_HOPPER_BF16
_HOPPER_BANDWIDTH_FRACTION = _H200_COPY_BYTES_S / 4.8e12
# Accelerator launch overheads are assumptions, not measurements: one host dispatch of a
# jitted program, and ~4 fused kernels per decoder layer at ~2.5 us each (XLA:GPU/TPU).
_ASSUMED_STEP_OVERHEAD_S = 50e-6
_ASSUMED_LAYER_OVERHEAD_S = 10e-6

DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        name="h100", peak_flops={"bfloat16": _VENDOR_HOPPER_BF16, "float32": 67e12},
        memory_bandwidth=3.35e12, flops_fraction=_HOPPER_FLOPS_FRACTION,
        bandwidth_fraction=_HOPPER_BANDWIDTH_FRACTION,
        step_overhead_s=_ASSUMED_STEP_OVERHEAD_S, layer_overhead_s=_ASSUMED_LAYER_OVERHEAD_S,
        source="NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 3.35 TB/s "
               "HBM3. Achievable fractions assumed equal to the H200's measured ones (same "
               "GH100 die): 0.79 of peak FLOP/s, 0.90 of bandwidth. Overheads assumed."),
    "h200": DeviceSpec(
        name="h200", peak_flops={"bfloat16": _VENDOR_HOPPER_BF16, "float32": 67e12},
        memory_bandwidth=4.8e12, flops_fraction=_HOPPER_FLOPS_FRACTION,
        bandwidth_fraction=_HOPPER_BANDWIDTH_FRACTION,
        step_overhead_s=_ASSUMED_STEP_OVERHEAD_S, layer_overhead_s=_ASSUMED_LAYER_OVERHEAD_S,
        source="NVIDIA H200 SXM datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e. Fractions "
               "measured on this workplace's lent H200: 8192^3 bf16 matmul 769-798 TFLOP/s "
               "(784 used: 0.79 of peak), device-to-device copy ~4.3 TB/s read + write (0.90 "
               "of 4.8 TB/s). Overheads assumed."),
    "tpu-v5e": DeviceSpec(
        name="tpu-v5e", peak_flops={"bfloat16": 197e12}, memory_bandwidth=819e9,
        flops_fraction=_HOPPER_FLOPS_FRACTION, bandwidth_fraction=_HOPPER_BANDWIDTH_FRACTION,
        step_overhead_s=_ASSUMED_STEP_OVERHEAD_S, layer_overhead_s=_ASSUMED_LAYER_OVERHEAD_S,
        source="Google Cloud TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM2e per chip. Achievable "
               "fractions assumed equal to the H200's measured ones (no TPU measured). "
               "Overheads assumed."),
    "tpu-v6e": DeviceSpec(
        name="tpu-v6e", peak_flops={"bfloat16": 918e12}, memory_bandwidth=1.64e12,
        flops_fraction=_HOPPER_FLOPS_FRACTION, bandwidth_fraction=_HOPPER_BANDWIDTH_FRACTION,
        step_overhead_s=_ASSUMED_STEP_OVERHEAD_S, layer_overhead_s=_ASSUMED_LAYER_OVERHEAD_S,
        source="Google Cloud TPU v6e (Trillium): 918 TFLOP/s bf16, 1.64 TB/s HBM per chip. "
               "Achievable fractions assumed equal to the H200's measured ones (no TPU "
               "measured). Overheads assumed."),
}
DEVICE_NAMES = tuple(DEVICES) + ("cpu",)


class CpuMeasurement(NamedTuple):
  """The raw microbenchmark results behind the `cpu` spec."""
  matmul_flops: float    # FLOP/s of a jitted float32 N x N matmul
  small_bytes: int       # an array below the first-touch threshold ...
  small_read_s: float    # ... its sum (reads only), seconds
  small_copy_s: float    # ... its copy (reads + writes into reused pages), seconds
  large_bytes: int       # an array above the threshold (fresh pages every run) ...
  large_read_s: float    # ... its sum, seconds
  large_copy_s: float    # ... its copy (reads + writes + page faults), seconds
  gather_bytes: tuple[int, ...]  # outputs of transposing gathers, ascending bytes ...
  gather_s: tuple[float, ...]    # ... their times, seconds
  dispatch_s: float      # seconds of one jitted call on a 4-element array
  matmul_n: int          # N of the matmul


# The start-up microbenchmarks: a matmul big enough to reach XLA:CPU's full GEMM rate; sums
# and copies of a 16 MiB and a 64 MiB array (either side of glibc's 32 MiB mmap
# threshold, twice the 32 MiB L3); and a gather of a [16, 512, 6, 32] float32 cache into
# [40, 6, 32, 512] (15 MiB), the layout av_jax's packed attention gathers into. One gather
# size: adding a cache-resident one (T = 4, 1.5 MiB, 2.6x faster per element) made the
# `tiny` target's prediction worse (0.38-0.70 of measured), whose time is not the gather's.
CPU_MATMUL_N = 1024
CPU_SMALL_BYTES = 16 * 2**20
CPU_LARGE_BYTES = 64 * 2**20
CPU_GATHER = dict(slots=16, positions=512, heads=6, head_dim=32, tokens=(40,))
CPU_REPEATS = 3
# glibc's largest dynamic mmap threshold on 64-bit Linux (DEFAULT_MMAP_THRESHOLD_MAX):
# allocations at least this large are mapped fresh, and fault on first touch, every run.
GLIBC_MMAP_THRESHOLD = 32 * 2**20


# Each microbenchmark runs at least this long, and reports the median run, the statistic
# the engine's profile takes: on a shared machine more runs give a steadier median.
CPU_MIN_SECONDS = 0.3


def _median_s(fn, *args, repeats: int, min_seconds: float = CPU_MIN_SECONDS) -> float:
  """Median seconds of `fn(*args)` over at least `repeats` runs and `min_seconds`."""
  jax.block_until_ready(fn(*args))  # compile + warm-up
  times, start = [], time.perf_counter()
  while len(times) < repeats or time.perf_counter() - start < min_seconds:
    run = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - run)
  return float(np.median(times))


def measure_cpu(*, matmul_n: int = CPU_MATMUL_N, small_bytes: int = CPU_SMALL_BYTES,
                large_bytes: int = CPU_LARGE_BYTES, gather: Mapping[str, int] = CPU_GATHER,
                repeats: int = CPU_REPEATS, min_seconds: float = CPU_MIN_SECONDS
                ) -> CpuMeasurement:
  """Microbenchmarks of the default JAX device (medians over >= `repeats` jitted runs and
  `min_seconds`).

  A float32 matmul (FLOP/s); a sum (reads) and a copy (reads + writes) of an array below
  and one above the first-touch threshold; a transposing gather (elements/s); one tiny
  jitted call (dispatch).
  """
  a = jnp.ones((matmul_n, matmul_n), jnp.float32)
  matmul_s = _median_s(jax.jit(jnp.matmul), a, a, repeats=repeats, min_seconds=min_seconds)
  total, copy = jax.jit(jnp.sum), jax.jit(lambda x: x * 2.0)
  timed = []
  for size in (small_bytes, large_bytes):
    x = jnp.ones((size // 4,), jnp.float32)
    timed += [_median_s(total, x, repeats=repeats, min_seconds=min_seconds), _median_s(copy, x, repeats=repeats, min_seconds=min_seconds)]
    del x
  cache = jnp.ones((gather["slots"], gather["positions"], gather["heads"], gather["head_dim"]))
  gather_fn = jax.jit(lambda c, s: jnp.transpose(c[s], (0, 2, 3, 1)))
  gather_bytes, gather_s = [], []
  for tokens in sorted(gather["tokens"]):
    slot = jnp.arange(tokens) % gather["slots"]
    gather_bytes.append(tokens * int(np.prod(cache.shape[1:])) * 4)
    gather_s.append(_median_s(gather_fn, cache, slot, repeats=repeats, min_seconds=min_seconds))
  tiny = jnp.ones((4,), jnp.float32)
  dispatch_s = _median_s(jax.jit(lambda x: x + 1.0), tiny, repeats=repeats * 8,
                       min_seconds=min_seconds)
  return CpuMeasurement(
      matmul_flops=2.0 * matmul_n**3 / matmul_s, small_bytes=small_bytes,
      small_read_s=timed[0], small_copy_s=timed[1], large_bytes=large_bytes,
      large_read_s=timed[2], large_copy_s=timed[3],
      gather_bytes=tuple(gather_bytes), gather_s=tuple(gather_s),
      dispatch_s=dispatch_s, matmul_n=matmul_n)


def cpu_spec_from(measured: CpuMeasurement) -> DeviceSpec:
  """The `cpu` `DeviceSpec` of a measurement (all fractions 1: the rates are achieved ones).

  A copy of n bytes reads n and writes n: below the threshold `copy_s = read_s + n /
  write`, above it the page faults add `n / first_touch`. Each rate is what remains of
  its copy's time (floored at a quarter of the copy, so noise cannot make a term free).
  On this workplace's virtual 2-core EPYC the page faults cost ~30x the writes: a
  program with large temporaries pays more for touching them than for anything else.
  """
  n, big = measured.small_bytes, measured.large_bytes
  write_s = max(measured.small_copy_s - measured.small_read_s, measured.small_copy_s / 4)
  write = n / write_s
  fault_s = max(measured.large_copy_s - measured.large_read_s - big / write,
                measured.large_copy_s / 4)
  read = big / measured.large_read_s
  curve = tuple((float(n), n / 4 / t) for n, t in zip(measured.gather_bytes, measured.gather_s))
  rates = ", ".join(f"{n / 2**20:.1f} MiB {rate / 1e9:.2f}" for n, rate in curve)
  return DeviceSpec(
      name="cpu", peak_flops={"float32": measured.matmul_flops}, memory_bandwidth=read,
      write_bandwidth=write, gather_curve=curve, first_touch_bandwidth=big / fault_s,
      first_touch_threshold=GLIBC_MMAP_THRESHOLD, step_overhead_s=measured.dispatch_s,
      source=(f"measured at start-up on {jax.devices()[0].device_kind} (jax "
              f"{jax.__version__}): float32 {measured.matmul_n}^3 matmul "
              f"{measured.matmul_flops / 1e9:.1f} GFLOP/s; reads {read / 1e9:.1f} GB/s "
              f"(sum over {big >> 20} MiB); writes {write / 1e9:.1f} GB/s (copy of "
              f"{n >> 20} MiB); first touch {big / fault_s / 1e9:.2f} GB/s (copy of "
              f"{big >> 20} MiB, fresh pages); transposing gather G elements/s by output "
              f"size: {rates}; dispatch {measured.dispatch_s * 1e6:.1f} us"))


@functools.lru_cache(maxsize=1)
def _cached_cpu_spec() -> DeviceSpec:
  return cpu_spec_from(measure_cpu())


def cpu_spec(*, refresh: bool = False) -> DeviceSpec:
  """The measured `cpu` spec, measured once per process (`refresh` re-measures)."""
  if refresh:
    _cached_cpu_spec.cache_clear()
  return _cached_cpu_spec()


def get_device(name: str | DeviceSpec) -> DeviceSpec:
  """A `DeviceSpec` by name (`DEVICE_NAMES`); `cpu` is measured on first use.

  Raises:
    ValueError: an unknown name, listing the known ones.
  """
  if isinstance(name, DeviceSpec):
    return name
  if name == "cpu":
    return cpu_spec()
  if name not in DEVICES:
    raise ValueError(f"device: unknown device {name!r}; known: {list(DEVICE_NAMES)}")
  return DEVICES[name]


def knee_tokens(device: str | DeviceSpec, *, dtype: str = "bfloat16",
                bytes_per_param: float | None = None, achievable: bool = True) -> float:
  """Packed tokens per step where a dense pass turns from memory- to compute-bound.

  Reading P params costs P b / bandwidth; T tokens cost 2 P T / FLOP/s; they are equal at
  `T* = FLOP/s / bandwidth x b / 2`, independent of the model's size.

  Args:
    device: a device name or spec.
    dtype: the matmul dtype (picks the peak FLOP/s).
    bytes_per_param: b; default the dtype's width.
    achievable: use achievable rates (peak x fraction); False: vendor peaks.

  Returns:
    T* in tokens (H100 295, H200 206 for vendor bf16 peaks).
  """
  spec = get_device(device)
  b = DTYPE_BYTES[dtype] if bytes_per_param is None else bytes_per_param
  flops = spec.flops(dtype) if achievable else spec.flops(dtype) / spec.flops_fraction
  bandwidth = spec.read_rate if achievable else spec.memory_bandwidth
  return flops / bandwidth * b / 2.0
