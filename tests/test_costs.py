"""Cost models: roofline formulas by hand, table properties, names and specs, table files."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from av_jax import costs
from av_jax import models as M

# A synthetic device and shape small enough to compute the roofline by hand.
DEVICE = costs.DeviceSpec(name="toy", peak_flops={"bfloat16": 1e3}, memory_bandwidth=100.0,
                          step_overhead_s=0.5, layer_overhead_s=0.25)
SHAPE = costs.ModelShape(name="toy", num_layers=2, d_model=8, mlp_dim=16, num_heads=2,
                         num_kv_heads=1, head_dim=4, vocab_size=10, dtype="bfloat16")


def test_shape_parameter_counts_by_hand():
  # q 8x2x4 + k, v 2 x 8x1x4 + o 2x4x8 + MLP 3 x 8x16.
  assert SHAPE.layer_params == 64 + 64 + 64 + 384
  assert SHAPE.dense_params == 2 * 576 and SHAPE.head_params == 80
  assert SHAPE.num_params == 1152 + 80 + 80  # untied: input embedding stored too
  assert SHAPE.kv_bytes_per_position == 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, bf16


def test_roofline_verify_cost_by_hand():
  # T = 3 tokens of 3 requests, context 5, fused kernels, all in seconds:
  #   dense  max(2*1152*3 / 1e3, 1152*2 / 100)                    = max(6.912, 23.04)
  #   attn   max(4*16*5*3 / 1e3, (3*5*32 + 3*32) / 100)             = max(0.96, 5.76)
  #   head   max(2*80*3 / 1e3, (80*2 + 4*3*10) / 100)               = max(0.48, 2.8)
  #   sampling, 2 passes over the float32 logits: (120 + 120) / 100 = 2.4
  #   overhead 0.5 + 2 layers x 0.25                                 = 1.0
  tables = costs.roofline_costs(SHAPE, None, DEVICE, drafter_kind="parallel", num_slots=3,
                                max_draft=1, context_len=5, buckets=[3])
  assert tables.buckets == (3, 6)  # the engine's top bucket B (K + 1) is always added
  np.testing.assert_allclose(tables.bucket_ms[0], 1e3 * (23.04 + 5.76 + 2.8 + 2.4 + 1.0))
  np.testing.assert_allclose(tables.terms["dense"][0], 23040.0)
  verify = np.asarray(tables.cost.verify_ms)
  np.testing.assert_allclose(verify[:4], tables.bucket_ms[0], rtol=1e-6)  # step function
  np.testing.assert_allclose(verify[4:], tables.bucket_ms[1], rtol=1e-6)
  np.testing.assert_array_equal(tables.cost.draft_ms, np.full(4, 1e-6, np.float32))


def test_knee_matches_the_published_figures_and_the_dense_crossover():
  assert costs.knee_tokens("h100", achievable=False) == pytest.approx(295.2, abs=0.1)
  assert costs.knee_tokens("h200", achievable=False) == pytest.approx(206.0, abs=0.1)
  # The H200's measured fractions (0.79 of FLOP/s, 0.90 of bandwidth) move it to ~182.
  assert costs.knee_tokens("h200") == pytest.approx(182.3, abs=0.1)
  # At the knee the dense kernel's compute and weight-read times are equal.
  knee = costs.knee_tokens("h200")
  shape = costs.get_shape("llama3-8b")
  dense = costs.forward_kernels(shape, tokens=knee, requests=1, context_len=1,
                                implementation=costs.IMPLEMENTATIONS["fused"])["dense"]
  device = costs.get_device("h200")
  assert dense.flops / device.flops("bfloat16") == pytest.approx(
      dense.read_bytes / device.read_rate, rel=1e-9)


@pytest.mark.parametrize("drafter,kind", [("llama3-8b-eagle3", "autoregressive"),
                                          ("llama3-8b-mtp", "mtp"),
                                          ("llama3-8b-dflash", "parallel")])
def test_h200_cost_model_is_monotone_positive_and_flat_below_the_knee(drafter, kind):
  tables = costs.roofline_costs("llama3-8b", drafter, "h200", drafter_kind=kind,
                                num_slots=64, max_draft=8, context_len=2048)
  verify, draft = np.asarray(tables.cost.verify_ms), np.asarray(tables.cost.draft_ms)
  assert verify.shape == (64 * 9 + 1,) and draft.shape == (65,)
  assert np.all(verify > 0) and np.all(np.diff(verify) >= 0) and np.all(np.diff(draft) >= 0)
  assert np.all(draft[1:] > draft[0])
  # Memory-bound below the knee (~182 tokens), per-token beyond it: the dense layers'
  # time doubles from 288 to 576 tokens (attention's KV reads add a constant).
  assert verify[32] < 1.5 * verify[1]
  dense = tables.terms["dense"]  # bucket T is entry T - 1 (every T its own bucket)
  np.testing.assert_allclose(dense[575] / dense[287], 2.0, rtol=1e-6)
  assert dense[31] == dense[0]  # weight reads, flat
  assert verify[576] > 1.4 * verify[288]
  # One weight read of 16 GB at 0.9 x 4.8 TB/s is ~3.7 ms: a decode step costs about that.
  assert 3.5 < verify[1] < 6.0


def test_per_depth_draft_costs_add_up_to_the_totals():
  ar = costs.roofline_costs("llama3-8b", "llama3-8b-eagle3", "h200",
                            drafter_kind="eagle3", num_slots=16, max_draft=6, context_len=1024)
  depth = ar.draft_depth_ms
  assert depth.shape == (17, 6)
  np.testing.assert_allclose(depth.sum(1)[1:], np.asarray(ar.cost.draft_ms)[1:], rtol=1e-6)
  assert np.all(depth[0] == 0)  # no active request, nothing drafted
  assert np.all(depth[1:, 0] > depth[1:, 1])  # depth 0 consumes the K + 1 pending tokens
  np.testing.assert_allclose(depth[1:, 1:], depth[1:, 1:2] * np.ones((1, 5)))
  par = costs.roofline_costs("llama3-8b", "llama3-8b-dflash", "h200", drafter_kind="parallel",
                             num_slots=16, max_draft=6, context_len=1024)
  assert np.all(par.draft_depth_ms[:, 1:] == 0) and np.all(par.draft_depth_ms[1:, 0] > 0)
  # av_jax's engine drafts all B slots whatever R: a flat row sum.
  flat = costs.roofline_costs("default", "default-eagle", "h200", drafter_kind="eagle",
                              num_slots=8, max_draft=4, context_len=256,
                              implementation="av_jax")
  np.testing.assert_allclose(flat.cost.draft_ms, np.full(9, flat.cost.draft_ms[0]))


def test_the_planners_pass_price_matches_the_depth_table():
  """The planner's price of c of K depths (`draft_share_cost`) is what the modelled
  clock charges (the row's first c entries): exact at every c for an autoregressive
  drafter (a dear first depth, equal later ones), and a parallel drafter's row is all
  fixed. Negative control: the passes priced alike under-price a shallow step."""
  ar = costs.roofline_costs("llama3-8b", "llama3-8b-eagle3", "h200",
                            drafter_kind="eagle3", num_slots=16, max_draft=6, context_len=1024)
  depth, K = ar.draft_depth_ms, 6
  for r in (1, 4, 16):
    for c in range(1, K + 1):
      priced = float(ar.cost.draft_share_cost(r, c / K))
      assert priced == pytest.approx(depth[r, :c].sum(), rel=1e-5)
  alike = float(ar.cost.draft_cost(16)) / K
  assert alike < 0.9 * depth[16, 0]
  np.testing.assert_allclose(costs.draft_fixed_from_depths([[3.0, 1.0, 1.0], [1.0, 2.0, 0.0]]),
                             [2.0, 0.0])
  par = costs.roofline_costs("llama3-8b", "llama3-8b-dflash", "h200", drafter_kind="parallel",
                             num_slots=4, max_draft=6, context_len=1024)
  np.testing.assert_allclose(par.cost.draft_fixed_ms[1:], par.cost.draft_ms[1:], rtol=1e-6)


def test_shipped_shapes_follow_the_config_and_count_the_real_parameters():
  cfg = M.load_config("tiny")
  shape = costs.get_shape("tiny")
  assert (shape.d_model, shape.num_layers, shape.vocab_size) == (
      cfg.target.d_model, cfg.target.num_layers, cfg.target.vocab_size)
  params = jax.eval_shape(lambda: M.init_params(cfg.target, jax.random.PRNGKey(0)))
  leaves = jax.tree_util.tree_leaves_with_path(params)
  norms = sum(int(np.prod(x.shape)) for path, x in leaves if "norm" in jax.tree_util.keystr(path))
  total = sum(int(np.prod(x.shape)) for _, x in leaves)
  assert shape.num_params == total - norms  # tied embedding, RMSNorm gains left out
  assert costs.get_shape("tiny-block").num_layers == cfg.block.num_layers
  # The KV cache is the config's `kv_dtype`: float32 by default, bfloat16 halves it.
  assert shape.kv_element_bytes == 4.0
  bf16 = costs.shipped_shapes(dataclasses.replace(cfg, kv_dtype="bfloat16"))
  for name in ("tiny", "tiny-draft_lm", "tiny-eagle"):
    full = costs.get_shape(name)
    assert bf16[name].kv_bytes_per_position * 2 == full.kv_bytes_per_position
    assert bf16[name].param_bytes == full.param_bytes  # the weights stay float32


def test_av_jax_sampling_passes_are_the_programs_passes():
  # log-softmax and exp (a read and a write each), then the top-p search: 12 bisection
  # sums bracketing the threshold, one count of the bracket and one top-k read of it.
  assert costs.IMPLEMENTATIONS["av_jax"].sampling_passes == 4 + 12 + 1 + 1


def test_unknown_names_list_the_known_ones():
  with pytest.raises(ValueError, match="device: unknown.*'a100'.*h200"):
    costs.get_device("a100")
  with pytest.raises(ValueError, match="shape: unknown.*llama3-8b.*default"):
    costs.get_shape("gpt-5")
  with pytest.raises(ValueError, match="drafter_kind: expected one of"):
    costs.roofline_costs("llama3-8b", None, "h200", drafter_kind="tree", num_slots=1,
                         max_draft=1, context_len=1)
  with pytest.raises(ValueError, match="implementation: unknown.*fused"):
    costs.get_implementation("triton")


@pytest.mark.parametrize("field,value,match", [
    ("memory_bandwidth", 0.0, "memory_bandwidth: expected a positive"),
    ("peak_flops", {"bfloat16": -1.0}, r"peak_flops\['bfloat16'\]"),
    ("peak_flops", {}, "peak_flops: expected at least one"),
    ("flops_fraction", 1.5, "flops_fraction: expected a fraction"),
    ("step_overhead_s", -1e-6, "step_overhead_s"),
    ("write_bandwidth", -2.0, "write_bandwidth"),
])
def test_bad_device_specs_are_refused_by_name(field, value, match):
  fields = dict(name="bad", peak_flops={"bfloat16": 1.0}, memory_bandwidth=1.0)
  fields[field] = value
  with pytest.raises(ValueError, match=match):
    costs.DeviceSpec(**fields)


def test_bad_shapes_and_sizes_are_refused_by_name():
  with pytest.raises(ValueError, match="num_layers: expected a positive integer"):
    costs.ModelShape(name="x", num_layers=0, d_model=8, mlp_dim=8, num_heads=2,
                     num_kv_heads=2, head_dim=4, vocab_size=8)
  with pytest.raises(ValueError, match="num_kv_heads: expected a divisor"):
    costs.ModelShape(name="x", num_layers=1, d_model=8, mlp_dim=8, num_heads=4,
                     num_kv_heads=3, head_dim=4, vocab_size=8)
  with pytest.raises(ValueError, match="dtype: device 'toy' has no peak FLOP/s for 'float32'"):
    costs.roofline_costs("tiny", None, DEVICE, drafter_kind="parallel", num_slots=2,
                         max_draft=1, context_len=4)
  with pytest.raises(ValueError, match="context_len: expected a positive integer"):
    costs.roofline_costs(SHAPE, None, DEVICE, drafter_kind="parallel", num_slots=2,
                         max_draft=1, context_len=0)


def test_cost_table_file_round_trips(tmp_path):
  tables = costs.roofline_costs("llama3-8b", "llama3-8b-eagle3", "tpu-v5e",
                                drafter_kind="autoregressive", num_slots=8, max_draft=4,
                                context_len=512, buckets=[8, 16, 24])
  path = str(tmp_path / "table.json")
  costs.save_cost_table(path, tables, metadata=dict(note="round trip"))
  loaded = costs.load_cost_table(path)
  assert loaded.buckets == tables.buckets == (8, 16, 24, 40) and loaded.label == tables.label
  np.testing.assert_allclose(loaded.bucket_ms, tables.bucket_ms)
  np.testing.assert_allclose(loaded.draft_depth_ms, tables.draft_depth_ms)
  np.testing.assert_allclose(loaded.cost.verify_ms, tables.cost.verify_ms)
  np.testing.assert_allclose(loaded.cost.draft_ms, tables.cost.draft_ms)
  blob = json.load(open(path))
  blob["format"] = "something-else"
  json.dump(blob, open(path, "w"))
  with pytest.raises(ValueError, match="table.json: format: expected 'av_jax-cost-table'"):
    costs.load_cost_table(path)


def test_cpu_spec_from_microbenchmarks():
  measured = costs.measure_cpu(matmul_n=64, small_bytes=1 << 18, large_bytes=1 << 20,
                               gather=dict(slots=2, positions=8, heads=2, head_dim=4,
                                           tokens=(2, 4)),
                               repeats=2, min_seconds=0.0)
  assert measured.matmul_flops > 0 and min(measured.gather_s) > 0 and measured.dispatch_s > 0
  spec = costs.cpu_spec_from(measured)
  assert spec.flops("float32") == measured.matmul_flops
  assert spec.first_touch_threshold == costs.GLIBC_MMAP_THRESHOLD
  # The small copy is charged its reads and writes, the large one also its page faults:
  # the spec gives back both copies' times (each term floored at a quarter of its copy).
  n, big = measured.small_bytes, measured.large_bytes
  write_s = max(measured.small_copy_s - measured.small_read_s, measured.small_copy_s / 4)
  assert n / spec.write_rate == pytest.approx(write_s, rel=1e-6)
  fault_s = max(measured.large_copy_s - measured.large_read_s - big / spec.write_rate,
                measured.large_copy_s / 4)
  assert big / spec.first_touch_bandwidth == pytest.approx(fault_s, rel=1e-6)
  for n, t in zip(measured.gather_bytes, measured.gather_s):
    assert spec.gather_rate(n) == pytest.approx(n / 4 / t, rel=1e-6)


def test_gather_curve_interpolates_by_output_size():
  spec = dataclasses.replace(DEVICE, gather_curve=((1e3, 100.0), (1e5, 1.0)))
  assert spec.gather_rate(1e4) == pytest.approx(10.0)  # log-log midpoint
  assert spec.gather_rate(1.0) == pytest.approx(100.0) and spec.gather_rate(1e9) == pytest.approx(1.0)
  assert DEVICE.gather_rate(1e4) == math.inf
  with pytest.raises(ValueError, match="gather_curve: expected ascending"):
    dataclasses.replace(DEVICE, gather_curve=((1e5, 1.0), (1e3, 10.0)))


def test_first_touch_is_charged_only_above_the_threshold():
  spec = dataclasses.replace(DEVICE, first_touch_bandwidth=10.0, first_touch_threshold=100.0)
  impl = costs.IMPLEMENTATIONS["fused"]
  small = costs.forward_kernels(SHAPE, tokens=1, requests=1, context_len=1, implementation=impl)
  assert costs.forward_seconds(small, SHAPE, spec)["first_touch"] == 0.0  # 80 B of temps
  big = costs.forward_kernels(SHAPE, tokens=3, requests=3, context_len=5, implementation=impl)
  # Temporaries: the float32 logits of the head and of the sampling, 2 x 120 bytes.
  assert costs.forward_seconds(big, SHAPE, spec)["first_touch"] == pytest.approx(24.0)
