"""Deployment step-cost models: verify and draft cost from a roofline, or a measured table.

AV's budget trades expected accepted tokens against the step-cost curve of the
deployment (spec section 4; `av_jax.selection.choose_budget`). On a GPU or TPU a
verification pass over T packed tokens reads the weights once and does 2 x params FLOPs
per token, so its cost is flat (memory-bound) until T reaches the roofline's knee

    T* = (peak FLOP/s / memory bandwidth) x bytes_per_param / 2,

about 295 tokens on an H100 SXM and 206 on an H200 in bf16 (vendor peaks: 989 TFLOP/s
against 3.35 and 4.8 TB/s), and per-token (compute-bound) beyond it. Serving-stack studies
of speculation policies separate the two halves of the problem the same way: acceptance
comes from real models, time from the deployment's cost curve (vLLM's adaptive
speculation profiles verify cost by target tokens and draft cost by requests; SmartSpec,
Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using
Goodput"). This module builds that curve for named devices and model shapes, labelled as
modelled, and loads a measured table (`benchmarks/accelerator.py`) in its place.

The model (`roofline_costs`). A program is a few kernels run in sequence: the dense
layers, attention, the output head, and the sampling of the [T, V] logits. Each kernel's
time is max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth): inside one kernel
arithmetic and memory traffic overlap, which is what makes the roofline flat. Kernels
run one after another, so their times add (the combination rule is "max within a
kernel, sum across kernels"; a single max over the whole step would assume attention's
KV-cache streaming hides under the dense matmuls, which no sequential schedule does, and
a plain sum of compute and memory time would double-count the overlap inside a matmul:
up to 2x at the knee). A fixed launch overhead per program and per layer is added.

The measured `cpu` spec adds two terms that XLA:CPU programs pay and accelerators do not
(both measured by start-up microbenchmarks, `measure_cpu`): a transposing gather runs at
its own elements/s (the `per_token` attention, which gathers each token's slot cache into
a transposed layout), and a program whose temporaries reach glibc's 32 MiB mmap threshold
page-faults them in on every run. `docs/costs.md` has the validation against the engine's
profile.

Units: seconds and bytes inside, milliseconds in the tables (the `CostModel` convention).
Dimension letters as elsewhere: B slots, K draft positions, V vocabulary, T packed
tokens, D model width, R active requests.

Example:
  >>> tables = roofline_costs("llama3-8b", "llama3-8b-eagle3", "h200",
  ...                         drafter_kind="autoregressive", num_slots=64, max_draft=8,
  ...                         context_len=2048)
  >>> tables.cost.verify_ms.shape  # [B (K + 1) + 1]
  (577,)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from av_jax.models.config import load_config
from av_jax.selection import CostModel, make_cost_model

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "float8": 1.0, "int8": 1.0}
DRAFTER_KINDS = ("autoregressive", "parallel")
# The shipped drafter kinds (av_jax.models.KINDS) and the published ones, by drafting mode.
_KIND_MODES = {"autoregressive": "autoregressive", "parallel": "parallel",
               "draft_lm": "autoregressive", "eagle": "autoregressive",
               "eagle3": "autoregressive", "mtp": "autoregressive", "block": "parallel",
               "block_head": "parallel", "dflash": "parallel"}
COST_TABLE_FORMAT = "av_jax-cost-table"
COST_TABLE_VERSION = 1
_S_TO_MS = 1e3


# ------------------------------------------------------------------------------ devices


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


# ------------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
  """The parts of a decoder-only transformer (or drafter) that set its step cost.

  Every layer is attention (q, k, v, o projections, grouped-query KV heads) plus a gated
  SwiGLU MLP (gate, up, down). RMSNorm gains (3 D-vectors per layer) are left out: under
  0.01% of the bytes. The input embedding is a gather of T rows per step, also left out;
  the output head (V x D) is read in full every step whether or not it is tied.
  """
  name: str                # registry name
  num_layers: int          # decoder layers
  d_model: int             # D, residual width
  mlp_dim: int             # gated MLP hidden width
  num_heads: int           # query heads
  num_kv_heads: int        # KV heads (grouped-query attention; = num_heads without it)
  head_dim: int            # width per head
  vocab_size: int          # rows of the output head (a drafter's reduced vocabulary)
  dtype: str = "bfloat16"  # matmul dtype: picks the device's peak FLOP/s
  bytes_per_param: float | None = None  # bytes per weight; None: the dtype's width
  kv_bytes: float | None = None         # bytes per KV-cache element; None: bytes_per_param
  tied_embedding: bool = False  # output head = input embedding (one V x D matrix stored)
  attn_input_dim: int | None = None  # width entering q/k/v (EAGLE-3: 2 D); None: D
  input_proj_dim: int = 0  # features projected to D before the layers (EAGLE fc: 2 D or 3 D)
  context_attention: bool = True  # attends to a KV cache of the context (False: a block
                                  # drafter that sees only the last target hidden state)
  head_rank: int = 0       # 0: a V x D output head; R > 0: a factored head D -> R -> V
                           # (av_jax's drafters with `head_rank`, R (D + V) weights)
  source: str = ""         # where the shape comes from

  def __post_init__(self):
    for field in ("num_layers", "d_model", "mlp_dim", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size"):
      value = getattr(self, field)
      if not (isinstance(value, (int, np.integer)) and value > 0):
        raise ValueError(f"{field}: expected a positive integer, got {value!r}")
    if self.dtype not in DTYPE_BYTES:
      raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                       f"got {self.num_kv_heads}")
    for field in ("bytes_per_param", "kv_bytes", "attn_input_dim"):
      if getattr(self, field) is not None:
        _positive(field, getattr(self, field))
    if self.input_proj_dim < 0:
      raise ValueError(f"input_proj_dim: expected >= 0, got {self.input_proj_dim}")

  @property
  def param_bytes(self) -> float:
    """b, bytes per weight."""
    return DTYPE_BYTES[self.dtype] if self.bytes_per_param is None else self.bytes_per_param

  @property
  def kv_element_bytes(self) -> float:
    return self.param_bytes if self.kv_bytes is None else self.kv_bytes

  @property
  def layer_params(self) -> int:
    """Weights of one decoder layer: q, k, v, o and the three MLP matrices."""
    d_in = self.attn_input_dim or self.d_model
    q = d_in * self.num_heads * self.head_dim
    kv = 2 * d_in * self.num_kv_heads * self.head_dim
    o = self.num_heads * self.head_dim * self.d_model
    return q + kv + o + 3 * self.d_model * self.mlp_dim

  @property
  def dense_params(self) -> int:
    """Weights every token multiplies, except the output head: layers + input projection."""
    return self.num_layers * self.layer_params + self.input_proj_dim * self.d_model

  @property
  def head_params(self) -> int:
    """V x D output head, or R (D + V) for a factored one."""
    if self.head_rank:
      return self.head_rank * (self.d_model + self.vocab_size)
    return self.vocab_size * self.d_model

  @property
  def num_params(self) -> int:
    """Stored weights (an untied input embedding counted; a shared one is not)."""
    embedding = 0 if self.tied_embedding else self.head_params
    return self.dense_params + self.head_params + embedding

  @property
  def kv_bytes_per_position(self) -> float:
    """KV-cache bytes of one context position over all layers (keys and values)."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_element_bytes


def shape_from_config(name: str, cfg, *, source: str = "",
                      kv_dtype: str = "float32") -> ModelShape:
  """The shape of an av_jax `TransformerConfig` (float32 weights, tied embedding, no GQA)
  with a KV cache of `kv_dtype` (`ModelsConfig.kv_dtype`)."""
  return ModelShape(name=name, num_layers=cfg.num_layers, d_model=cfg.d_model,
                    mlp_dim=cfg.mlp_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
                    head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, dtype="float32",
                    kv_bytes=DTYPE_BYTES[kv_dtype], tied_embedding=True, source=source)


def shipped_shapes(config) -> dict[str, ModelShape]:
  """The shapes of a model set, read from its config (a name such as "default", or a
  `ModelsConfig`).

  Names: the set's name (the target) and `<name>-<kind>` for every drafter kind. The
  eagle head is one layer at the target's width over `fc([h; e])` (2 D -> D) sharing the
  target's head; the block drafters are `block.num_layers` bidirectional layers over the
  K_max + 1 slots of `fc([h; e])`, with no context attention, sharing the target's head.
  """
  cfg = load_config(config) if isinstance(config, str) else config
  name = cfg.name
  src = f"configs/models/{name}.toml" if isinstance(config, str) else f"model set {name!r}"
  target = shape_from_config(name, cfg.target, source=f"{src} [target]", kv_dtype=cfg.kv_dtype)
  d, vocab = cfg.target.d_model, cfg.target.vocab_size
  common = dict(d_model=d, vocab_size=vocab, dtype="float32", tied_embedding=True,
                input_proj_dim=2 * d, kv_bytes=DTYPE_BYTES[cfg.kv_dtype])
  eagle = ModelShape(name=f"{name}-eagle", num_layers=1, mlp_dim=cfg.eagle.mlp_dim,
                     num_heads=cfg.eagle.num_heads, num_kv_heads=cfg.eagle.num_heads,
                     head_dim=cfg.eagle.head_dim, head_rank=cfg.eagle.head_rank,
                     source=f"{src} [eagle]", **common)
  block = ModelShape(name=f"{name}-block", num_layers=cfg.block.num_layers,
                     mlp_dim=cfg.block.mlp_dim, num_heads=cfg.block.num_heads,
                     num_kv_heads=cfg.block.num_heads, head_dim=cfg.block.head_dim,
                     head_rank=cfg.block.head_rank, context_attention=False,
                     source=f"{src} [block]", **common)
  return {name: target,
          f"{name}-draft_lm": shape_from_config(f"{name}-draft_lm", cfg.draft_lm,
                                                source=f"{src} [draft_lm]",
                                                kv_dtype=cfg.kv_dtype),
          f"{name}-eagle": eagle, f"{name}-block": block,
          f"{name}-block_head": dataclasses.replace(block, name=f"{name}-block_head")}


_LLAMA3_8B = ModelShape(
    name="llama3-8b", num_layers=32, d_model=4096, mlp_dim=14336, num_heads=32,
    num_kv_heads=8, head_dim=128, vocab_size=128256, dtype="bfloat16",
    source="Llama-3.1-8B config.json: 32 layers, hidden 4096, intermediate 14336, 32 heads / "
           "8 KV heads of 128, vocab 128256, untied embedding (8.03 B params).")
SHAPES: dict[str, ModelShape] = {
    "llama3-8b": _LLAMA3_8B,
    # EAGLE-3 (Li et al. 2025): fc over three target hidden layers (3 D -> D), one decoder
    # layer whose q/k/v read [embedding; features] (2 D), and its own head over a reduced
    # draft vocabulary of 32000 tokens (the EAGLE-3 Llama-3.1-8B config's draft_vocab_size:
    # the most frequent target tokens, mapped back to the 128256-token vocabulary).
    "llama3-8b-eagle3": dataclasses.replace(
        _LLAMA3_8B, name="llama3-8b-eagle3", num_layers=1, vocab_size=32000,
        attn_input_dim=2 * 4096, input_proj_dim=3 * 4096,
        source="EAGLE-3 head for Llama-3.1-8B (configs/llama3-8B-eagle3.json of the EAGLE-3 "
               "/ SpecForge releases): 1 layer at hidden 4096, q/k/v over 2 x 4096, fc "
               "3 x 4096 -> 4096, draft_vocab_size 32000."),
    # MTP (DeepSeek-V3, section 2.2): one transformer block over proj([norm h; norm e])
    # (2 D -> D) that shares the target's embedding and full output head, run once per
    # drafted token.
    "llama3-8b-mtp": dataclasses.replace(
        _LLAMA3_8B, name="llama3-8b-mtp", num_layers=1, input_proj_dim=2 * 4096,
        tied_embedding=True,
        source="DeepSeek-V3-style MTP module at Llama-3.1-8B's width: 1 layer, projection "
               "2 x 4096 -> 4096, the target's full 128256-token head shared."),
    # DFlash-style block drafter (Chen et al. 2025): a few target-width layers draft the
    # whole block in one parallel pass, conditioned on target context features, sharing
    # the target's embedding and head. 5 layers is an assumption (DFlash-style release
    # configs use a handful; change num_layers for another drafter).
    "llama3-8b-dflash": dataclasses.replace(
        _LLAMA3_8B, name="llama3-8b-dflash", num_layers=5, input_proj_dim=2 * 4096,
        tied_embedding=True,
        source="DFlash-style block drafter at Llama-3.1-8B's width: 5 layers (assumed), "
               "projection of target features 2 x 4096 -> 4096, shared 128256-token head, "
               "attends to the context."),
}
_SHIPPED_CONFIGS = ("default", "tiny")


def shape_names() -> tuple[str, ...]:
  """Every name `get_shape` accepts."""
  shipped = [n for c in _SHIPPED_CONFIGS for n in shipped_shapes(c)]
  return tuple(SHAPES) + tuple(shipped)


def get_shape(name: str | ModelShape) -> ModelShape:
  """A `ModelShape` by name: published shapes (`SHAPES`) or a shipped model set's.

  Shipped shapes are read from `configs/models/<set>.toml` on each call, so they follow
  the config ("default" is the target, "default-eagle" its eagle head, and so on).

  Raises:
    ValueError: an unknown name, listing the known ones.
  """
  if isinstance(name, ModelShape):
    return name
  if name in SHAPES:
    return SHAPES[name]
  config = name.split("-", 1)[0]
  if config in _SHIPPED_CONFIGS:
    shapes = shipped_shapes(config)
    if name in shapes:
      return shapes[name]
  raise ValueError(f"shape: unknown model shape {name!r}; known: {list(shape_names())}")


# ------------------------------------------------------------------------ implementations


@dataclasses.dataclass(frozen=True, kw_only=True)
class Implementation:
  """How the programs touch memory: a serving stack's kernels, or av_jax's XLA programs."""
  name: str
  # "per_request": an attention kernel reads each request's KV cache once for all of its
  # query tokens (paged / flash decoding). "per_token": every packed token gathers its
  # slot's cache (av_jax's packed verify, `layers.Attention` mode "packed").
  kv_reads: str
  kv_passes: float           # memory passes over the KV bytes a token or request reads
  copies_cache: bool         # the program copies every slot's cache positions it reads
                             # (XLA:CPU materialises the slice a product reads), per layer
  sampling_passes: float     # passes over the [T, V] float32 logits (softmax, top-p, ...)
  drafts_all_slots: bool     # the drafter runs for all B slots whatever R is
  first_depth_tokens: int | None = None  # tokens per request an autoregressive drafter's
                                         # first depth consumes; None: K + 1
  source: str = ""

  def __post_init__(self):
    if self.kv_reads not in ("per_request", "per_token"):
      raise ValueError(f"kv_reads: expected 'per_request' or 'per_token', got "
                       f"{self.kv_reads!r}")
    _positive("kv_passes", self.kv_passes)
    _non_negative("sampling_passes", self.sampling_passes)
    if self.first_depth_tokens is not None and self.first_depth_tokens < 1:
      raise ValueError(f"first_depth_tokens: expected >= 1, got {self.first_depth_tokens}")


# av_jax's sampling of the [T, V] logits: log-softmax (read, write), exp to probs (read,
# write), and with top-p < 1 the nucleus search (`sampling._top_p_mask`), each pass a read:
# 12 bisection steps of a masked sum that bracket the threshold, a count of the bracket
# and `lax.top_k` of it. A bracket holding more than 32 probabilities adds a sum and a
# count per further step: none on the shipped model's logits, 3 steps for near-uniform rows
# over 32000 tokens. The search runs over row blocks of 1 MiB, so on a CPU its passes
# after the first read cached rows; they are charged at memory rate all the same.
_SOFTMAX_PASSES = 4.0
_TOP_P_SEARCH_PASSES = 14.0

IMPLEMENTATIONS: dict[str, Implementation] = {
    "fused": Implementation(
        name="fused", kv_reads="per_request", kv_passes=1.0, copies_cache=False,
        sampling_passes=2.0, drafts_all_slots=False, first_depth_tokens=None,
        source="A serving stack's kernels: paged / flash attention reads each request's KV "
               "once, logits written once and read once by a fused sampler, drafting only "
               "active requests."),
    "av_jax": Implementation(
        name="av_jax", kv_reads="per_request", kv_passes=1.0, copies_cache=True,
        sampling_passes=_SOFTMAX_PASSES + _TOP_P_SEARCH_PASSES, drafts_all_slots=True,
        source="av_jax's XLA programs as `av-jax profile` times them: attention reads each "
               "slot's heads-major cache once per pass, over the live-length bucket "
               "(`models.layers.length_buckets`), after copying those positions of every "
               "slot per layer (XLA:CPU materialises the slice its products read); the new "
               "keys and values are scattered into the donated cache in place; top-p "
               "sampling by a bracketing search (12 masked sums, a count, a top-k); the "
               "drafter runs all B slots."),
}


def get_implementation(name: str | Implementation) -> Implementation:
  if isinstance(name, Implementation):
    return name
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"implementation: unknown {name!r}; known: {list(IMPLEMENTATIONS)}")
  return IMPLEMENTATIONS[name]


# ------------------------------------------------------------------------------ roofline


class Kernel(NamedTuple):
  """One kernel's work: the roofline charges max(compute, memory) for it."""
  flops: float            # FLOPs
  read_bytes: float       # bytes read
  write_bytes: float      # bytes written
  gather_elements: float  # elements written by transposing gathers (av_jax's per-token
                          # cache gather; `DeviceSpec.gather_rate`)
  gather_block: float     # bytes of one gather's output (sets its rate)
  temp_bytes: float       # bytes of temporaries the kernel allocates (first touch)


def kernel_seconds(kernel: Kernel, device: DeviceSpec, dtype: str) -> float:
  """max(compute, memory) time of one kernel (a gather is memory work at its own rate)."""
  compute = kernel.flops / device.flops(dtype)
  memory = kernel.read_bytes / device.read_rate + kernel.write_bytes / device.write_rate
  if kernel.gather_elements:
    memory = max(memory, kernel.gather_elements / device.gather_rate(kernel.gather_block))
  return max(compute, memory)


def forward_kernels(shape: ModelShape, *, tokens: int, requests: int, context_len: int,
                    logits_rows: int | None = None, query_block: int | None = None,
                    implementation: Implementation, cache_slots: int = 0,
                    sampling: bool = True) -> dict[str, Kernel]:
  """The kernels of one forward pass of `shape` over `tokens` packed tokens.

  Args:
    shape: the model.
    tokens: T, tokens through the dense layers.
    requests: R, requests those tokens belong to (whose KV caches are read).
    context_len: KV positions each query attends to (a kernel that skips empty pages
      reads the live context; av_jax's programs read the live-length bucket,
      `models.layers.length_buckets`).
    logits_rows: rows through the output head (default T).
    query_block: for a drafter without context attention, the block its tokens attend
      within (bidirectional); None otherwise.
    implementation: how attention and sampling touch memory.
    cache_slots: slots of the cache the program copies (`copies_cache`), 0: none.
    sampling: whether the program turns the logits into sampling probabilities.

  Returns:
    `{"dense", "attention", "head", "sampling"}` kernels (see `Kernel`).
  """
  b, kvb = shape.param_bytes, shape.kv_element_bytes
  rows = tokens if logits_rows is None else logits_rows
  layers = shape.num_layers
  dense = Kernel(flops=2.0 * shape.dense_params * tokens, read_bytes=shape.dense_params * b,
                 write_bytes=0.0, gather_elements=0.0, gather_block=0.0, temp_bytes=0.0)
  qk_width = layers * shape.num_heads * shape.head_dim
  if shape.context_attention:
    # Scores q.k and the weighted sum of values: 2 FLOPs each per (query, key, width).
    attn_flops = 4.0 * qk_width * context_len * tokens
    position = shape.kv_bytes_per_position
    cache_read = requests * context_len * position
    new_kv = tokens * position
    # The positions read of every slot's cache, copied per layer (`copies_cache`).
    cache_copy = cache_slots * context_len * position if implementation.copies_cache else 0.0
    if implementation.kv_reads == "per_request":
      attention = Kernel(flops=attn_flops,
                         read_bytes=cache_read * implementation.kv_passes + cache_copy,
                         write_bytes=new_kv + cache_copy, gather_elements=0.0, gather_block=0.0,
                         temp_bytes=cache_copy)
    else:
      # Each token's gather of its slot's cache is written, then read by the attention's
      # products (kv_passes - 1 times); one layer's gathered copy is live at a time.
      gathered = tokens * context_len * position
      attention = Kernel(
          flops=attn_flops,
          read_bytes=cache_read + gathered * (implementation.kv_passes - 1.0) + cache_copy,
          write_bytes=gathered + new_kv + cache_copy, gather_elements=gathered / kvb,
          gather_block=gathered / (2 * layers),  # keys and values of one layer apart
          temp_bytes=cache_copy + gathered / layers)
  else:
    block = query_block or 1
    attention = Kernel(flops=4.0 * qk_width * block * tokens, read_bytes=0.0,
                       write_bytes=0.0, gather_elements=0.0, gather_block=0.0, temp_bytes=0.0)
  logits_bytes = 4.0 * rows * shape.vocab_size  # float32 logits
  head = Kernel(flops=2.0 * shape.head_params * rows, read_bytes=shape.head_params * b,
                write_bytes=logits_bytes, gather_elements=0.0, gather_block=0.0, temp_bytes=logits_bytes)
  passes = implementation.sampling_passes if sampling else 0.0
  sampling_kernel = Kernel(flops=0.0, read_bytes=logits_bytes * passes / 2.0,
                           write_bytes=logits_bytes * passes / 2.0, gather_elements=0.0, gather_block=0.0,
                           temp_bytes=logits_bytes if sampling else 0.0)
  return dict(dense=dense, attention=attention, head=head, sampling=sampling_kernel)


def forward_seconds(kernels: Mapping[str, Kernel], shape: ModelShape, device: DeviceSpec, *,
                    launches: int = 1) -> dict[str, float]:
  """Seconds per kernel (the combination rule: sum of per-kernel maxima) plus overheads.

  `first_touch` is the page faults of a program whose temporaries reach the device's
  first-touch threshold (XLA:CPU: every run); `overhead` the launch costs.
  """
  out = {name: kernel_seconds(k, device, shape.dtype) for name, k in kernels.items()}
  temps = sum(k.temp_bytes for k in kernels.values())
  out["first_touch"] = temps / device.first_touch_bandwidth if (
      temps >= device.first_touch_threshold) else 0.0
  out["overhead"] = launches * device.step_overhead_s + shape.num_layers * device.layer_overhead_s
  return out


class CostTables(NamedTuple):
  """Step-cost tables of one deployment (modelled by the roofline, or measured).

  `cost` is what the planner decides with. The engine's modelled clock charges a step
  `draft_depth_ms[R, :depths_run].sum() + bucket_ms[bucket]`, so a step that drafts fewer
  depths (or none) pays less; `cost.draft_ms[R]` is the full K-depth row sum.
  """
  cost: CostModel             # draft_ms [R_max + 1], verify_ms [T_max + 1] (milliseconds)
  draft_depth_ms: np.ndarray  # [R_max + 1, K] float64, ms of drafting depth k with R
                              # requests (a parallel drafter pays its pass at depth 0)
  buckets: tuple[int, ...]    # packed-token sizes T of the verify programs, ascending
  bucket_ms: np.ndarray       # [num_buckets] float64, ms of verifying one bucket
  label: str                  # "modelled: ..." or "measured: ..." (device and shapes)
  terms: dict                 # per-bucket ms of each roofline term (empty if measured)


def draft_fixed_from_depths(draft_depth_ms) -> np.ndarray:
  """`[R_max + 1]`: the part of a row's drafting cost paid whatever depth is drafted.

  Drafting c of K depths costs the row's first c entries; the planner prices it
  `fixed + (c / K) (full - fixed)` (`CostModel.draft_share_cost`), exact at c = 1 and
  c = K with `fixed = depth_1 - mean(depth_2..K)`, clipped to [0, full]. An autoregressive
  drafter's first depth consumes the pending block (K + 1 tokens a request) and costs
  more than each later one; a parallel drafter pays everything at depth 1 (fixed = full).
  """
  depth = np.asarray(draft_depth_ms, np.float64)
  full = depth.sum(axis=1)
  if depth.shape[1] < 2:
    return full
  fixed = depth[:, 0] - depth[:, 1:].mean(axis=1)
  return np.clip(fixed, 0.0, full)


def depth_cost_model(draft_depth_ms, verify_ms) -> CostModel:
  """The planner's `CostModel` of a per-depth draft table and a verify table: a row's
  full K-depth sum, its fixed part (`draft_fixed_from_depths`) and `verify_ms`."""
  depth = np.asarray(draft_depth_ms, np.float64)
  return make_cost_model(depth.sum(axis=1), verify_ms,
                         draft_fixed_ms=draft_fixed_from_depths(depth))


def _resolve_buckets(buckets: Sequence[int] | None, max_tokens: int) -> tuple[int, ...]:
  if buckets is None:
    return tuple(range(1, max_tokens + 1))
  sizes = sorted(set(int(t) for t in buckets))
  if not sizes or sizes[0] < 1:
    raise ValueError(f"buckets: expected positive packed-token sizes, got {buckets!r}")
  if sizes[-1] < max_tokens:
    sizes.append(max_tokens)  # the engine always has a bucket holding every slot's K + 1
  return tuple(sizes)


def _step_function(buckets: Sequence[int], bucket_ms: np.ndarray, max_tokens: int) -> np.ndarray:
  """`[max_tokens + 1]`: T tokens cost what the smallest bucket >= T costs."""
  t = np.arange(max_tokens + 1)
  index = np.minimum(np.searchsorted(np.asarray(buckets), t, side="left"), len(buckets) - 1)
  return np.maximum.accumulate(np.asarray(bucket_ms, np.float64))[index]


def drafter_mode(drafter_kind: str) -> str:
  """"autoregressive" or "parallel" for a mode or a drafter kind name."""
  if drafter_kind not in _KIND_MODES:
    raise ValueError(f"drafter_kind: expected one of {sorted(_KIND_MODES)}, got "
                     f"{drafter_kind!r}")
  return _KIND_MODES[drafter_kind]


def roofline_costs(target: str | ModelShape, drafter: str | ModelShape | None,
                   device: str | DeviceSpec, *, drafter_kind: str, num_slots: int,
                   max_draft: int, context_len: int, buckets: Sequence[int] | None = None,
                   implementation: str | Implementation = "fused") -> CostTables:
  """Modelled verify and draft cost tables of a deployment (see the module docstring).

  Verify: bucket T runs the target on T packed tokens of `min(T, num_slots)` requests
  (dense layers and head on T tokens, attention over `context_len` positions). Draft, R
  active requests (all B when `implementation.drafts_all_slots`):

  * parallel (block / DFlash-style): one pass over R (K + 1) query slots, the head on R K
    of them, all charged at depth 0;
  * autoregressive (EAGLE / MTP / draft LM): depth 0 consumes the pending block,
    `first_depth_tokens` (default K + 1) per request, each later depth one token per
    request; every depth reads the drafter's weights and head again and its KV cache.
    Drafting fewer depths is charged the prefix of the row.

  Args:
    target: the target's shape (a name from `shape_names()` or a `ModelShape`).
    drafter: the drafter's shape, or None for target-only decoding (zero draft cost).
    device: a name from `DEVICE_NAMES` or a `DeviceSpec`.
    drafter_kind: "autoregressive", "parallel", or a drafter kind name (eagle, block, ...).
    num_slots: B, concurrent requests (rows of the draft table: R = 0..B).
    max_draft: K, draft positions per request.
    context_len: KV positions read per request (the live context; av_jax's programs read
      the smallest of `models.layers.length_buckets(max_len)` that holds it: pass that
      for `implementation="av_jax"`).
    buckets: verify bucket sizes T; None: every T = 1 .. B (K + 1) is its own bucket.
    implementation: "fused" (a serving stack's kernels) or "av_jax" (this repository's
      XLA programs), or an `Implementation`.

  Returns:
    `CostTables` with the `CostModel`, the per-depth draft table and the per-bucket
    breakdown; the label says "modelled" with the device and shapes.

  Raises:
    ValueError: unknown names (listing the known ones) or non-positive sizes.

  Example:
    >>> t = roofline_costs("llama3-8b", "llama3-8b-dflash", "h200", drafter_kind="parallel",
    ...                    num_slots=32, max_draft=8, context_len=2048)
    >>> float(t.cost.verify_ms[32]) < 2 * float(t.cost.verify_ms[1])  # flat below the knee
    True
  """
  target, device = get_shape(target), get_device(device)
  impl = get_implementation(implementation)
  mode = drafter_mode(drafter_kind)
  for name, value in (("num_slots", num_slots), ("max_draft", max_draft),
                      ("context_len", context_len)):
    if not (isinstance(value, (int, np.integer)) and value >= 1):
      raise ValueError(f"{name}: expected a positive integer, got {value!r}")
  max_tokens = num_slots * (max_draft + 1)
  sizes = _resolve_buckets(buckets, max_tokens)
  terms = {name: [] for name in ("dense", "attention", "head", "sampling", "first_touch",
                                 "overhead")}
  bucket_ms = []
  for size in sizes:
    kernels = forward_kernels(target, tokens=size, requests=min(size, num_slots),
                              context_len=context_len, implementation=impl,
                              cache_slots=num_slots)
    seconds = forward_seconds(kernels, target, device)
    for name, value in seconds.items():
      terms[name].append(value * _S_TO_MS)
    bucket_ms.append(sum(seconds.values()) * _S_TO_MS)
  bucket_ms = np.asarray(bucket_ms)
  depth_ms = np.zeros((num_slots + 1, max_draft))
  if drafter is not None:
    drafter = get_shape(drafter)
    for r in range(1, num_slots + 1):
      depth_ms[r] = _draft_depths(drafter, device, impl, mode,
                                  requests=num_slots if impl.drafts_all_slots else r,
                                  max_draft=max_draft, context_len=context_len)
    if impl.drafts_all_slots:
      depth_ms[0] = depth_ms[num_slots]
  verify = _step_function(sizes, bucket_ms, max_tokens)
  cost = depth_cost_model(depth_ms, verify)
  drafter_name = "no drafter" if drafter is None else f"{drafter.name} ({mode})"
  label = (f"modelled: {device.name}, target {target.name}, {drafter_name}, B={num_slots}, "
           f"K={max_draft}, context {context_len}, {impl.name} kernels")
  return CostTables(cost=cost, draft_depth_ms=depth_ms, buckets=sizes, bucket_ms=bucket_ms,
                    label=label, terms={k: np.asarray(v) for k, v in terms.items()})


def _draft_depths(shape: ModelShape, device: DeviceSpec, impl: Implementation, mode: str, *,
                  requests: int, max_draft: int, context_len: int) -> np.ndarray:
  """`[K]` ms of each drafting depth for `requests` requests."""
  out = np.zeros(max_draft)
  if mode == "parallel":
    kernels = forward_kernels(shape, tokens=requests * (max_draft + 1), requests=requests,
                              context_len=context_len, logits_rows=requests * max_draft,
                              query_block=max_draft + 1, implementation=impl)
    out[0] = sum(forward_seconds(kernels, shape, device).values()) * _S_TO_MS
    return out
  first = impl.first_depth_tokens or (max_draft + 1)
  for depth in range(max_draft):
    per_request = first if depth == 0 else 1
    # The drafter's own cache is updated in place by av_jax's dense attention (it reads
    # each row's cache once), so its KV reads are per request whatever the verify does.
    draft_impl = dataclasses.replace(impl, kv_reads="per_request", kv_passes=1.0,
                                     copies_cache=False)
    kernels = forward_kernels(shape, tokens=requests * per_request, requests=requests,
                              context_len=context_len, logits_rows=requests,
                              implementation=draft_impl)
    # One program for all depths (a scan, or a captured graph): one launch, at depth 0.
    seconds = forward_seconds(kernels, shape, device, launches=1 if depth == 0 else 0)
    out[depth] = sum(seconds.values()) * _S_TO_MS
  return out


def roofline_cost_model(target: str | ModelShape, drafter: str | ModelShape | None,
                        device: str | DeviceSpec, *, drafter_kind: str, num_slots: int,
                        max_draft: int, context_len: int, buckets: Sequence[int] | None = None,
                        implementation: str | Implementation = "fused") -> CostModel:
  """The `CostModel` of `roofline_costs` (same arguments): what the planner decides with."""
  return roofline_costs(target, drafter, device, drafter_kind=drafter_kind,
                        num_slots=num_slots, max_draft=max_draft, context_len=context_len,
                        buckets=buckets, implementation=implementation).cost


# ---------------------------------------------------------------------- measured tables


def save_cost_table(path: str, tables: CostTables, *,
                    metadata: Mapping[str, Any] | None = None) -> None:
  """Writes `tables` as a cost-table JSON file (`load_cost_table` reads it back).

  Format (version 1): `{"format": "av_jax-cost-table", "version": 1, "label": str,
  "buckets": [T...], "bucket_ms": [ms...], "draft_depth_ms": [[ms per depth] per R =
  0..R_max], "metadata": {...}}`. Milliseconds throughout.
  """
  blob = dict(format=COST_TABLE_FORMAT, version=COST_TABLE_VERSION, label=tables.label,
              buckets=[int(t) for t in tables.buckets],
              bucket_ms=[float(x) for x in tables.bucket_ms],
              draft_depth_ms=np.asarray(tables.draft_depth_ms, np.float64).tolist(),
              metadata=dict(metadata or {}))
  with open(path, "w") as f:
    json.dump(blob, f, indent=1)


def cost_tables_from_dict(blob: Mapping[str, Any], *, max_tokens: int | None = None) -> CostTables:
  """`CostTables` from a parsed cost-table file (see `save_cost_table`).

  Args:
    blob: the parsed JSON.
    max_tokens: T_max of the verify table; default the largest bucket (tokens beyond the
      largest measured bucket cost what it costs, as in the engine's profile).

  Raises:
    ValueError: naming the field, for a wrong format or version, or malformed tables.
  """
  if blob.get("format") != COST_TABLE_FORMAT:
    raise ValueError(f"format: expected {COST_TABLE_FORMAT!r}, got {blob.get('format')!r}")
  if blob.get("version") != COST_TABLE_VERSION:
    raise ValueError(f"version: expected {COST_TABLE_VERSION}, got {blob.get('version')!r}")
  buckets = [int(t) for t in blob.get("buckets", [])]
  bucket_ms = np.asarray(blob.get("bucket_ms", []), np.float64)
  if not buckets or bucket_ms.shape != (len(buckets),):
    raise ValueError(f"bucket_ms: expected one cost per bucket ({len(buckets)} buckets), got "
                     f"shape {bucket_ms.shape}")
  if sorted(set(buckets)) != buckets or buckets[0] < 1:
    raise ValueError(f"buckets: expected ascending positive sizes, got {buckets}")
  depth = np.asarray(blob.get("draft_depth_ms", []), np.float64)
  if depth.ndim != 2 or depth.shape[0] < 1:
    raise ValueError(f"draft_depth_ms: expected a [R_max + 1, K] table, got shape "
                     f"{depth.shape}")
  top = buckets[-1] if max_tokens is None else int(max_tokens)
  verify = _step_function(buckets, bucket_ms, top)
  cost = depth_cost_model(depth, verify)
  return CostTables(cost=cost, draft_depth_ms=depth, buckets=tuple(buckets),
                    bucket_ms=bucket_ms, label=str(blob.get("label", "measured")), terms={})


def load_cost_table(path: str, *, max_tokens: int | None = None) -> CostTables:
  """Reads a cost-table file (`save_cost_table`, `benchmarks/accelerator.py`).

  Use `.cost` (a `CostModel`) in place of the roofline's.

  Raises:
    ValueError: naming the path and the field, for a malformed file.
  """
  with open(path) as f:
    blob = json.load(f)
  try:
    return cost_tables_from_dict(blob, max_tokens=max_tokens)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
