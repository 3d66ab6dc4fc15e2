"""The roofline model of a deployment's verify and draft costs (see `av_jax.costs`).

A program is a few kernels run in sequence (`forward_kernels`: dense layers, attention,
output head, sampling); each costs max(compute, memory) on the device
(`kernel_seconds`), and their times add (`forward_seconds`). `roofline_costs` builds a
deployment's `CostTables` from them; an `Implementation` says how the programs touch
memory (a serving stack's kernels, or av_jax's XLA programs).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from av_jax.costs.devices import DeviceSpec, _non_negative, _positive, get_device
from av_jax.costs.shapes import ModelShape, get_shape
from av_jax.costs.tables import CostTables, _step_function, depth_cost_model
from av_jax.selection import CostModel

DRAFTER_KINDS = ("autoregressive", "parallel")
# The shipped drafter kinds (av_jax.models.KINDS) and the published ones, by drafting mode.
_KIND_MODES = {"autoregressive": "autoregressive", "parallel": "parallel",
               "draft_lm": "autoregressive", "eagle": "autoregressive",
               "eagle3": "autoregressive", "mtp": "autoregressive", "block": "parallel",
               "block_head": "parallel", "dflash": "parallel"}
_S_TO_MS = 1e3


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


def _resolve_buckets(buckets: Sequence[int] | None, max_tokens: int) -> tuple[int, ...]:
  if buckets is None:
    return tuple(range(1, max_tokens + 1))
  sizes = sorted(set(int(t) for t in buckets))
  if not sizes or sizes[0] < 1:
    raise ValueError(f"buckets: expected positive packed-token sizes, got {buckets!r}")
  if sizes[-1] < max_tokens:
    sizes.append(max_tokens)  # the engine always has a bucket holding every slot's K + 1
  return tuple(sizes)


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
  """Modelled verify and draft cost tables of a deployment (see `av_jax.costs`).

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
  bucket_ms, terms = _bucket_costs(target, device, impl, sizes, num_slots=num_slots,
                                   context_len=context_len)
  drafter = None if drafter is None else get_shape(drafter)
  depth_ms = _draft_table(drafter, device, impl, mode, num_slots=num_slots,
                          max_draft=max_draft, context_len=context_len)
  verify = _step_function(sizes, bucket_ms, max_tokens)
  cost = depth_cost_model(depth_ms, verify)
  drafter_name = "no drafter" if drafter is None else f"{drafter.name} ({mode})"
  label = (f"modelled: {device.name}, target {target.name}, {drafter_name}, B={num_slots}, "
           f"K={max_draft}, context {context_len}, {impl.name} kernels")
  return CostTables(cost=cost, draft_depth_ms=depth_ms, buckets=sizes, bucket_ms=bucket_ms,
                    label=label, terms=terms)


def _bucket_costs(target: ModelShape, device: DeviceSpec, impl: Implementation,
                  sizes: Sequence[int], *, num_slots: int, context_len: int):
  """`(bucket_ms [num_buckets], terms)`: ms of verifying each bucket T in `sizes` (the
  target on T packed tokens of `min(T, num_slots)` requests), and `{term: [num_buckets]}`
  ms of each roofline term (`forward_seconds`'s)."""
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
  return np.asarray(bucket_ms), {k: np.asarray(v) for k, v in terms.items()}


def _draft_table(drafter: ModelShape | None, device: DeviceSpec, impl: Implementation,
                 mode: str, *, num_slots: int, max_draft: int, context_len: int) -> np.ndarray:
  """`[num_slots + 1, K]` ms of each drafting depth with R = 0 .. num_slots active
  requests (all rows the full batch's under `drafts_all_slots`; zeros without a drafter)."""
  depth_ms = np.zeros((num_slots + 1, max_draft))
  if drafter is not None:
    for r in range(1, num_slots + 1):
      depth_ms[r] = _draft_depths(drafter, device, impl, mode,
                                  requests=num_slots if impl.drafts_all_slots else r,
                                  max_draft=max_draft, context_len=context_len)
    if impl.drafts_all_slots:
      depth_ms[0] = depth_ms[num_slots]
  return depth_ms


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
