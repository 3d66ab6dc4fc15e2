"""av_jax.policy: the one priced choice, its parts and their compositions."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import policy as P


def _cost(B, K, *, verify_fixed=1.0, per_token=0.05, pass_ms=0.2, parallel=False):
  depth = np.zeros((B + 1, K), np.float32)
  if parallel:
    depth[1:, 0] = pass_ms * 3 + 0.01 * np.arange(1, B + 1)
  else:
    depth[1:, :] = pass_ms + 0.01 * np.arange(1, B + 1)[:, None]
  verify = verify_fixed + per_token * np.arange(B * (K + 1) + 1)
  return P.StepCost(jnp.asarray(depth), jnp.asarray(verify, jnp.float32))


def _rate(num, survival, active, cost, *, sunk=0.0, price=True, parallel=False):
  """NumPy: expected tokens per ms of verifying `num [B]` (a prefix of each row)."""
  B, K = survival.shape
  num = np.where(active, num, 0)
  R = int(active.sum())
  gain = sum(survival[b, :num[b]].sum() for b in range(B))
  total = sunk + float(cost.verify_ms[R + num.sum()])
  if price:
    rows = np.asarray([(num > k).sum() for k in range(K)])
    if parallel:
      rows = np.where(np.arange(K) < num.max(), (num > 0).sum(), 0)
    total += sum(float(cost.draft_depth_ms[rows[k], k]) for k in range(K))
  return (R + gain) / total


def _survival(rng, B, K):
  return np.cumprod(rng.uniform(0.05, 1.0, (B, K)), axis=1).astype(np.float32)


@pytest.mark.parametrize("seed", range(6))
def test_verify_choice_is_the_best_prefix_vector(seed):
  # After drafting (one cap, drafting sunk) the optimum over every per-row prefix vector
  # is a top-n of the survivals: `choose` must find it (exhaustive over (K+1)^B vectors).
  rng = np.random.default_rng(seed)
  B, K = 3, 3
  survival = _survival(rng, B, K)
  active = np.asarray([True, True, seed % 2 == 0])
  cost = _cost(B, K, per_token=rng.uniform(0.01, 0.6))
  eligible = np.ones((B, K), bool)
  got = P.choose(jnp.asarray(survival), eligible=jnp.asarray(eligible),
                 forced=jnp.zeros((B, K), bool), active=jnp.asarray(active), cost=cost,
                 sunk_ms=0.3, price_drafting=False)
  best = max(_rate(np.asarray(v), survival, active, cost, sunk=0.3, price=False)
             for v in itertools.product(range(K + 1), repeat=B))
  np.testing.assert_allclose(_rate(np.asarray(got.num), survival, active, cost, sunk=0.3,
                                   price=False), best, rtol=1e-5)
  assert np.all(np.asarray(got.num)[~active] == 0)


def _family_best(survival, active, cost, *, parallel):
  """NumPy reference of `choose`'s candidates: for each depth cap d, the top n of the
  positions at depths < d by survival (ties: lower position, then lower slot)."""
  B, K = survival.shape
  entries = sorted(((-survival[b, k], k, b) for b in range(B) for k in range(K) if active[b]))
  best, best_num = -1.0, None
  for d in range(1, K + 1):
    kept = [(k, b) for _, k, b in entries if k < d]
    for n in range(len(kept) + 1):
      num = np.zeros(B, int)
      for k, b in kept[:n]:
        num[b] = max(num[b], k + 1)
      r = _rate(num, survival, active, cost, parallel=parallel)
      if r > best + 1e-9:
        best, best_num = r, num
  return best, best_num


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_plan_choice_matches_its_reference(seed, parallel):
  rng = np.random.default_rng(100 + seed)
  B, K = 4, 3
  survival = _survival(rng, B, K)
  active = np.asarray([True, True, True, seed != 0])
  cost = _cost(B, K, per_token=rng.uniform(0.01, 0.3), pass_ms=rng.uniform(0.05, 0.8),
               parallel=parallel)
  got = jax.jit(lambda s, a: P.choose(s, eligible=jnp.ones((B, K), bool),
                                      forced=jnp.zeros((B, K), bool), active=a, cost=cost,
                                      shared_passes=parallel))(jnp.asarray(survival),
                                                               jnp.asarray(active))
  best, _ = _family_best(survival, active, cost, parallel=parallel)
  np.testing.assert_allclose(_rate(np.asarray(got.num), survival, active, cost,
                                   parallel=parallel), best, rtol=1e-5)
  np.testing.assert_allclose(float(got.expected) / float(got.cost_ms), best, rtol=1e-5)


def test_the_module_docstrings_worked_example():
  # One request, K = 2; verify 0.9 + 0.1 ms a token (1.0 ms for the base token alone),
  # 0.2 ms a drafter pass. Survivals [0.9, 0.5]: rates 1.0, 1.9/1.3, 2.4/1.6 -> both.
  # Survivals [0.3, 0.1]: 1.0, 1.3/1.3, 1.4/1.6 -> nothing (the smaller n on a tie).
  cost = P.StepCost(jnp.asarray([[0.0, 0.0], [0.2, 0.2]]), 0.9 + 0.1 * jnp.arange(4.0))
  pick = lambda s: P.choose(jnp.asarray([s]), eligible=jnp.ones((1, 2), bool),
                            forced=jnp.zeros((1, 2), bool), active=jnp.ones((1,), bool),
                            cost=cost)
  good = pick([0.9, 0.45])
  assert int(good.num[0]) == 2
  np.testing.assert_allclose(float(good.expected) / float(good.cost_ms), 2.35 / 1.6, rtol=1e-6)
  assert int(pick([0.3, 0.03]).num[0]) == 0


def _predicting(B, K, p):
  """A shared-pass autoregressive policy whose every request is predicted acceptance `p`
  at every depth (identity estimator: the memory's features are the probabilities)."""
  policy = P.make_policy(K, drafter_kind="autoregressive", estimator=P.identity_estimator(K),
                         memory=P.latest_features(), shared_passes=True)
  state = policy.init(B)
  return policy, state._replace(memory=state.memory._replace(
      latest=jnp.full((B, K), p, jnp.float32), known=jnp.ones((B, K), bool)))


def test_keep_drafting_docstrings_worked_example():
  # One request, K = 3, predicted acceptance 0.4 at every depth, verify 0.9 + 0.1 ms a
  # token, 0.1 ms a pass.
  K = 3
  policy, state = _predicting(1, K, 0.4)
  cost = P.StepCost(jnp.asarray([[0.0] * K, [0.1] * K]), 0.9 + 0.1 * jnp.arange(5.0))
  active = jnp.ones((1,), bool)
  plan = policy.plan(state, active, cost)
  assert int(plan.depth[0]) == 1
  drafted = jnp.asarray([[True, False, False]])
  keep = lambda p1: bool(policy.keep_drafting(
      state, plan, jnp.asarray([[p1, 0.0, 0.0]]), drafted, 1, active=active, cost=cost)[0])
  assert keep(0.95)
  assert not keep(0.5)
  # A request that did not draft depth 1 never drafts on; an inactive one neither.
  assert not bool(policy.keep_drafting(state, plan, jnp.full((1, K), 0.95),
                                       jnp.zeros((1, K), bool), 1, active=active,
                                       cost=cost)[0])
  assert not bool(policy.keep_drafting(state, plan, jnp.full((1, K), 0.95), drafted, 1,
                                       active=jnp.zeros((1,), bool), cost=cost)[0])


def test_keep_drafting_prices_the_requests_outside_the_rows():
  # Two drafting rows gathered from a batch of 40 active requests: with `num_active` the
  # other 38 emit their token and are verified too (the table is steeper there), so
  # drafting on, which pays for the two rows alone, stops: (41.8 + 1.62) / 22.04 <
  # 41.8 / 21.02.
  K = 2
  policy, state = _predicting(2, K, 0.6)
  T = 40 * (K + 1) + 1
  verify = np.where(np.arange(T) <= 8, 1.0 + 0.01 * np.arange(T), 0.5 * np.arange(T))
  cost = P.StepCost(jnp.full((41, K), 0.01), jnp.asarray(verify, jnp.float32))
  active = jnp.ones((2,), bool)
  zb, zf = jnp.zeros((2,), bool), jnp.zeros((), jnp.float32)
  plan = P.Plan(draft=~zb, depth=jnp.ones((2,), jnp.int32), num=jnp.ones((2,), jnp.int32),
                explore=zb, explore_ms=zf, expected=zf, cost_ms=zf)
  drafted = jnp.asarray([[True, False], [True, False]])
  probs = jnp.full((2, K), 0.9)
  alone = policy.keep_drafting(state, plan, probs, drafted, 1, active=active, cost=cost)
  among = policy.keep_drafting(state, plan, probs, drafted, 1, active=active, cost=cost,
                               num_active=40)
  assert bool(jnp.all(alone)) and not bool(jnp.any(among))


def test_depth_caps_keep_one_deep_request_from_buying_passes():
  # One confident request (survival 0.95 ... 0.8) and three doubtful ones (0.5, 0.25,
  # ...); passes cost 1.0 ms whatever the rows, verification 4.0 ms flat. Everyone to
  # depth 2 (8.1 tokens in 6 ms) beats depth 1 (6.45 / 5), depth 3 (9.33 / 7) and the
  # confident request alone to depth 4 (7.5 / 8).
  B, K = 4, 4
  cost = P.StepCost(jnp.full((B + 1, K), 1.0).at[0].set(0.0), jnp.full((B * (K + 1) + 1,), 4.0))
  survival = jnp.asarray([[0.95, 0.9, 0.85, 0.8]] + [[0.5, 0.25, 0.125, 0.0625]] * 3)
  got = P.choose(survival, eligible=jnp.ones((B, K), bool), forced=jnp.zeros((B, K), bool),
                 active=jnp.ones((B,), bool), cost=cost)
  np.testing.assert_array_equal(got.num, [2, 2, 2, 2])
  best, _ = _family_best(np.asarray(survival), np.ones(B, bool), cost, parallel=False)
  np.testing.assert_allclose(float(got.expected) / float(got.cost_ms), best, rtol=1e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_every_candidates_drafting_price_is_its_rows_price(shared):
  # `choose` prices all (cap, n) candidates from one count of rows by depth; each must
  # equal `StepCost.draft` of that candidate's own rows (a shared pass: every drafting
  # row pays each depth up to the deepest), for any ranking, ineligible entries included.
  rng = np.random.default_rng(7)
  B, K = 5, 4
  M = B * K
  depth_ms = rng.uniform(0.1, 1.0, (B + 1, K)).astype(np.float32)
  depth_ms[0] = 9.0  # a depth no row drafts costs nothing, whatever row 0 holds
  cost = P.StepCost(jnp.asarray(depth_ms), jnp.zeros((M + B + 1,)))
  ranked_k = rng.permutation(np.repeat(np.arange(K), B))
  ranked_ok = rng.uniform(size=M) < 0.8
  caps = jnp.arange(1, K + 1)
  got = np.asarray(P._drafting_ms(cost, jnp.asarray(ranked_k, jnp.int32),
                                  jnp.asarray(ranked_ok), caps, shared))
  for c in range(1, K + 1):
    for n in range(M + 1):
      take = (ranked_k[:n] < c) & ranked_ok[:n]
      rows = np.bincount(ranked_k[:n][take], minlength=K)
      if shared:
        rows = np.where(np.arange(K) < np.count_nonzero(rows), rows[0], 0)
      want = sum(float(depth_ms[r, k]) for k, r in enumerate(rows) if r > 0)
      np.testing.assert_allclose(got[c - 1, n], want, rtol=1e-5, atol=1e-6)


def test_nothing_pays_drafts_nothing_and_forced_positions_are_kept():
  B, K = 3, 4
  cost = _cost(B, K, pass_ms=1.0)
  survival = jnp.full((B, K), 1e-3)
  none = jnp.zeros((B, K), bool)
  got = P.choose(survival, eligible=jnp.ones((B, K), bool), forced=none,
                 active=jnp.ones((B,), bool), cost=cost)
  assert int(got.budget) == 0 and not np.any(got.num)
  forced = none.at[1].set(True)
  got = P.choose(survival, eligible=jnp.ones((B, K), bool), forced=forced,
                 active=jnp.ones((B,), bool), cost=cost)
  np.testing.assert_array_equal(got.num, [0, K, 0])


def test_a_drafting_step_pays_the_drafting_floor_and_a_quiet_one_does_not():
  """At the tail of a batch (one of B = 4 active) a drafting step runs the verification of
  all B slots: priced at the floor, drafting no longer pays where the token table alone
  said it did. The floor never prices a candidate that drafts nothing, and after drafting
  every candidate pays it. Negative control: floor 0 is the table's price."""
  B, K = 4, 2
  cost = _cost(B, K, verify_fixed=1.0, per_token=0.05, pass_ms=0.05)
  survival = jnp.asarray(np.tile([[0.8, 0.6]], (B, 1)), jnp.float32)
  active = jnp.asarray([True, False, False, False])
  kw = dict(eligible=jnp.ones((B, K), bool), forced=jnp.zeros((B, K), bool), active=active)
  got = P.choose(survival, cost=cost, **kw)
  assert int(got.budget) == K  # floor 0: (1 + 1.28) / (1.15 + 0.12) beats 1 / 1.05
  floored = cost._replace(drafting_floor_ms=jnp.float32(3.0))  # 2.28 / 3.12: it does not
  got = P.choose(survival, cost=floored, **kw)
  assert int(got.budget) == 0 and float(got.cost_ms) == pytest.approx(1.05)
  # After drafting (the drafting sunk) every candidate pays the floor: n = 0 costs it too.
  after = P.choose(survival, cost=floored, sunk_ms=0.1, price_drafting=False,
                   eligible=jnp.ones((B, K), bool), forced=jnp.zeros((B, K), bool),
                   active=active)
  assert int(after.budget) == K and float(after.cost_ms) == pytest.approx(3.1)


def _outcome(B, K, *, features=None, drafted=None, step_ms=1.0, explore_ms=0.0):
  z = jnp.zeros((B, K), bool)
  return P.StepOutcome(
      features=jnp.zeros((B, K)) if features is None else features,
      drafted=z if drafted is None else drafted, accepted=z, labeled=z,
      step_ms=jnp.float32(step_ms), explore_ms=jnp.float32(explore_ms))


def test_memory_decays_toward_the_depth_mean_and_admission_forgets():
  B, K = 2, 2
  part = P.latest_features(decay=0.5, horizon=4.0)
  state = part.init(B, K)
  feats = jnp.asarray([[2.0, 4.0], [0.0, 0.0]])
  state = part.update(state, _outcome(B, K, features=feats, drafted=jnp.ones((B, K), bool)))
  np.testing.assert_allclose(state.mean, [1.0, 2.0])
  np.testing.assert_allclose(part.read(state), feats)       # age 0: the features
  state = part.update(state, _outcome(B, K))                 # a step that drafted nothing
  state = part.update(state, _outcome(B, K))
  # Two steps old: mean + 0.5**2 (latest - mean).
  np.testing.assert_allclose(part.read(state)[0], [1.0 + 0.25 * 1.0, 2.0 + 0.25 * 2.0])
  policy = P.make_policy(K, drafter_kind="autoregressive", memory=part)
  full = policy.init(B)._replace(memory=state)
  fresh = policy.admit(full, jnp.asarray([True, False]))
  np.testing.assert_allclose(policy.parts[1].read(fresh.memory)[0], fresh.memory.mean)


def _lagged_fit(persistent: bool, steps: int = 400, B: int = 64, K: int = 2):
  """The lagged memory after `steps` steps of B requests whose drafts are accepted with
  probability sigmoid(feature) (each step's outcome follows that step's feature).
  `persistent`: a request's feature stays the same from step to step; else it is drawn
  afresh every step, so the last step's feature says nothing about the next one."""
  est = P.online_estimator(K, refit_interval=16)
  part = P.lagged_features(est, decay=1.0)
  update = jax.jit(part.update)
  state = part.init(B, K)
  rng = np.random.default_rng(0)
  fixed = rng.normal(0.0, 2.0, (B, 1))
  for _ in range(steps):
    f = fixed if persistent else rng.normal(0.0, 2.0, (B, 1))
    feats = np.repeat(f, K, axis=1).astype(np.float32)
    accepted = rng.random((B, K)) < 1.0 / (1.0 + np.exp(-feats))
    accepted[:, 1] &= accepted[:, 0]
    labeled = np.ones((B, K), bool)
    labeled[:, 1] = accepted[:, 0]
    state = update(state, P.StepOutcome(
        features=jnp.asarray(feats), drafted=jnp.ones((B, K), bool),
        accepted=jnp.asarray(accepted), labeled=jnp.asarray(labeled),
        step_ms=jnp.float32(1.0), explore_ms=jnp.float32(0.0)))
  return part, state


def test_the_lagged_memory_learns_what_the_last_step_says_about_the_next():
  # Persistent requests: the last feature is the next step's, so the lagged slope is the
  # drafts' own (1 in logit units; the features are the true logits). Features drawn
  # afresh each step: the last one says nothing, the slope falls to ~0 and every request
  # is predicted its position's acceptance (the negative control of the first case).
  part, state = _lagged_fit(persistent=True)
  assert 0.8 < float(state.lag.slope) < 1.25
  high, low = jnp.full((1, 2), 2.0), jnp.full((1, 2), -2.0)
  probs = lambda x: part.predict(state._replace(latest=jnp.broadcast_to(x, state.latest.shape),
                                                known=jnp.ones_like(state.known)))[0, 0]
  assert float(probs(high)) > 0.8 and float(probs(low)) < 0.2
  part, state = _lagged_fit(persistent=False)
  assert abs(float(state.lag.slope)) < 0.1
  assert abs(float(probs(high)) - float(probs(low))) < 0.1
  assert abs(float(probs(high)) - 0.5) < 0.1


def test_the_plans_estimator_reads_features_centred_on_each_depths_mean():
  # A request the plan knows nothing of reads the depth's mean, and is predicted the
  # intercept's acceptance whatever the slope: the slope moves only what a request's own
  # features say beyond the mean. Features sit far from 0 (mean -3, as a sampled
  # drafter's log-odds do), where an uncentred slope would move every prediction: the
  # negative control computes that one with the same coefficients.
  K, B = 3, 2
  est = P.online_estimator(K)
  part = P.lagged_features(est)
  state = part.init(B, K)._replace(mean=jnp.full((K,), -3.0),
                                   latest=jnp.asarray([[-2.0] * K, [-3.0] * K]),
                                   known=jnp.asarray([[True] * K, [False] * K]))
  intercepts = jnp.asarray([-0.5, 0.0, 0.5])
  predicted = {}
  for slope in (0.2, 0.9):
    lag = state.lag._replace(slope=jnp.float32(slope), intercepts=intercepts)
    predicted[slope] = np.asarray(part.predict(state._replace(lag=lag)))
    uncentred = np.asarray(est.predict(lag, part.read(state)))
    assert not np.allclose(uncentred[1], np.asarray(jax.nn.sigmoid(intercepts)), atol=0.05)
  for slope, probs in predicted.items():
    np.testing.assert_allclose(probs[1], jax.nn.sigmoid(intercepts), rtol=1e-6)
    assert np.all(probs[0] > probs[1])  # its own feature, 1 above the mean, says more
  assert np.all(predicted[0.9][0] > predicted[0.2][0])


def test_replicas_learning_with_an_axis_name_agree_on_both_estimators():
  # Two data-parallel replicas (vmapped over a named axis) see different steps; learning
  # with `axis_name` sums the round statistics of the drafts' estimator and of the plan's
  # lagged one, so after a refit both replicas hold the same coefficients of each.
  # Negative control: without the axis name they differ.
  K, B = 2, 4
  policy = P.make_policy(K, drafter_kind="autoregressive",
                         estimator_config=P.EstimatorConfig(refit_interval=1))
  rng = np.random.default_rng(1)
  feats = jnp.asarray(rng.normal(0.0, 2.0, (2, B, K)), jnp.float32)
  accepted = jnp.asarray(rng.random((2, B, K)) < 0.5)
  state = jax.tree.map(lambda x: jnp.stack([x, x]), policy.init(B))
  state = state._replace(memory=state.memory._replace(
      latest=feats[::-1], known=jnp.ones((2, B, K), bool)))
  ones = jnp.ones((2, B, K), bool)
  def learn(axis_name):
    def one(s, f, a, d):
      return policy.learn(s, P.StepOutcome(features=f, drafted=d, accepted=a, labeled=d,
                                           step_ms=jnp.float32(1.0),
                                           explore_ms=jnp.float32(0.0)), axis_name=axis_name)
    return jax.vmap(one, axis_name="data")(state, feats, accepted, ones)
  for name, agree in (("data", True), (None, False)):
    out = learn(name)
    for coefs in (out.estimator, out.memory.lag):
      same = np.allclose(coefs.slope[0], coefs.slope[1]) and np.allclose(
          coefs.intercepts[0], coefs.intercepts[1])
      assert same == agree, (name, coefs.slope, coefs.intercepts)


def test_exploration_spends_at_most_its_share_where_nothing_pays():
  B, K, share = 4, 4, 0.02
  cost = _cost(B, K, pass_ms=0.5)
  # Acceptance probabilities read as given (all 0 in memory): drafting never pays.
  policy = P.make_policy(K, drafter_kind="autoregressive",
                         estimator=P.identity_estimator(K), explorer=P.explore_credit(share),
                         memory=P.latest_features())
  state = policy.init(B)
  plan_fn, learn_fn = jax.jit(policy.plan), jax.jit(policy.learn)
  active = jnp.ones((B,), bool)
  total = spent = 0.0
  explored_slots = []
  for _ in range(1200):
    plan = plan_fn(state, active, cost)
    drafted = jnp.arange(K)[None, :] < plan.depth[:, None]
    rows = jnp.sum(drafted, axis=0, dtype=jnp.int32)
    step_ms = float(cost.draft(rows) + cost.verify(B + jnp.sum(plan.num)))
    total += step_ms
    spent += float(plan.explore_ms)
    if bool(jnp.any(plan.explore)):
      explored_slots.append(int(jnp.argmax(plan.explore)))
      assert int(plan.num[explored_slots[-1]]) == K  # the explorer drafts all K
    state = learn_fn(state, _outcome(B, K, drafted=drafted, step_ms=step_ms,
                                     explore_ms=float(plan.explore_ms)))
  explore_cost = float(policy._explore_ms(active, cost))
  assert len(explored_slots) >= 3
  assert spent <= share * total + explore_cost
  assert spent >= share * total - 2 * explore_cost       # and it does explore
  assert explored_slots[:4] == [0, 1, 2, 3]              # round robin
  # The ablation composition never explores.
  silent = P.make_policy(K, drafter_kind="autoregressive", estimator=P.identity_estimator(K),
                         explorer=P.no_exploration(), memory=P.latest_features())
  s = silent.init(B)
  for _ in range(50):
    plan = silent.plan(s, active, cost)
    assert not bool(jnp.any(plan.explore))
    s = silent.learn(s, _outcome(B, K, step_ms=1.0))


def test_plan_reads_only_the_state():
  # Rule 2: what drafts and how deep is a function of earlier steps (the state) alone:
  # two states equal but for a field no plan reads give the same plan, and the plan of
  # a parallel drafter drafts rows to one block depth.
  B, K = 4, 3
  cost = _cost(B, K, pass_ms=0.05, parallel=True)
  policy = P.make_policy(K, drafter_kind="parallel")
  state = policy.init(B)
  feats = jnp.asarray([[5.0, 5.0, 5.0], [-5.0] * 3, [5.0, 2.0, -3.0], [0.0] * 3])
  state = policy.learn(state, _outcome(B, K, features=feats, drafted=jnp.ones((B, K), bool)))
  plan = jax.jit(policy.plan)(state, jnp.ones((B,), bool), cost)
  depth = np.asarray(plan.depth)
  assert len(set(depth[depth > 0])) == 1
  assert bool(plan.draft[0]) and not bool(plan.draft[1])


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="drafter_kind"):
    P.make_policy(4, drafter_kind="tree")
  with pytest.raises(ValueError, match="share"):
    P.explore_credit(1.5)
  with pytest.raises(ValueError, match="num_positions"):
    P.make_policy(0, drafter_kind="parallel")


def _engine_cost(k, B, *, pass_ms, first_per_token=0.0, verify_fixed=1.0, per_token=0.1):
  """The tables of an engine of cap k: an autoregressive drafter whose first pass reads
  the k + 1 pending tokens of every drafting row (`first_per_token` ms each)."""
  depth = np.zeros((B + 1, k), np.float32)
  rows = np.arange(1, B + 1)
  depth[1:, :] = pass_ms
  depth[1:, 0] += first_per_token * (k + 1) * rows
  verify = verify_fixed + per_token * np.maximum(np.arange(B * (k + 1) + 1) - 1, 0)
  return P.StepCost(jnp.asarray(depth), jnp.asarray(verify, jnp.float32))


def test_depth_cap_docstring_example_and_its_rates():
  costs = [_engine_cost(k, 1, pass_ms=0.2) for k in (1, 2, 3)]
  got = P.depth_cap([[0.9, 0.5, 0.1]], costs, num_slots=1)
  assert got.cap == 2
  # Cap 3's best choice drafts 2 of its 3 positions: its rate is cap 2's, and the tie goes
  # to the smaller cap.
  np.testing.assert_allclose(got.rates, [1.9 / 1.3, 2.4 / 1.6, 2.4 / 1.6], rtol=1e-6)


def test_depth_cap_is_the_best_choice_of_each_cap_by_enumeration():
  """B = 1: a cap's rate is the best over every number n <= k of positions drafted and
  verified of (1 + S_1 + ... + S_n) / (drafting n + verifying n + 1), by brute force."""
  rng = np.random.default_rng(0)
  for _ in range(20):
    S = np.cumprod(rng.uniform(0.3, 0.95, size=(1, 6)), axis=1)
    pass_ms, first = rng.uniform(0.02, 0.3), rng.uniform(0.0, 0.05)
    costs = [_engine_cost(k, 1, pass_ms=pass_ms, first_per_token=first) for k in range(1, 7)]
    brute = []
    for k in range(1, 7):
      depth, verify = np.asarray(costs[k - 1].draft_depth_ms), np.asarray(costs[k - 1].verify_ms)
      brute.append(max((1 + S[0, :n].sum()) / (depth[1, :n].sum() + verify[n + 1])
                       for n in range(k + 1)))
    got = P.depth_cap(S, costs, num_slots=1)
    np.testing.assert_allclose(got.rates, brute, rtol=1e-5)
    assert brute[got.cap - 1] == max(brute)
  # Negative control: where every draft is rejected the cap is the smallest; where every
  # draft is accepted and drafting is nearly free, the deepest.
  costs = [_engine_cost(k, 8, pass_ms=0.001) for k in range(1, 7)]
  assert P.depth_cap(np.zeros((4, 6)), costs, num_slots=8).cap == 1
  assert P.depth_cap(np.ones((4, 6)), costs, num_slots=8).cap == 6


@pytest.mark.parametrize("shared_passes", [False, True])
def test_depth_cap_prices_each_cap_by_the_plans_choice_on_a_batch(shared_passes):
  """B = 4 copies of one curve: every batch is those four requests, so cap k's rate is
  `choose` on them with depths <= k under cap k's tables; a parallel drafter's block
  (`shared_passes`) prices every drafting row to the deepest depth."""
  S = np.asarray([[0.9, 0.7, 0.4, 0.2]])
  costs = [_engine_cost(k, 4, pass_ms=0.1, first_per_token=0.02, per_token=0.05)
           for k in range(1, 5)]
  got = P.depth_cap(S, costs, num_slots=4, shared_passes=shared_passes)
  want = []
  for k in range(1, 5):
    c = P.choose(jnp.asarray(np.repeat(S[:, :k], 4, axis=0), jnp.float32),
               eligible=jnp.ones((4, k), bool), forced=jnp.zeros((4, k), bool),
               active=jnp.ones((4,), bool), cost=costs[k - 1], shared_passes=shared_passes)
    want.append(float(c.expected) / float(c.cost_ms))
  np.testing.assert_allclose(got.rates, want, rtol=1e-5)
  assert got.cap == int(np.argmax(want)) + 1


def test_depth_cap_weighs_requests_by_the_steps_they_hold():
  """Two requests of L tokens, B = 1, one accepting every draft and one none: at cap k the
  accepting one emits k + 1 tokens a step and holds the slot L / (k + 1) steps, the other
  drafts nothing (the plan's choice) and holds it L steps, so a step is the accepting
  one's with probability 1 / (k + 2): rate 2 (k + 1) / (c_k + k + 1), c_k its step's ms.
  Weighing the two alike would give (k + 2) / (c_k + 1)."""
  costs = [_engine_cost(k, 1, pass_ms=0.05, per_token=0.1) for k in range(1, 5)]
  c = np.asarray([1.0 + 0.15 * k for k in range(1, 5)])
  k = np.arange(1, 5)
  held, alike = 2 * (k + 1) / (c + k + 1), (k + 2) / (c + 1)
  S = np.asarray([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
  got = P.depth_cap(S, costs, num_slots=1)
  # The batches are stratified draws (128 here): a share is met to 1 / 128.
  np.testing.assert_allclose(got.rates, held, rtol=0.02)
  assert not np.allclose(got.rates, alike, rtol=0.05)
  # The same two requests of 10 tokens sampled as they run, each sample weighted by the
  # tokens emitted since the request's previous one (the accepting one twice, 5 + 5;
  # the rejecting one ten times, 1 each): the same rates.
  runs = np.concatenate([np.repeat(S[:1], 2, axis=0), np.repeat(S[1:], 10, axis=0)])
  w = [5, 5] + [1] * 10
  np.testing.assert_allclose(P.depth_cap(runs, costs, num_slots=1, weights=w).rates,
                             held, rtol=0.02)
  for bad in ([1] * 11, [-1] + [1] * 11, [0] * 12):
    with pytest.raises(ValueError, match="weights"):
      P.depth_cap(runs, costs, num_slots=1, weights=bad)


def test_depth_cap_refuses_bad_input():
  costs = [_engine_cost(k, 2, pass_ms=0.1) for k in (1, 2)]
  with pytest.raises(ValueError, match="survival"):
    P.depth_cap(np.zeros((0, 2)), costs, num_slots=2)
  with pytest.raises(ValueError, match="costs"):
    P.depth_cap(np.ones((3, 2)), costs[:1], num_slots=2)
  with pytest.raises(ValueError, match="num_slots"):
    P.depth_cap(np.ones((3, 2)), costs, num_slots=0)
