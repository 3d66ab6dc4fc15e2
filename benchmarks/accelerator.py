"""One prepared accelerator benchmark: the measurements a lent GPU or TPU should give (issue 13).

    PYTHONPATH=. python benchmarks/accelerator.py --out DIR           # on the device, < 8 min
    PYTHONPATH=. python benchmarks/accelerator.py --out DIR --quick   # tiny shapes, CPU, < 60 s

Uses only what the device image has (jax, flax, optax, orbax, tokenizers; nothing
installed; no matplotlib). Writes at most 6 files to DIR:

* `device.json`: the device, its memory, versions, a bf16 matmul (TFLOP/s) and a large
  copy (read + write GB/s), the figures a `DeviceSpec` is calibrated from;
* `features.json`: the `logit_qmax` feature pass at (B, K, V) = (64, 8, 32768),
  (256, 8, 131072), (256, 8, 262144) in float32 and bfloat16, against one `jnp.max` pass
  and a copy of the same logits (achieved GB/s, fraction of the measured copy rate);
* `decision.json`: the whole per-step AV decision (`decision_ms`) at the same sizes;
* `verify_table.json`: a random-weight llama3-8b-shaped bf16 verify forward at T = 1 ...
  4096 packed tokens over a 2048-token KV context, plus an EAGLE-3-shaped drafter per
  depth, as a cost-table file (`av_jax.costs.load_cost_table` reads it);
* `compare.json`: `av-jax compare` on the shipped models, wall clock on the device
  (`COMPARE`: block drafter, mixed workload, concurrency 1, 16, 64 while time lasts);
* `summary.md`: all of the above as tables.

The forward is written here, not taken from `av_jax.models`: it has grouped-query KV
heads and reads each request's cache once for all of its query tokens (the per-request
pattern of a serving stack's attention kernel), which av_jax's packed program does not.
All 32 layers run (under `lax.scan`) when the device memory holds weights and cache;
otherwise fewer layers, and the times are scaled up to 32 (`layers_run` says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import costs
from av_jax.decision import make_decider
from av_jax.decision import make_decision
from av_jax.features import logit_qmax
from av_jax.profiling import median_ms
from av_jax.selection import linear_cost_model

FEATURE_SIZES = ((64, 8, 32768), (256, 8, 131072), (256, 8, 262144))
QUICK_FEATURE_SIZES = ((8, 4, 1024),)
DTYPES = ("float32", "bfloat16")
# Packed-token buckets: powers of 2 and 1.5 x powers of 2 up to 4096 (resolves the knee).
VERIFY_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                 1024, 1536, 2048, 3072, 4096)
QUICK_VERIFY_TOKENS = (1, 8, 64)
CONTEXT = 2048        # KV positions per request in the verify table
MAX_REQUESTS = 64     # requests the packed tokens come from (R = min(T, 64))
MAX_DRAFT = 8         # K of the drafter table
DRAFT_REQUESTS = (1, 2, 4, 8, 16, 32, 64)
QUICK_DRAFT_REQUESTS = (1, 8)
QUICK_SHAPE = costs.ModelShape(name="tiny-llama", num_layers=2, d_model=64, mlp_dim=128,
                               num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512,
                               dtype="bfloat16", source="quick run: a tiny llama-like shape")
QUICK_DRAFTER = dataclasses.replace(QUICK_SHAPE, name="tiny-eagle3", num_layers=1,
                                    vocab_size=256, attn_input_dim=128, input_proj_dim=192)
FULL_LAYERS = 32


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="directory for the JSON and Markdown files")
  p.add_argument("--quick", action="store_true", help="tiny shapes, CPU, under 60 s")
  p.add_argument("--repeats", type=int, default=10, help="timed runs per measurement")
  p.add_argument("--budget-s", type=float, default=420.0,
                 help="stop starting new measurements after this many seconds")
  return p.parse_args(argv)


class Clock:
  """Wall-clock budget: parts that would start after the deadline are skipped, and say so."""

  def __init__(self, budget_s: float):
    self.start, self.budget_s = time.perf_counter(), budget_s

  def left(self) -> float:
    return self.budget_s - (time.perf_counter() - self.start)


# ------------------------------------------------------------------------------ device


def describe_device(*, quick: bool, repeats: int) -> dict:
  """Device, memory, versions, a bf16 matmul rate and a large copy's read + write rate."""
  dev = jax.devices()[0]
  try:
    memory = dev.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    memory = {}
  n = 512 if quick else 8192
  a = jnp.ones((n, n), jnp.bfloat16)
  matmul_ms = median_ms(jax.jit(jnp.matmul), a, a, repeats=repeats)
  copy_bytes = (16 if quick else 2048) * 2**20
  x = jnp.ones((copy_bytes // 4,), jnp.float32)
  copy_ms = median_ms(jax.jit(lambda x: x * 2.0), x, repeats=repeats)
  return dict(platform=dev.platform, device_kind=dev.device_kind, num_devices=jax.device_count(),
              memory_bytes_limit=memory.get("bytes_limit"), jax=jax.__version__,
              python=platform.python_version(), matmul_n=n, matmul_dtype="bfloat16",
              matmul_tflops=2.0 * n**3 / matmul_ms / 1e9, copy_bytes=copy_bytes,
              copy_gbps=2.0 * copy_bytes / copy_ms / 1e6, quick=quick)


# ---------------------------------------------------------------------------- features


def random_logits(B: int, K: int, V: int, dtype: str) -> jax.Array:
  """Logits with a per-row scale (spreads the feature), generated on the device."""
  k1, k2 = jax.random.split(jax.random.key(0))
  scale = jax.random.uniform(k1, (B, K, 1), minval=0.5, maxval=6.0)
  return (jax.random.normal(k2, (B, K, V)) * scale).astype(dtype)


def each_size(sizes, clock: Clock, measure) -> list[dict]:
  """`measure(B, K, V, dtype) -> dict` per size and dtype while the clock has time left;
  a row that would start after the deadline says it was skipped."""
  rows = []
  for B, K, V in sizes:
    for dtype in DTYPES:
      if clock.left() <= 0:
        rows.append(dict(B=B, K=K, V=V, dtype=dtype, skipped="time budget spent"))
      else:
        rows.append(dict(B=B, K=K, V=V, dtype=dtype, **measure(B, K, V, dtype)))
  return rows


def feature_pass(sizes, *, copy_gbps: float, repeats: int, clock: Clock) -> list[dict]:
  """`logit_qmax` against one `jnp.max` and a copy of the same logits, per size and dtype."""
  feature = jax.jit(lambda x: logit_qmax(x, temperature=1.0, top_p=1.0))
  maximum = jax.jit(lambda x: jnp.max(x, axis=-1))
  copy = jax.jit(lambda x: x * 2)

  def measure(B, K, V, dtype):
    logits = random_logits(B, K, V, dtype)
    nbytes = logits.size * logits.dtype.itemsize
    f_ms = median_ms(feature, logits, repeats=repeats)
    m_ms = median_ms(maximum, logits, repeats=repeats)
    c_ms = median_ms(copy, logits, repeats=repeats)
    gbps = lambda ms, passes=1: passes * nbytes / ms / 1e6
    return dict(logits_bytes=nbytes, feature_ms=f_ms, max_ms=m_ms, copy_ms=c_ms,
                feature_gbps=gbps(f_ms), max_gbps=gbps(m_ms), copy_gbps=gbps(c_ms, 2),
                feature_fraction_of_copy=gbps(f_ms) / copy_gbps,
                max_fraction_of_copy=gbps(m_ms) / copy_gbps, feature_over_max=f_ms / m_ms)

  return each_size(sizes, clock, measure)


def decision_function(B: int, K: int):
  """The whole per-step AV decision for B slots and K positions (one jitted call).

  Kept in one place: the decision API may be renamed by the engine refactor.
  Returns `(init_state, step)` with `step(state, logits, accepted, labeled, active)`.
  """
  decide = make_decision(make_decider(K, policy="current"), donate=False)
  cost = linear_cost_model(B, B * (K + 1))
  return decide.init(B), functools.partial(_decide_step, decide.step, cost=cost)


def _decide_step(step, state, logits, accepted, labeled, active, *, cost):
  return step(state, logits, accepted, labeled, active, cost)


def decision_pass(sizes, *, repeats: int, clock: Clock) -> list[dict]:
  """Median ms of the whole per-step decision at each size and dtype."""

  def measure(B, K, V, dtype):
    state, step = decision_function(B, K)
    logits = random_logits(B, K, V, dtype)
    accepted = jnp.zeros((B, K), bool).at[:, 0].set(True)
    labeled = jnp.zeros((B, K), bool).at[:, :2].set(True)
    active = jnp.ones((B,), bool)
    return dict(decision_ms=median_ms(step, state, logits, accepted, labeled, active,
                                      repeats=repeats))

  return each_size(sizes, clock, measure)


# ------------------------------------------------------------------------ llama forward


def init_layers(shape: costs.ModelShape, layers: int, key: jax.Array) -> dict:
  """Random stacked weights `[layers, ...]` of `shape`'s decoder layers (bf16)."""
  d, f = shape.d_model, shape.mlp_dim
  d_in = shape.attn_input_dim or d
  hq, hkv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
  dims = dict(wq=(d_in, hq), wk=(d_in, hkv), wv=(d_in, hkv), wo=(hq, d), gate=(d, f),
              up=(d, f), down=(f, d))
  keys = jax.random.split(key, len(dims))
  dtype = jnp.dtype(shape.dtype)
  # Drawn in the weights' dtype: no float32 temporary of the largest stacked matrix.
  return {name: jax.random.normal(k, (layers,) + dim, dtype) / math.sqrt(dim[0])
          for k, (name, dim) in zip(keys, dims.items())}


def _rms(x):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def make_forward(shape: costs.ModelShape):
  """`forward(layers, head, proj, cache_k, cache_v, x) -> probs [R*S, V]`.

  `x [R, S, D]` holds S query tokens of each of R requests; the first R rows of
  `cache_k/v [L, R_max, C, KVH, Dh]` their context. Per layer, each request's queries attend to its whole cache and
  causally to its own S tokens (two score blocks merged in one softmax), the way a
  serving kernel reads each request's KV once; the new keys are not written back (T x
  KV bytes, negligible). The head's logits go through a float32 softmax, as the
  verification's sampling distribution does.
  """
  hkv, g, dh = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
  d_in = shape.attn_input_dim or shape.d_model

  def layer(x, weights):
    p, ck, cv = weights
    R, S, _ = x.shape
    ck, cv = ck[:R], cv[:R]  # the first R requests' caches (a contiguous prefix)
    h = _rms(x)
    h_in = h if d_in == h.shape[-1] else jnp.concatenate([h] * (d_in // h.shape[-1]), -1)
    q = (h_in @ p["wq"]).reshape(R, S, hkv, g, dh)
    k = (h_in @ p["wk"]).reshape(R, S, hkv, dh)
    v = (h_in @ p["wv"]).reshape(R, S, hkv, dh)
    scale = 1.0 / math.sqrt(dh)
    s_ctx = jnp.einsum("rskgd,rckd->rkgsc", q, ck, preferred_element_type=jnp.float32)
    s_new = jnp.einsum("rskgd,rtkd->rkgst", q, k, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((S, S), bool))
    s_new = jnp.where(causal, s_new, -1e30)
    scores = jnp.concatenate([s_ctx, s_new], -1) * scale
    w = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    ctx_len = ck.shape[1]
    out = (jnp.einsum("rkgsc,rckd->rskgd", w[..., :ctx_len], cv)
           + jnp.einsum("rkgst,rtkd->rskgd", w[..., ctx_len:], v))
    x = x + out.reshape(R, S, -1) @ p["wo"]
    h = _rms(x)
    x = x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
    return x, None

  def forward(layers, head, proj, cache_k, cache_v, x):
    if proj is not None:
      x = (jnp.concatenate([x] * (proj.shape[0] // x.shape[-1]), -1) @ proj)
    x, _ = jax.lax.scan(layer, x, (layers, cache_k, cache_v))
    logits = (_rms(x) @ head).astype(jnp.float32)
    return jax.nn.softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)

  return jax.jit(forward)


def layers_that_fit(shape: costs.ModelShape, *, requests: int, context: int,
                    bytes_limit: int | None) -> int:
  """All layers if weights + cache take at most half the device memory, else fewer."""
  if bytes_limit is None:
    return shape.num_layers
  per_layer = (shape.layer_params * shape.param_bytes
               + requests * context * shape.kv_bytes_per_position / shape.num_layers)
  fixed = shape.head_params * shape.param_bytes
  return int(max(1, min(shape.num_layers, (bytes_limit / 2 - fixed) // per_layer)))


def forward_ms(shape: costs.ModelShape, batches, *, max_requests: int, context: int,
               layers: int, repeats: int, clock: Clock) -> list[float]:
  """Median ms of the forward for each `(R, S)` in `batches` (S query tokens of each of
  R requests), scaled from `layers` run to `shape.num_layers`; stops at the deadline."""
  key = jax.random.key(1)
  weights = init_layers(shape, layers, key)
  dtype = jnp.dtype(shape.dtype)
  head = (jax.random.normal(key, (shape.d_model, shape.vocab_size), jnp.float32)
          / math.sqrt(shape.d_model)).astype(dtype)
  proj = None
  if shape.input_proj_dim:
    proj = (jax.random.normal(key, (shape.input_proj_dim, shape.d_model), jnp.float32)
            / math.sqrt(shape.input_proj_dim)).astype(dtype)
  kv = (layers, max_requests, context, shape.num_kv_heads, shape.head_dim)
  # Constant caches: values do not change the time, and nothing larger than them is made.
  cache_k = jnp.full(kv, 0.5, dtype)
  cache_v = jnp.full(kv, -0.5, dtype)
  forward = make_forward(shape)
  times = []
  for r, s in batches:
    if clock.left() <= 0:
      break
    x = jnp.ones((r, s, shape.d_model), dtype)
    ms = median_ms(forward, weights, head, proj, cache_k, cache_v, x, repeats=repeats)
    # With fewer layers than the shape has, the whole time is scaled (head included: an
    # over-estimate by the head's share of the step).
    times.append(ms * shape.num_layers / layers)
  return times


def packed_batches(tokens, max_requests: int) -> list[tuple[int, int]]:
  """T packed tokens as (R, S): R requests of S = T / R tokens each, R the largest divisor
  of T up to `max_requests` (96 tokens over at most 64 requests: 48 requests of 2)."""
  out = []
  for t in tokens:
    if t < 1:
      raise ValueError(f"tokens: {t} packed tokens, expected at least 1")
    r = max(d for d in range(1, min(t, max_requests) + 1) if t % d == 0)
    out.append((r, t // r))
  return out


def verify_table(*, quick: bool, repeats: int, bytes_limit, clock: Clock) -> dict:
  """The measured llama3-8b-shaped verify table and EAGLE-3-shaped draft table."""
  target = QUICK_SHAPE if quick else costs.get_shape("llama3-8b")
  drafter = QUICK_DRAFTER if quick else costs.get_shape("llama3-8b-eagle3")
  tokens = QUICK_VERIFY_TOKENS if quick else VERIFY_TOKENS
  context, requests = (64, 8) if quick else (CONTEXT, MAX_REQUESTS)
  layers = layers_that_fit(target, requests=requests, context=context, bytes_limit=bytes_limit)
  bucket_ms = forward_ms(target, packed_batches(tokens, requests), max_requests=requests,
                         context=context, layers=layers, repeats=repeats, clock=clock)
  buckets = list(tokens[:len(bucket_ms)])
  # Drafter: depth 0 consumes the pending block (K + 1 tokens per request), later depths
  # one token per request; rows R = 0..requests interpolated linearly between measured R.
  draft_r = [r for r in (QUICK_DRAFT_REQUESTS if quick else DRAFT_REQUESTS) if r <= requests]
  first = forward_ms(drafter, [(r, MAX_DRAFT + 1) for r in draft_r], max_requests=requests,
                     context=context, layers=1, repeats=repeats, clock=clock)
  later = forward_ms(drafter, [(r, 1) for r in draft_r], max_requests=requests,
                     context=context, layers=1, repeats=repeats, clock=clock)
  n = min(len(first), len(later))
  depth = np.zeros((requests + 1, MAX_DRAFT))
  if n:
    rows = np.arange(requests + 1)
    xs = [0] + draft_r[:n]
    depth[:, 0] = np.interp(rows, xs, [0.0] + first[:n])
    depth[:, 1:] = np.interp(rows, xs, [0.0] + later[:n])[:, None]
  label = (f"measured: {jax.devices()[0].device_kind}, random-weight {target.name} "
           f"{target.dtype} verify over {context}-token contexts of up to {requests} "
           f"requests, {drafter.name} drafter, K={MAX_DRAFT}")
  tables = costs.CostTables(cost=None, draft_depth_ms=depth, buckets=tuple(buckets),
                            bucket_ms=np.asarray(bucket_ms), label=label, terms={})
  meta = dict(target=target.name, drafter=drafter.name, layers_run=layers,
              layers_total=target.num_layers, context=context, max_requests=requests,
              draft_requests_measured=draft_r[:n], complete=len(buckets) == len(tokens),
              draft_first_depth_ms=first[:n], draft_later_depth_ms=later[:n])
  return dict(tables=tables, meta=meta)


# ----------------------------------------------------------------------------- compare


COMPARE = dict(drafters="block", workloads="mixed",
               arms="target_only,fixed:1,fixed:2,fixed:4,fixed:8,av", concurrency=(1, 16, 64),
               repeats=2, max_new=48, warm_start=True)
# Quick (CPU, in the test suite): two arms at K = 2, one concurrency, a few tokens.
QUICK_COMPARE = dict(drafters="block", workloads="code", arms="fixed:2,av", concurrency=(2,),
                     repeats=1, max_new=6, max_draft=2)
COMPARE_MARGIN_S = 60.0  # a concurrency starts only with this much of the budget left


def run_compare(out: str, *, quick: bool, clock: Clock | None = None) -> dict:
  """`av-jax compare` on the shipped models, wall clock on the device (issue 13 item 3).

  One concurrency at a time while the time budget lasts (compile and profile before
  timing, interleaved repeats, as `av-jax compare` does); returns its JSON (`settings`,
  `results`) plus the concurrencies skipped for time.
  """
  from av_lab import compare as C  # pylint: disable=g-import-not-at-top  (deferred: loads
  # the models and the engine, which the other measurements do not need)
  preset = dict(QUICK_COMPARE if quick else COMPARE)
  concurrency = preset.pop("concurrency")
  merged, skipped = None, []
  for c in concurrency:
    if clock is not None and clock.left() < COMPARE_MARGIN_S and merged is not None:
      skipped.append(c)
      continue
    part = C.compare(concurrency=[c], clock="wall", requests_per_slot=2,
                     log=lambda line: print(line, flush=True), **preset)
    if merged is None:
      merged = part
    else:
      merged["results"] += part["results"]
      merged["settings"]["seconds"] += part["settings"]["seconds"]
    # Written after every concurrency: a run cut off by its time limit keeps what it measured.
    with open(os.path.join(out, "compare.json"), "w") as f:
      json.dump(merged, f, indent=1)
  merged["settings"]["concurrency"] = [c for c in concurrency if c not in skipped]
  merged["skipped_for_time"] = skipped
  return merged


# ----------------------------------------------------------------------------- summary


def summary_markdown(device: dict, features: list, decisions: list, verify: dict,
                     roofline: dict, compared: dict | None = None) -> str:
  lines = [f"# Accelerator benchmark: {device['device_kind']} ({device['platform']})", "",
           f"jax {device['jax']}, Python {device['python']}, "
           f"{device['num_devices']} device(s), memory limit {device['memory_bytes_limit']}; "
           f"bf16 {device['matmul_n']}^3 matmul {device['matmul_tflops']:.1f} TFLOP/s, "
           f"copy {device['copy_gbps']:.1f} GB/s (read + write)"
           + (" — QUICK RUN (tiny shapes)" if device["quick"] else ""), "",
           "## logit_qmax feature pass vs one jnp.max and a copy", "",
           "| B x K x V | dtype | feature ms | max ms | copy ms | feature GB/s | "
           "fraction of copy | feature / max |", "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in features:
    if "skipped" in r:
      lines.append(f"| {r['B']}x{r['K']}x{r['V']} | {r['dtype']} | {r['skipped']} |||||")
      continue
    lines.append(f"| {r['B']}x{r['K']}x{r['V']} | {r['dtype']} | {r['feature_ms']:.3f} | "
                 f"{r['max_ms']:.3f} | {r['copy_ms']:.3f} | {r['feature_gbps']:.3g} | "
                 f"{r['feature_fraction_of_copy']:.2f} | {r['feature_over_max']:.2f} |")
  lines += ["", "## Whole per-step decision", "", "| B x K x V | dtype | decision ms |",
            "|---|---|---:|"]
  for r in decisions:
    value = r.get("skipped") or f"{r['decision_ms']:.3f}"
    lines.append(f"| {r['B']}x{r['K']}x{r['V']} | {r['dtype']} | {value} |")
  meta, tables = verify["meta"], verify["tables"]
  lines += ["", f"## Verify cost table ({tables.label})", "",
            f"Layers run: {meta['layers_run']} of {meta['layers_total']} (times scaled to "
            f"all). Modelled column: `av_jax.costs` roofline of this device kind's entry.",
            "", "| T | measured ms | modelled ms |", "|---:|---:|---:|"]
  for t, ms in zip(tables.buckets, tables.bucket_ms):
    model = roofline.get(int(t))
    lines.append(f"| {t} | {ms:.3f} | {'' if model is None else f'{model:.3f}'} |")
  if compared:
    st = compared["settings"]
    lines += ["", f"## av-jax compare (wall clock, this device): {st['drafters']} drafter, "
              f"{st['workloads']} workload, {st['max_new']} new tokens, {st['repeats']} repeats",
              "", "| B | arm | tokens/s | per-request tokens/s | vs best static | accept |",
              "|---:|---|---:|---:|---:|---:|"]
    for r in compared["results"]:
      lines.append(f"| {r['concurrency']} | {r['arm']} | {r['tokens_per_s']:.1f} | "
                   f"{r['per_request_tokens_per_s']:.1f} | {r['vs_best_static']:.3f} | "
                   f"{r['acceptance']:.3f} |")
    if compared.get("skipped_for_time"):
      lines.append(f"\nSkipped for time: concurrency {compared['skipped_for_time']}.")
  return "\n".join(lines) + "\n"


def roofline_for(device: dict, verify: dict) -> dict[int, float]:
  """The roofline's verify ms at the measured T for the matching device entry, if any."""
  kind = device["device_kind"].lower()
  name = next((n for n in ("h200", "h100") if n in kind), None)
  if name is None and "tpu" in kind:
    name = "tpu-v6e" if "v6" in kind else "tpu-v5e" if "v5" in kind else None
  meta = verify["meta"]
  if name is None or device["quick"] or not verify["tables"].buckets:
    return {}
  t = costs.roofline_costs(meta["target"], None, name, drafter_kind="parallel",
                           num_slots=meta["max_requests"], max_draft=MAX_DRAFT,
                           context_len=meta["context"], buckets=verify["tables"].buckets)
  return {int(b): float(ms) for b, ms in zip(t.buckets, t.bucket_ms)}


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.quick:
    args.repeats = min(args.repeats, 2)
  os.makedirs(args.out, exist_ok=True)
  clock = Clock(args.budget_s)
  write = lambda name, blob: json.dump(blob, open(os.path.join(args.out, name), "w"), indent=1)
  device = describe_device(quick=args.quick, repeats=args.repeats)
  write("device.json", device)
  print(f"device: {device['device_kind']}: {device['matmul_tflops']:.1f} TFLOP/s bf16, "
        f"copy {device['copy_gbps']:.1f} GB/s", flush=True)
  sizes = QUICK_FEATURE_SIZES if args.quick else FEATURE_SIZES
  features = feature_pass(sizes, copy_gbps=device["copy_gbps"], repeats=args.repeats,
                          clock=clock)
  write("features.json", dict(device=device["device_kind"], rows=features))
  print(f"features done ({clock.left():.0f} s left)", flush=True)
  decisions = decision_pass(sizes, repeats=args.repeats, clock=clock)
  write("decision.json", dict(device=device["device_kind"], rows=decisions))
  print(f"decision done ({clock.left():.0f} s left)", flush=True)
  verify = verify_table(quick=args.quick, repeats=args.repeats,
                        bytes_limit=device["memory_bytes_limit"], clock=clock)
  costs.save_cost_table(os.path.join(args.out, "verify_table.json"), verify["tables"],
                        metadata=dict(verify["meta"], device=device))
  print(f"verify table done: {len(verify['tables'].buckets)} buckets "
        f"({clock.left():.0f} s left)", flush=True)
  compared = run_compare(args.out, quick=args.quick, clock=clock)
  write("compare.json", compared)
  roofline = roofline_for(device, verify)
  with open(os.path.join(args.out, "summary.md"), "w") as f:
    f.write(summary_markdown(device, features, decisions, verify, roofline, compared))
  print(open(os.path.join(args.out, "summary.md")).read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
