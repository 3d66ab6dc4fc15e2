"""Studies suite: fits against scikit-learn, metrics, drift counting, Pareto, and the
labelled-draft collection and report on tiny engines."""

import dataclasses
import json
import os
import re
import sys

import jax
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from av_jax import engine as E
from av_jax.studies import analysis as A
from av_jax.studies import collect as C
from av_jax.studies import report as R
from av_jax.studies import throughput as T
from tests import _engine_fixtures as fx


def _synthetic(n=20000, K=4, slope=1.3, intercepts=(1.0, 0.4, -0.2, -0.8), seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(0.0, 2.0, n)
  pos = rng.integers(0, K, n)
  p = 1 / (1 + np.exp(-(slope * x + np.asarray(intercepts)[pos])))
  return x, pos, rng.random(n) < p


@pytest.mark.parametrize("per_position", [False, True])
def test_fit_logistic_equals_scikit_learn_mle(per_position):
  x, pos, y = _synthetic()
  fit = A.fit_logistic(x, pos, y, 4, per_position_slope=per_position, l2=0.0)
  onehot = np.eye(4)[pos]
  design = np.concatenate([onehot * x[:, None] if per_position else x[:, None], onehot], 1)
  ref = LogisticRegression(C=np.inf, fit_intercept=False, tol=1e-10, max_iter=1000)
  ref.fit(design, y)
  coef = np.concatenate([np.atleast_1d(fit.slope), fit.intercepts])
  np.testing.assert_allclose(coef, ref.coef_[0], atol=2e-4)
  if not per_position:  # and the truth is recovered within sampling error
    assert abs(float(fit.slope) - 1.3) < 0.08
    np.testing.assert_allclose(fit.intercepts, [1.0, 0.4, -0.2, -0.8], atol=0.1)


def test_fit_logistic_bad_input():
  with pytest.raises(ValueError, match="position"):
    A.fit_logistic(np.zeros(3), np.array([0, 1, 5]), np.zeros(3, bool), 4)
  with pytest.raises(ValueError, match="x, position, label"):
    A.fit_logistic(np.zeros(3), np.zeros(2, int), np.zeros(3, bool), 4)


def test_score_matches_scikit_learn_and_numpy_ece():
  rng = np.random.default_rng(1)
  for n in (50, 1500, 5000):  # different padded sizes
    p = rng.random(n).astype(np.float32)
    y = rng.random(n) < p ** 2
    s = A.score(p, y)
    assert s["n"] == n
    np.testing.assert_allclose(s["auc"], roc_auc_score(y, p), atol=1e-5)
    np.testing.assert_allclose(s["log_loss"], sk_log_loss(y, p), rtol=1e-4)
    bins = np.minimum((p * 15).astype(int), 14)
    ece = sum(abs(p[bins == j].sum() - y[bins == j].sum()) for j in range(15)) / n
    np.testing.assert_allclose(s["ece"], ece, atol=1e-5)
  assert np.isnan(A.score(np.zeros(0), np.zeros(0, bool))["auc"])


def _drafts(x, pos, y, steps):
  n = len(x)
  feats = np.zeros((n, len(C.FEATURE_NAMES)), np.float32)
  feats[:, C.FEATURE_NAMES.index("logit_qmax")] = x
  feats[:, C.FEATURE_NAMES.index("top2_margin")] = np.abs(x)
  feats[:, C.FEATURE_NAMES.index("neg_entropy")] = -np.exp(-x)
  feats[:, C.FEATURE_NAMES.index("logit_q_sampled")] = x - 0.1
  feats[:, C.FEATURE_NAMES.index("gumbel_q_sampled")] = x
  return C.Drafts(features=feats, position=pos.astype(np.int32), label=y,
                  served=np.full(n, y.mean(), np.float32), conf=np.zeros(n, np.float32),
                  step=steps.astype(np.int32), segment=np.zeros(n, np.int32))


def test_out_of_sample_fits_on_early_steps_and_scores_later_ones():
  x, pos, y = _synthetic(n=20000, slope=0.6, intercepts=(1.5, 1.0, 0.5, 0.0), seed=2)
  steps = np.arange(20000) // 250  # 80 steps
  drafts = _drafts(x, pos, y, steps)
  early, late = A.split_by_step(drafts)
  assert early.sum() == late.sum() == 10000 and np.all(steps[early] < 40)
  oos = A.out_of_sample({"d": drafts}, 4)
  p, labels, positions = oos["logit(q_max), shared slope (shipped)"]
  np.testing.assert_array_equal(labels, y[late])
  np.testing.assert_array_equal(positions, pos[late])
  shipped = A.score(p, labels)
  assert shipped["ece"] < 0.03 and shipped["auc"] > 0.75
  # The raw q_max is miscalibrated here (intercepts away from 0); the constant served
  # prediction has no ranking power.
  assert A.score(*oos["q_max, no fit"][:2])["ece"] > shipped["ece"] + 0.05
  assert A.score(*oos["online estimator (served)"][:2])["auc"] == pytest.approx(0.5)
  assert "confidence head (trained)" not in oos


def test_recovery_rounds():
  ece = [0.01, 0.01, 0.01, 0.01, 0.2, 0.08, 0.03, 0.012, 0.011, 0.01, 0.02, 0.05, 0.01,
         0.01, 0.01, 0.01]
  seg = [0] * 4 + [1] * 6 + [2] * 6
  rows = [dict(round=i, segment=s, ece=e) for i, (s, e) in enumerate(zip(seg, ece))]
  rec = A.recovery_rounds(rows, slack=0.01)
  # Levels 0.0105 and 0.01 (medians of the last two rounds): threshold 0.0205.
  assert [r["rounds_to_recover"] for r in rec] == [3, 2]
  assert rec[0]["first_ece"] == 0.2
  never = [dict(round=i, segment=int(i >= 3), ece=0.0 if i < 3 else 0.5 - 0.1 * (i == 5))
           for i in range(6)]
  assert A.recovery_rounds(never, slack=0.01)[0]["rounds_to_recover"] == 2


def test_pareto_front_equals_brute_force():
  rng = np.random.default_rng(3)
  for _ in range(20):
    pts = [tuple(v) for v in rng.integers(0, 6, (8, 2)).astype(float)]
    front = set(T.pareto_front(pts))
    for i, (x, y) in enumerate(pts):
      dominated = any(a >= x and b >= y and (a, b) != (x, y) for a, b in pts)
      assert (i in front) == (not dominated)


def test_ratios_are_per_repeat():
  rows = [dict(drafter="b", workload="w", concurrency=4, repeat=r, arm=a, tokens_per_s=t)
          for r, (f, v) in enumerate([(100.0, 150.0), (50.0, 60.0)])
          for a, t in (("fixed K=8", f), ("AV (K=8)", v))]
  out = T.ratios(rows, baseline="fixed K=8")[("b", "w", 4, "AV (K=8)")]
  assert out["min"] == pytest.approx(1.2) and out["max"] == pytest.approx(1.5)
  assert out["median"] == pytest.approx(1.35) and out["n"] == 2


@pytest.fixture(scope="module")
def tiny_stream():
  cfg, drafter, params = fx.pair("block")
  config = C.study_config(slots=4, max_draft=3, max_len=40, temperature=1.0, top_p=0.9,
                          refit_interval=4, steps_per_chunk=4)
  engine = E.make_engine(config, cfg, drafter)
  rng = np.random.default_rng(0)
  segments = [rng.integers(1, fx.VOCAB, (8, 5)).tolist(), [[3, 3, 3, 3]] * 8]
  return C.collect(engine, params, segments, steps=8, max_new=12, key=fx.key(0))


def test_collected_drafts_are_the_labelled_ones_with_consistent_features(tiny_stream):
  d, t = tiny_stream.drafts, tiny_stream.trace
  assert len(d) > 20 and set(np.unique(d.segment)) == {0, 1}
  assert d.step.min() == 0 and d.step.max() == 15  # 2 segments x 8 steps
  assert np.all((d.position >= 0) & (d.position < 3))
  # Labels are prefixes: a position is labelled only if every earlier one was accepted.
  assert 0 < d.label.mean() < 1
  qmax, sampled = d.feature("logit_qmax"), d.feature("logit_q_sampled")
  assert np.all(sampled <= qmax + 1e-4)             # q(drawn) <= q_max
  assert np.all(d.feature("top2_margin") >= 0)
  assert np.all(d.feature("neg_entropy") <= 1e-6)
  np.testing.assert_allclose(d.feature("gumbel_q_sampled"),
                             -np.log(-np.log(1 / (1 + np.exp(-sampled)))), atol=2e-3)
  assert np.all((d.served > 0) & (d.served < 1))
  # The estimator carries over the switch: refits keep counting, coefficients change.
  assert np.all(np.diff(t.num_refits) >= 0) and t.num_refits[-1] >= 3
  assert list(np.unique(t.segment)) == [0, 1] and np.all(np.isfinite(t.intercepts))


def test_collect_refuses_an_engine_without_recorded_features():
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=24), cfg, drafter)
  with pytest.raises(ValueError, match="record_features"):
    C.collect(engine, params, [[[1, 2]]], steps=4, max_new=4, key=fx.key(0))


def test_report_writes_markdown_plots_and_json(tiny_stream, tmp_path):
  from av_jax.studies.run import Settings
  s = Settings(k=3, label_slots=4, label_steps=8, refit_interval=4, drift_steps=8,
               drift_workloads=("a", "b"), concurrencies=(2, 4), pareto_ks=(0, 2),
               warmup_rounds=1)
  d = tiny_stream.drafts
  head = C.Drafts(**{**d.__dict__, "conf": np.clip(d.served + 0.05, 0, 1)})
  labels = dict(streams={("block", "code"): d, ("block_head", "code"): head},
                traces={("block", "code"): tiny_stream.trace}, drift=tiny_stream)
  s.modelled_concurrencies, s.modelled_drafters = (16, 32), ("eagle",)

  def sweep(drafter, concurrencies, speed, clock):
    rows = []
    for c in concurrencies:
      for r in range(2):
        for arm in T.pareto_arms((0, 2), 3, oracle=False, confstop=(0.8,)):
          tps = speed[arm.mode] * c
          rows.append(dict(drafter=drafter, workload="mixed", concurrency=c, arm=arm.name,
                           mode=arm.mode, k=arm.k, repeat=r, clock=clock,
                           tokens_per_s=tps + r, per_request_tokens_per_s=(tps + r) / c,
                           tokens_per_step=2.0, verified_per_step=3.0, seconds=1.0,
                           steps=10, acceptance=0.5, drafted_share=0.5,
                           draft_passes_per_step=1.5))
    return rows
  # Wall: AV 1.3x the best static arm (fixed K=2).
  rows = sweep("block", (2, 4), {"target_only": 100.0, "fixed": 100.0, "av": 130.0,
                                 "confstop:0.8": 90.0}, "wall")
  # Modelled: AV 0.95x target only (the best static).
  modelled = sweep("eagle", (16, 32), {"target_only": 100.0, "fixed": 60.0, "av": 95.0,
                                       "confstop:0.8": 90.0}, "h200:llama3-8b")
  overhead = dict(batch=4, k=3, vocab=24, decision_ms=0.5, decision_ms_all=[0.5],
                  av_step_ms=10.0, share=0.05, recompiles=0)
  results = dict(command="test", settings={}, hardware=dict(
      cpu="x", usable_cores=2, backend="cpu", device="cpu", jax=jax.__version__,
      python="3", load_avg_start=[0.0, 0.0, 0.0]), timings=dict(total_s=1.0))
  R.write(str(tmp_path), results, s, labels=labels, throughput_rows=rows,
          modelled_rows=modelled, overhead=overhead)
  md = (tmp_path / "studies.md").read_text()
  for title in ("## Goals", "## 1. Labelled drafts", "## 2. Feature table",
                "## 3. Estimator vs confidence head", "## 4. Slope and intercepts",
                "## 5. Throughput", "## 5m. Throughput on the modelled clock", "Modelled, not measured",
                "## 6. Overhead"):
    assert title in md
  for png in ("auc_per_position", "reliability", "coefficient_traces", "drift_ece", "pareto",
              "av_ratio", "modelled_pareto", "modelled_ratio"):
    assert os.path.getsize(tmp_path / f"{png}.png") > 1000
  data = json.loads((tmp_path / "studies.json").read_text())
  goals = {g[0]: g for g in data["goals"]}
  verdict = lambda name: goals[name][2]
  assert verdict("wall: AV >= 0.97x the best static arm everywhere") == "met"
  assert "1.300x" in goals["wall: AV >= 0.97x the best static arm everywhere"][1]
  assert verdict("wall: on mixed, AV >= 1.10x the best static arm at one concurrency or more"
                 ) == "met"
  assert verdict("modelled: AV >= 0.98x the best static arm everywhere") == \
      "missed at eagle/mixed B=16 (target only (K=0)), eagle/mixed B=32 (target only (K=0))"
  assert verdict("modelled: AV >= 1.0x the best confidence-stop arm everywhere") == "met"
  assert verdict("Decision <= 2% of a decode step at concurrency 4, charged at every "
                 "drafting step").startswith("missed")
  versus = {v["concurrency"]: v for v in data["modelled"]["versus"]}
  np.testing.assert_allclose(versus[16]["av_vs_best_static"],
                             (95 * 16 + 0.5) / (100 * 16 + 0.5), rtol=1e-6)
  assert versus[16]["best_static"] == "target only (K=0)"
  table = {r["predictor"]: r for r in data["labels"]["feature_table"]}
  assert not table["logit(q_sampled), fitted"]["lossless"]
  assert table["confidence head (trained)"]["n"] == table[R.SERVED]["n"] // 2


def test_sweep_arms_and_the_recorded_commit():
  arms = T.pareto_arms((0, 2), 4, confstop=(0.5, 0.8))
  assert [(a.mode, a.k) for a in arms] == [
      ("target_only", 1), ("fixed", 2), ("av", 4), ("confstop:0.5", 4),
      ("confstop:0.8", 4), ("oracle", 4)]
  assert len({a.name for a in arms}) == len(arms)
  assert [a.mode for a in T.on_off_arms(8)] == ["fixed", "av"]
  with pytest.raises(ValueError, match="confstop"):
    T.pareto_arms((0,), 4, confstop=(1.5,))
  from av_jax import _machine
  commit = _machine.commit()
  assert commit is None or re.fullmatch(r"[0-9a-f]{4,40}\+?", commit)


def test_settings_refuse_a_stream_that_ends_in_warm_up():
  from av_jax.studies.settings import Settings
  Settings().validate()
  Settings.quick().validate()
  with pytest.raises(ValueError, match="label_steps"):
    Settings(label_steps=32, refit_interval=16, warmup_rounds=2).validate()
  with pytest.raises(ValueError, match="drift_steps"):
    Settings(drift_steps=90, refit_interval=16).validate()


def test_label_streams_get_enough_prompts_that_no_slot_idles():
  """A stream of S steps keeps every slot labelling to its last step: `label_prompts`
  gives each slot as many requests as the fastest possible requests could use. The old
  fixed 4 per slot (the negative control) runs out and leaves slots idle."""
  from av_jax.studies.run import Settings, label_prompts
  s = Settings(k=3, label_slots=4, label_steps=24, label_max_new=4, drift_steps=8,
               refit_interval=4)
  cfg, drafter, params = fx.pair("block")
  config = C.study_config(slots=4, max_draft=3, max_len=24, temperature=1.0, top_p=0.9,
                          refit_interval=4, steps_per_chunk=4)
  engine = E.make_engine(config, cfg, drafter)
  rng = np.random.default_rng(1)

  def busy_slots_per_step(num_prompts):
    prompts = rng.integers(1, fx.VOCAB, (num_prompts, 5)).tolist()
    d = C.collect(engine, params, [prompts], steps=s.label_steps, max_new=s.label_max_new,
                  key=fx.key(0)).drafts
    first = d.position == 0  # every busy slot labels its first draft every step
    return np.bincount(d.step[first], minlength=s.label_steps)

  assert label_prompts(s) == 4 * (24 // 1 + 1)  # a request can end after ceil(4 / 4) step
  # Slots are refilled between 4-step chunks, so a chunk's busy slot-steps are compared.
  chunks = busy_slots_per_step(label_prompts(s)).reshape(-1, 4).sum(1)
  assert chunks.min() >= 0.75 * chunks[0], chunks
  old = busy_slots_per_step(4 * s.label_slots).reshape(-1, 4).sum(1)
  assert old[-1] < 0.75 * old[0], old  # the old count: its slots idle at the end


def test_merge_adds_another_runs_modelled_points_and_names_it(tmp_path):
  """`benchmarks/merge_studies.py`: a second process's modelled concurrencies join the
  report (goals and the versus table recomputed) and its command is listed; a run that
  adds nothing, or ran on another clock, is refused."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
  import merge_studies
  from av_jax.studies.run import Settings

  def run(out, concurrencies, command, clock="h200:llama3-8b"):
    s = Settings(k=3, modelled_concurrencies=concurrencies, modelled_drafters=("eagle",),
                 modelled_clock=clock)
    rows = [dict(drafter="eagle", workload="mixed", concurrency=c, arm=arm.name,
                 mode=arm.mode, k=arm.k, repeat=0, clock=clock,
                 tokens_per_s=(130.0 if arm.mode == "av" else 100.0) * c,
                 per_request_tokens_per_s=100.0, tokens_per_step=2.0, verified_per_step=3.0,
                 seconds=1.0, steps=10, acceptance=0.5, drafted_share=0.5,
                 draft_passes_per_step=1.5)
            for c in concurrencies for arm in T.pareto_arms((0, 2), 3, oracle=False)]
    results = dict(command=command, settings=dataclasses.asdict(s), commit="abc1234",
                   hardware=dict(cpu="x", usable_cores=2, backend="cpu", device="cpu",
                                 jax=jax.__version__, python="3",
                                 load_avg_start=[0.0, 0.0, 0.0]),
                   timings=dict(modelled_s=5.0, total_s=6.0))
    os.makedirs(out)
    R.write(str(out), results, s, modelled_rows=rows)

  run(tmp_path / "a", (16,), "av-jax bench A")
  run(tmp_path / "b", (256,), "av-jax bench B")
  run(tmp_path / "c", (64,), "av-jax bench C", clock="tpu-v5e:llama3-8b")
  merged = merge_studies.merge(str(tmp_path / "a"), [str(tmp_path / "b")])
  assert sorted(v["concurrency"] for v in merged["modelled"]["versus"]) == [16, 256]
  assert merged["settings"]["modelled_concurrencies"] == [16, 256]
  md = (tmp_path / "a" / "studies.md").read_text()
  assert "Merged in" in md and "`av-jax bench B`" in md
  with pytest.raises(ValueError, match="adds no modelled"):
    merge_studies.merge(str(tmp_path / "a"), [str(tmp_path / "b")])
  with pytest.raises(ValueError, match="clock"):
    merge_studies.merge(str(tmp_path / "a"), [str(tmp_path / "c")])
