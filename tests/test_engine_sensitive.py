"""A sampling test of the engine with the power to catch a draw-dependent budget.

`test_engine_sampling.py` runs 64 slots under an affine cost, where the lossy "current"
budget policy for an autoregressive drafter is nearly invisible. Here the regime is the
one where it shows (issue 12, item 5): B = 1, K = 2, an autoregressive drafter (draft_lm),
a frozen estimator (no refit, no exploration) and a step-shaped verify cost: verifying 1
or 2 drafts costs the same `HEIGHT`, so the budget is 0 or 2, and which one depends on the
predicted acceptance of position 2, whose feature depends on the drawn x1. The "current"
policy then decides whether to verify x1 from x1 itself; the shipped "lagged" policy uses
the previous step's budget.

Statistic: the first token of each request comes from prefill (t0), the second from the
first speculative step (t1). Chi-square of t1 given t0 against the exact target
conditional (t0 values seen >= 40 times, cells expected below 5 merged, statistics and
degrees of freedom summed over t0), plus the marginal of t1 against the exact marginal.
Tolerance: the shipped policy passes both at p > 1e-4; the negative control (the lossy
policy in the same engine) must fail the conditional test at p < 1e-6. With three keys at
this n the control's conditional p-value was 5e-13, 2e-8 and 5e-9 (marginal: 4e-9, 2e-5,
3e-6, too weak to assert), the shipped policy's 0.46-0.93.

Runtime: two engine compilations and 2 x 4096 one-step requests, about 20 s on 2 cores.
"""

import numpy as np
import pytest
from scipy import stats

from av_jax import arms
from av_jax import engine as E
from av_jax.decision import make_decider
from av_jax.estimator import EstimatorConfig
from av_jax.planner import PlannerConfig
from av_jax.models import sampling_probs
from av_jax.sampling import Sampling
from av_jax.selection import make_cost_model
from tests import _engine_fixtures as fx
from tests.test_engine_sampling import _chisquare_pvalue

PROMPT = [1, 2, 3]
NUM_REQUESTS = 4096
# The frozen estimator: a steep slope makes position 2's predicted acceptance (and so the
# budget) follow its feature, which depends on x1; the intercept keeps position 1 likely.
SLOPE, INTERCEPT = 3.0, 4.0
# Verifying 1 or 2 drafts costs HEIGHT, verifying none 1 (drafting free): the budget is 2
# when 1 + s1 + s2 > HEIGHT, else 0. HEIGHT splits the two likeliest contexts' draws.
HEIGHT = 1.95


def _engine(policy):
  cfg, drafter, params = fx.pair("draft_lm")
  # The budget rule (`av_jax.decision`, what `decision_step` runs) in the engine, drafting
  # every depth, so the budget alone decides what is verified.
  config = E.EngineConfig(num_slots=1, max_draft=2, max_len=8, mode="av", policy=policy,
                          sampling=Sampling(temperature=1.0),
                          estimator=EstimatorConfig(refit_interval=10**9, init_slope=SLOPE,
                                                    init_intercept=INTERCEPT),
                          programs=E.Programs(steps_per_chunk=1, buckets=(3,)))
  engine = E.make_engine(config, cfg, drafter)
  decider = make_decider(2, policy=engine.policy, estimator=config.estimator,
                         planner=PlannerConfig(explore_every=0))
  return engine._replace(decider=decider), cfg, params


def _run(engine, params):
  cost = make_cost_model(np.zeros(2), [0.0, 1.0, HEIGHT, HEIGHT])
  result = E.generate(engine, params, [PROMPT] * NUM_REQUESTS, max_new_tokens=2,
                      key=fx.key(5), cost=cost, keep_infos=True)
  tokens = np.array([c.tokens for c in result.completions])
  assert tokens.shape == (NUM_REQUESTS, 2)
  budgets = np.concatenate([i.budget[i.active > 0] for i in result.infos])
  return tokens, budgets


def _target_probs(cfg, params, sequences):
  logits = fx.target_logits(cfg, params.target, np.asarray(sequences))
  return np.asarray(sampling_probs(logits, temperature=1.0, top_p=1.0), np.float64)


def _conditional_pvalue(tokens, conditional, min_count=40):
  """Chi-square of tokens[:, 1] given tokens[:, 0] against `conditional [V, V]`."""
  chi2, dof = 0.0, 0
  for a in np.unique(tokens[:, 0]):
    rows = tokens[:, 0] == a
    n = int(rows.sum())
    if n < min_count:
      continue
    expected = conditional[a] / conditional[a].sum() * n
    counts = np.bincount(tokens[rows, 1], minlength=len(expected)).astype(float)
    assert counts[expected == 0].sum() == 0, "a token the target never emits was emitted"
    order = np.argsort(expected)
    k = int(np.sum(expected < 5))
    while 0 < k < len(order) and expected[order[:k]].sum() < 5:
      k += 1
    obs = np.r_[counts[order[:k]].sum(), counts[order[k:]]] if k else counts
    exp = np.r_[expected[order[:k]].sum(), expected[order[k:]]] if k else expected
    keep = exp > 0
    chi2 += float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    dof += int(keep.sum()) - 1
  assert dof > 20  # several contexts were tested
  return stats.chi2.sf(chi2, dof)


@pytest.fixture(scope="module")
def laws():
  cfg, _, params = fx.pair("draft_lm")
  p0 = _target_probs(cfg, params, [PROMPT])[0]
  conditional = _target_probs(cfg, params, [PROMPT + [a] for a in range(fx.VOCAB)])
  return p0 @ conditional, conditional


def _budget_splits(budgets):
  # The regime holds: both budgets occur often, and nothing else does.
  assert set(np.unique(budgets)) <= {0, 2}
  assert 0.2 < np.mean(budgets == 2) < 0.8


def test_lagged_budget_keeps_the_target_law_where_the_budget_splits(laws):
  marginal, conditional = laws
  engine, _, params = _engine(None)
  assert engine.policy == "lagged"  # the exact policy the engine picks for draft_lm
  tokens, budgets = _run(engine, params)
  _budget_splits(budgets)
  assert _conditional_pvalue(tokens, conditional) > 1e-4
  assert _chisquare_pvalue(tokens[:, 1], marginal) > 1e-4


def test_the_lossy_current_budget_is_caught(laws, monkeypatch):
  """Negative control: the same engine with the budget computed from this step's draws."""
  _, conditional = laws
  with pytest.raises(ValueError, match="not lossless"):
    _engine("current")  # the engine refuses it for an autoregressive drafter...
  monkeypatch.setattr(arms, "is_exact", lambda *args, **kwargs: True)  # ...unless forced
  engine, _, params = _engine("current")
  tokens, budgets = _run(engine, params)
  _budget_splits(budgets)
  assert _conditional_pvalue(tokens, conditional) < 1e-6


def _priced_engine(*, current: bool):
  """The `av` arm (the priced choice) in the same regime; `current`: the negative
  control, re-choosing after drafting from this step's features (lossy for a sampled
  autoregressive drafter)."""
  from av_jax.decider import make_policy_decider
  cfg, drafter, params = fx.pair("draft_lm")
  config = E.EngineConfig(num_slots=1, max_draft=2, max_len=8, mode="av",
                          sampling=Sampling(temperature=1.0),
                          estimator=EstimatorConfig(refit_interval=10**9, init_slope=SLOPE,
                                                    init_intercept=INTERCEPT),
                          programs=E.Programs(steps_per_chunk=1, buckets=(3,)))
  engine = E.make_engine(config, cfg, drafter)
  assert engine.decider.planner.policy == "lagged"
  if current:
    engine = engine._replace(decider=make_policy_decider(
        2, drafter_kind="autoregressive", greedy=True, gated=True,
        estimator=config.estimator))
  return engine, params


def test_the_priced_choice_keeps_the_target_law(laws):
  """The plan (drafting and the verified positions) is fixed before the draws: exact."""
  marginal, conditional = laws
  engine, params = _priced_engine(current=False)
  tokens, budgets = _run(engine, params)
  assert np.mean(budgets > 0) > 0.5  # it verifies drafts
  assert _conditional_pvalue(tokens, conditional) > 1e-4
  assert _chisquare_pvalue(tokens[:, 1], marginal) > 1e-4


def test_the_priced_choice_after_sampled_drafts_is_caught(laws):
  """Negative control: the same decision re-chosen after sampled autoregressive drafting
  (the budget reads x1 through S[2]) splits between 0 and 2 and is caught."""
  _, conditional = laws
  engine, params = _priced_engine(current=True)
  tokens, budgets = _run(engine, params)
  _budget_splits(budgets)
  assert _conditional_pvalue(tokens, conditional) < 1e-6
