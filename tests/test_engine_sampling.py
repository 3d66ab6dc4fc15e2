"""Sampling exactness of the whole engine: emitted tokens follow the target's law.

For every drafter kind and mode, thousands of requests with one prompt are decoded at
temperature 1; the empirical distributions of the 2nd and 3rd generated tokens (the first
ones produced by speculative steps) are compared with the exact target marginals, computed
by enumerating every continuation with the uncached target. Tolerance: a chi-square test
at p-value 1e-4 (a correct engine fails one run in 10,000 per check), cells with an
expected count below 5 merged.
"""

import numpy as np
import pytest
from scipy import stats

from av_jax import engine as E
from av_jax.estimator import EstimatorConfig
from av_jax.models import sampling_probs
from av_jax.sampling import Sampling
from tests import _engine_fixtures as fx

PROMPT = [1, 2, 3]
NUM_REQUESTS = 2048


def _exact_marginals(cfg, target_params, top_p):
  V = fx.VOCAB
  probs = lambda seqs: np.asarray(sampling_probs(fx.target_logits(cfg, target_params, seqs),
                                                 temperature=1.0, top_p=top_p), np.float64)
  p0 = probs(np.asarray([PROMPT]))[0]
  first = np.array([PROMPT + [a] for a in range(V)])
  p1 = probs(first)                                                   # [V, V]
  second = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)])
  p2 = probs(second).reshape(V, V, V)
  m1 = p0 @ p1
  m2 = np.einsum("a,ab,abc->c", p0, p1, p2)
  return m1, m2


def _chisquare_pvalue(samples, probs):
  probs = probs / probs.sum()  # float32 model probabilities: renormalise in float64
  counts = np.bincount(samples, minlength=len(probs)).astype(float)
  expected = probs * len(samples)
  order = np.argsort(expected)
  # Merge every cell expected below 5, plus the next rarest until the group reaches 5.
  k = int(np.sum(expected < 5))
  while 0 < k < len(order) and expected[order[:k]].sum() < 5:
    k += 1
  merged_obs = np.r_[counts[order[:k]].sum(), counts[order[k:]]] if k else counts
  merged_exp = np.r_[expected[order[:k]].sum(), expected[order[k:]]] if k else expected
  keep = merged_exp > 0
  assert counts[expected == 0].sum() == 0, "a token the target never emits was emitted"
  return stats.chisquare(merged_obs[keep], merged_exp[keep]).pvalue


@pytest.mark.parametrize("kind,mode,top_p", [
    ("block", "target_only", 1.0),
    ("block", "fixed", 1.0),
    ("block", "av", 1.0),
    ("block", "oracle", 1.0),
    ("block_head", "av_head", 1.0),
    ("eagle", "av", 0.9),
    ("draft_lm", "av", 1.0),
])
def test_generated_tokens_follow_target_distribution(kind, mode, top_p):
  cfg, drafter, params = fx.pair(kind)
  engine = E.make_engine(E.EngineConfig(num_slots=64, max_draft=3, max_len=32, mode=mode,
                                        sampling=Sampling(temperature=1.0, top_p=top_p),
                                        estimator=EstimatorConfig(refit_interval=4),
                                        programs=E.Programs(steps_per_chunk=2)),
                         cfg, drafter)
  result = E.generate(engine, params, [PROMPT] * NUM_REQUESTS, max_new_tokens=3,
                      key=fx.key(11))
  tokens = np.array([c.tokens for c in result.completions])
  assert tokens.shape == (NUM_REQUESTS, 3)
  if mode != "target_only":
    assert result.stats["verified"] > 0  # the speculative path was exercised
  m1, m2 = _exact_marginals(cfg, params.target, top_p)
  for position, law in ((1, m1), (2, m2)):
    pvalue = _chisquare_pvalue(tokens[:, position], law)
    assert pvalue > 1e-4, (position, pvalue)


def test_skipping_unprofitable_drafts_keeps_the_target_distribution():
  """AV with a parallel drafter drafts only where its plan (from earlier steps only) says
  drafting pays: steps that draft and steps that do not both occur, and the emitted
  tokens still follow the target's law."""
  from av_jax.selection import make_cost_model
  cfg, drafter, params = fx.pair("block")
  B, K = 64, 3
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=32, mode="av",
                                        sampling=Sampling(temperature=1.0),
                                        estimator=EstimatorConfig(refit_interval=4),
                                        programs=E.Programs(steps_per_chunk=2)),
                         cfg, drafter)
  # Drafting costs as much as a target step: it pays only with near-certain acceptance.
  cost = make_cost_model(np.full(B + 1, 1.0), 1.0 + 0.002 * np.arange(B * (K + 1) + 1))
  result = E.generate(engine, params, [PROMPT] * NUM_REQUESTS, max_new_tokens=3,
                      key=fx.key(12), cost=cost, keep_infos=True)
  drafted = np.concatenate([i.drafting[i.active > 0] for i in result.infos])
  assert drafted.any() and not drafted.all()
  tokens = np.array([c.tokens for c in result.completions])
  m1, m2 = _exact_marginals(cfg, params.target, 1.0)
  for position, law in ((1, m1), (2, m2)):
    pvalue = _chisquare_pvalue(tokens[:, position], law)
    assert pvalue > 1e-4, (position, pvalue)
