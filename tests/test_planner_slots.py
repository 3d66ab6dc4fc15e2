"""The per-slot skip-drafting gate of `av_jax.planner` (docs/algorithm.md section 8).

Which slots draft (`draft_slots`) is a function of the planner state and the active set
only; the per-slot pay rule matches a hand (NumPy) computation; re-checks back off,
cap and reset; the round-robin re-check groups cover every active slot; the gated step
runs jitted and not, without retracing; `keep_drafting` on a gathered subset of rows
equals the full batch restricted to them; the scalar `drafting` of older callers still
works.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import av_jax

B, K = 8, 4


def _planner(**kw):
  settings = dict(policy="current", explore_every=4, skip_unprofitable_drafts=True,
                  recheck_every=4)
  settings.update(kw)
  return av_jax.make_planner(**settings)


def _step_cost(B=B, K=K, draft=(0.05, 0.01)):
  """Step-shaped verification (1.0 up to B tokens, 1.3 up to 3B, 2.0 beyond), affine
  drafting."""
  tokens = np.arange(B * (K + 1) + 1)
  verify = np.where(tokens <= B, 1.0, np.where(tokens <= 3 * B, 1.3, 2.0))
  return av_jax.make_cost_model(draft[0] + draft[1] * np.arange(B + 1), verify)


def _flat_cost(B=B, K=K):
  """Verification free beyond the first token: every position is verified."""
  return av_jax.make_cost_model(0.05 + 0.01 * np.arange(B + 1), np.ones(B * (K + 1) + 1))


def _dear_cost(B=B, K=K):
  return av_jax.make_cost_model(np.full(B + 1, 100.0), 1.0 + 0.1 * np.arange(B * (K + 1) + 1))


def _free_cost(B=B, K=K):
  return av_jax.make_cost_model(np.full(B + 1, 1e-3), 1.0 + 1e-3 * np.arange(B * (K + 1) + 1))


def _half_probs(good=0.9, bad=0.05):
  return jnp.asarray(np.where(np.arange(B)[:, None] < B // 2, good, bad) * np.ones((B, K)),
                     jnp.float32)


def _reference_pays(probs, cost, active, drafting):
  """The pay rule in NumPy float64: the optimal plan over drafting slots, then
  g_b verify_cost(R) > C_b - verify_cost(R) per slot, C_b the cost of the step in which
  all R active slots draft and verify like b (docs/algorithm.md section 8.1)."""
  probs, active, drafting = map(np.asarray, (probs, active, drafting))
  draft_ms, verify_ms = (np.asarray(t, np.float64) for t in (cost.draft_ms, cost.verify_ms))
  surv = np.cumprod(probs.astype(np.float64), axis=1)
  D = active & drafting
  R, d = int(active.sum()), int(D.sum())
  entries = sorted(((-surv[b, i], i, b) for b in range(B) for i in range(K) if D[b]))
  best, best_n = -np.inf, 0
  for n in range(len(entries) + 1):
    gain = R + sum(-e[0] for e in entries[:n])
    value = gain / (draft_ms[d] + verify_ms[R + n])
    if value > best + 1e-12:
      best, best_n = value, n
  mask = np.zeros((B, K), bool)
  for _, i, b in entries[:best_n]:
    mask[b, i] = True
  g = np.where(mask, surv, 0.0).sum(axis=1)
  # The counterfactual step: all R active slots draft and verify like b.
  n_b = mask.sum(axis=1)
  C = draft_ms[R] + verify_ms[np.minimum(R + R * n_b, len(verify_ms) - 1)]
  return D & (g * verify_ms[R] > C - verify_ms[R]), mask


# ----------------------------------------------------------------------------------------
# The pay rule.


@pytest.mark.parametrize("cost_fn", [_step_cost, _flat_cost])
def test_pay_rule_matches_hand_computation(cost_fn):
  """Half the slots accept ~0.9 of their drafts, half ~0.05: the 0.9 slots pay, the 0.05
  slots do not, with step-shaped costs (where the plan leaves the 0.05 slots out) and
  with flat verification (where they are verified and still do not pay)."""
  planner, cost = _planner(), cost_fn()
  state = planner.init(B)._replace(step=jnp.int32(1))  # not an exploration step
  probs, active = _half_probs(), jnp.ones((B,), bool)
  drafting = planner.draft_slots(state, active)
  np.testing.assert_array_equal(drafting, np.ones(B, bool))  # all paid initially
  plan, new = planner.plan(state, probs, cost, active=active, drafting=drafting)
  want, mask = _reference_pays(probs, cost, active, drafting)
  np.testing.assert_array_equal(plan.mask, mask)
  np.testing.assert_array_equal(new.slot_pays, want)
  np.testing.assert_array_equal(new.slot_pays, np.arange(B) < B // 2)
  assert bool(new.drafting_pays)
  # The next step drafts only the slots that paid.
  np.testing.assert_array_equal(planner.draft_slots(new, active), np.arange(B) < B // 2)
  if cost_fn is _flat_cost:  # the 0.05 slots were verified, yet did not pay
    assert plan.mask[B - 1].all()


def test_pay_rule_of_a_subset_and_unjudged_slots_keep_their_verdict():
  """Only the slots that drafted are judged (against draft_cost(d)); the others keep
  their verdict; the budget ranks only drafted slots' positions."""
  planner, cost = _planner(), _flat_cost()
  rng = np.random.default_rng(3)
  probs = jnp.asarray(rng.uniform(0.0, 1.0, (B, K)), jnp.float32)
  active = jnp.asarray(rng.random(B) < 0.8)
  drafting = jnp.asarray([True, False] * (B // 2))
  previous = jnp.asarray(rng.random(B) < 0.5)
  state = planner.init(B)._replace(step=jnp.int32(1), slot_pays=previous)
  plan, new = planner.plan(state, probs, cost, active=active, drafting=drafting)
  want, mask = _reference_pays(probs, cost, active, drafting)
  judged = np.asarray(active & drafting)
  np.testing.assert_array_equal(new.slot_pays, np.where(judged, want, previous))
  np.testing.assert_array_equal(plan.mask, mask)
  assert not np.asarray(plan.mask)[~judged].any()
  np.testing.assert_array_equal(plan.drafting, active & drafting)


def test_slots_that_did_not_draft_still_count_in_the_target_pass():
  """As the engine calls it (`sound` False for a slot that did not draft), the plan and
  the pay rule count every active slot's own token: R is the active count, not the
  drafting count. With one of eight slots drafting and a verify bucket that ends at B
  tokens, verifying its drafts would push the pass into the next bucket; the old count
  (R = d = 1, room for 7 drafts in the first bucket) verified 7 and judged the slot
  paying (the negative control below recomputes that answer and checks it differs)."""
  planner = _planner()
  tokens = np.arange(B * (K + 1) + 1)
  cost = av_jax.make_cost_model(np.full(B + 1, 0.05),
                                np.where(tokens <= B, 1.0, 2.5))
  probs = jnp.full((B, K), 0.97, jnp.float32)
  active = jnp.ones((B,), bool)
  drafting = jnp.arange(B) == 3
  state = planner.init(B)._replace(step=jnp.int32(1))
  plan, new = planner.plan(state, probs, cost, active=active, drafting=drafting,
                           sound=drafting)
  want, mask = _reference_pays(probs, cost, active, drafting)
  np.testing.assert_array_equal(plan.mask, mask)
  np.testing.assert_array_equal(new.slot_pays, np.where(drafting, want, True))
  assert not np.asarray(plan.mask).any() and not bool(new.slot_pays[3])
  # Negative control: counting only the drafting slot (the bug) verifies its drafts.
  wrong, wrong_mask = _reference_pays(probs, cost, drafting, drafting)
  assert wrong_mask[3].sum() == K and wrong[3]
  # Rows that drafted and are sound plan as without `sound`.
  plan2, new2 = planner.plan(state, probs, cost, active=active, drafting=drafting)
  np.testing.assert_array_equal(plan2.mask, plan.mask)
  np.testing.assert_array_equal(new2.pay_margin, new.pay_margin)


def test_a_lone_rechecked_slot_is_judged_as_if_every_slot_drafted_like_it():
  """A weight-bound drafter (one pass costs the same for 1 row as for 8) and nearly free
  verification: drafting pays when the whole batch drafts, but a lone re-checked slot
  would carry the whole pass on the step that ran. The counterfactual rule judges it as
  if all R active slots drafted like it, so it stays open and, since alone it does not
  pay as a group, the other active slots try drafting at the next step (the group
  check); the step-as-it-ran rule, the negative control, keeps it closed."""
  planner = _planner()
  cost = av_jax.make_cost_model(np.full(B + 1, 0.5), 1.0 + 0.002 * np.arange(B * (K + 1) + 1))
  probs = jnp.full((B, K), 0.9, jnp.float32)
  active = jnp.ones((B,), bool)
  lone = jnp.arange(B) == 2
  state = planner.init(B)._replace(step=jnp.int32(1), slot_pays=jnp.zeros((B,), bool),
                                   pay_margin=jnp.zeros((B,), jnp.float32))
  plan, new = planner.plan(state, probs, cost, active=active, drafting=lone, sound=lone)
  assert int(plan.mask[2].sum()) == K and int(plan.mask.sum()) == K
  want = _margins(probs, cost, active, lone)
  np.testing.assert_allclose(float(new.pay_margin[2]), want[2], rtol=1e-5)
  assert bool(new.slot_pays[2]) and want[2] > 0
  # The others grow the group to the smallest size that would pay (here one slot more,
  # the first joinable in slot order), not to the whole batch.
  G = _grown_size(probs, cost, active, lone, B - 1)
  assert G == 2
  joined = np.asarray(new.slot_pays) & ~np.asarray(lone)
  np.testing.assert_array_equal(np.flatnonzero(joined), [0])
  assert np.isposinf(np.asarray(new.pay_margin)[joined]).all()
  # Negative control: the step that ran (draft_cost(1) + verify_cost(R + K)) charged to
  # the one slot does not pay.
  g = float(np.cumprod(np.full(K, 0.9)).sum())
  ran = B * (float(cost.draft_cost(1)) + float(cost.verify_cost(B + K)) - float(cost.verify_cost(B)))
  assert g * 1 * float(cost.verify_cost(B)) / ran - 1.0 < 0
  # With every slot drafting alike, the counterfactual is the step that ran: the
  # per-slot verdicts equal the batch rule's.
  _, everyone = planner.plan(planner.init(B)._replace(step=jnp.int32(1)), probs, cost,
                             active=active, drafting=active)
  _, batch = planner.plan(planner.init()._replace(step=jnp.int32(1)), probs, cost,
                          active=active, drafting=True)
  assert np.asarray(everyone.slot_pays).all() == bool(batch.slot_pays[0]) == True


@pytest.mark.parametrize("pays", [True, False])
def test_slots_waiting_since_admission_reopen_when_a_slot_pays(pays):
  """Slots gated off at admission on the batch's view (margin `WAITING`) follow it when
  some slot's drafts are found to pay: they draft at the next step (margin +inf, judged
  afresh then). A slot judged not paying on its own drafts (margin -0.5) stays closed;
  when the drafting slot does not pay, nothing reopens (the negative control)."""
  planner = _planner()
  cost = (av_jax.make_cost_model(np.full(B + 1, 0.05), 1.0 + 0.002 * np.arange(B * (K + 1) + 1))
          if pays else _dear_cost())
  probs = jnp.full((B, K), 0.9 if pays else 0.05, jnp.float32)
  active = jnp.ones((B,), bool)
  lone = jnp.arange(B) == 0
  margin = jnp.full((B,), av_jax.planner.WAITING, jnp.float32).at[0].set(jnp.inf).at[1].set(-0.5)
  state = planner.init(B)._replace(step=jnp.int32(1), slot_pays=lone, pay_margin=margin)
  _, new = planner.plan(state, probs, cost, active=active, drafting=lone, sound=lone)
  assert bool(new.slot_pays[0]) == pays and not bool(new.slot_pays[1])
  waiting = np.arange(B) >= 2
  np.testing.assert_array_equal(np.asarray(new.slot_pays)[waiting], pays)
  np.testing.assert_array_equal(np.isinf(np.asarray(new.pay_margin)[waiting]), pays)
  np.testing.assert_array_equal(
      np.asarray(planner.draft_slots(new._replace(step=jnp.int32(2)), active)),
      np.where(waiting | lone, pays, False))


def _heavy_pass_cost(B=B, K=K):
  """A drafter pass that costs about the same for 1 row as for 8 and twice a target step
  (weight-bound and dear), verification linear in tokens."""
  return av_jax.make_cost_model(2.0 + 0.01 * np.arange(B + 1),
                                1.0 + 0.01 * np.arange(B * (K + 1) + 1))


def test_a_paying_group_that_does_not_pay_together_closes():
  """Two slots with good drafts beside six with bad ones, a dear weight-bound drafter
  pass: judged as if every slot drafted like them the good slots pay (the negative
  control: the per-slot rule alone keeps them open), but the two alone do not earn the
  pass they share. Drafting alone, they stay open and the other slots (waiting since
  admission: no evidence of their own) try drafting at the next step; with every active
  slot drafting and the group still not paying, all close. Other slots judged not
  paying on their own drafts (margin < 0) do not join: the pair closes at once, and the
  failed group is not a find (the re-check interval doubles)."""
  planner, cost = _planner(), _heavy_pass_cost()
  probs = _half_probs(0.9, 0.05)
  probs = jnp.where(jnp.arange(B)[:, None] < 2, probs, 0.05)  # slots 0, 1 good
  active = jnp.ones((B,), bool)
  good = np.arange(B) < 2
  m = _margins(probs, cost, active, np.ones(B, bool))
  assert (m[good] > 0).all() and (m[~good] < 0).all()  # the per-slot rule: good ones pay
  pair = jnp.asarray(good)
  judged = planner.init(B)._replace(
      step=jnp.int32(4), next_recheck=jnp.int32(4), recheck_interval=jnp.int32(4),
      slot_pays=pair, pay_margin=jnp.where(pair, jnp.inf, -0.5).astype(jnp.float32))
  _, closed = planner.plan(judged, probs, cost, active=active, drafting=pair)
  np.testing.assert_array_equal(np.asarray(closed.slot_pays), False)
  assert int(closed.recheck_interval) == 8 and int(closed.next_recheck) == 12
  state = judged._replace(
      step=jnp.int32(1),
      pay_margin=jnp.where(pair, jnp.inf, av_jax.planner.WAITING).astype(jnp.float32))
  _, state = planner.plan(state, probs, cost, active=active, drafting=pair)
  G = _grown_size(probs, cost, active, pair, B - 2)
  assert G is not None and 2 < G < B
  grown = np.arange(B) < G
  np.testing.assert_array_equal(np.asarray(state.slot_pays), grown)  # expansion
  np.testing.assert_array_equal(np.isposinf(np.asarray(state.pay_margin)), grown & ~good)
  state = state._replace(step=jnp.int32(2))
  drafting = planner.draft_slots(state, active)
  np.testing.assert_array_equal(np.asarray(drafting), grown)
  # The joined slots' drafts are bad; the pair with the B - G slots still waiting cannot
  # make a group that pays (G - 2 slots like it were needed): all close.
  assert _grown_size(probs, cost, active, pair, B - G) is None
  _, state = planner.plan(state, probs, cost, active=active, drafting=drafting)
  np.testing.assert_array_equal(np.asarray(state.slot_pays), False)
  assert not bool(state.drafting_pays)
  # A cheap pass: the same two slots pay together and stay open, the rest close.
  _, cheap = planner.plan(planner.init(B)._replace(step=jnp.int32(1)), probs, _step_cost(),
                          active=active, drafting=active)
  np.testing.assert_array_equal(np.asarray(cheap.slot_pays), good)


def test_a_lagged_budget_does_not_close_the_slots_it_starves():
  """Under the lagged policy the step verifies what the previous step's budget allows.
  A budget from a step on which one slot drafted (here 1 position) leaves most of a
  batch that drafts together with nothing verified; the gate judges every slot on the
  best plan for this step's own drafts, so slots with good drafts stay open. Negative
  control: judged on the lagged plan's positions, the starved slots read as not paying
  (margin -1)."""
  planner = _planner(policy="lagged")
  cost, probs, active = _flat_cost(), jnp.full((B, K), 0.9, jnp.float32), jnp.ones((B,), bool)
  state = planner.init(B)._replace(step=jnp.int32(1), budget=jnp.int32(1))
  plan, new = planner.plan(state, probs, cost, active=active, drafting=active)
  assert int(plan.mask.sum()) == 1  # the lagged budget ran (one slot verified one draft)
  assert np.asarray(new.slot_pays).all()
  np.testing.assert_allclose(np.asarray(new.pay_margin), _margins(probs, cost, active, active),
                             rtol=1e-5)
  lagged = np.asarray(plan.mask)
  starved = ~lagged.any(axis=1)
  assert starved.sum() == B - 1
  surv = np.cumprod(np.full(K, 0.9))
  g = np.where(lagged, surv[None], 0.0).sum(axis=1)
  assert (g[starved] == 0).all()  # on the lagged plan: margin -1, the slot would close


def test_batch_state_is_the_batch_rule():
  """A `[1]` state (init() without num_slots) judges the batch as one slot: the rule
  `(R + sum g) / C > R / verify_cost(R)` of the batch gate."""
  planner = _planner()
  for cost, probs, want in ((_step_cost(), _half_probs(), True),
                            (_dear_cost(), _half_probs(), False)):
    state = planner.init()._replace(step=jnp.int32(1))
    assert state.slot_pays.shape == (1,)
    plan, new = planner.plan(state, probs, cost, drafting=planner.should_draft(state))
    assert new.slot_pays.shape == (1,)
    R = B
    gain = R + float(jnp.sum(jnp.where(plan.mask, av_jax.survival(probs), 0.0)))
    n = int(plan.mask.sum())
    batch = gain / (float(cost.draft_cost(R)) + float(cost.verify_cost(R + n))) > (
        R / float(cost.verify_cost(R)))
    assert bool(new.slot_pays[0]) == batch == want


def _margins(probs, cost, active, drafting, share=1.0):
  """The relative pay margin m_b = g_b verify_cost(R) / (C_b - verify_cost(R)) - 1 in
  NumPy, C_b (every active slot drafting and verifying like b) charging `share` of the
  drafting cost's passes and all of its fixed part (`draft_fixed_ms`); NaN for slots
  not judged."""
  probs, active, drafting = map(np.asarray, (probs, active, drafting))
  _, mask = _reference_pays(probs, cost, active, drafting)
  draft_ms, verify_ms = (np.asarray(t, np.float64) for t in (cost.draft_ms, cost.verify_ms))
  surv = np.cumprod(probs.astype(np.float64), axis=1)
  D = active & drafting
  R = int(active.sum())
  g = np.where(mask, surv, 0.0).sum(axis=1)
  n_b = mask.sum(axis=1)
  fixed = (0.0 if cost.draft_fixed_ms is None
           else min(float(cost.draft_fixed_ms[R]), draft_ms[R]))
  extra = (fixed + share * (draft_ms[R] - fixed)
           + verify_ms[np.minimum(R + R * n_b, len(verify_ms) - 1)] - verify_ms[R])
  m = np.clip(g * verify_ms[R] / extra - 1.0, -1.0, 4.0)
  return np.where(D, m, np.nan)


def _grown_size(probs, cost, active, P, joinable):
  """The smallest group G > |P| that pays if every joining slot drafts like P's average
  slot, in NumPy (None: no G up to |P| + joinable pays): (R + G g) verify_cost(R) >
  R (draft_cost(G) + verify_cost(R + round(G n))), g and n P's mean gain (from the
  clipped margins, as the planner reads it back) and verified positions."""
  probs, active, P = map(np.asarray, (probs, active, P))
  draft_ms, verify_ms = (np.asarray(t, np.float64) for t in (cost.draft_ms, cost.verify_ms))
  _, mask = _reference_pays(probs, cost, active, P)
  R, base = int(active.sum()), verify_ms[int(active.sum())]
  n_b = mask.sum(axis=1)
  m = _margins(probs, cost, active, P)
  spent = draft_ms[R] + verify_ms[np.minimum(R + R * n_b, len(verify_ms) - 1)] - base
  g = np.where(P, (m + 1.0) * spent / base, 0.0)
  size, per_g, per_n = int(P.sum()), g[P].mean(), n_b[P].mean()
  for G in range(size + 1, size + int(joinable) + 1):
    tokens = min(R + int(np.round(G * per_n)), len(verify_ms) - 1)
    if (R + G * per_g) * base > R * (draft_ms[G] + verify_ms[tokens]):
      return G
  return None


def test_one_bad_step_does_not_close_a_paying_slot_and_a_recheck_opens_on_fresh_evidence():
  """The verdict is the sign of a smoothed margin: a slot judged first takes the step's
  margin; while it drafts on its verdict the margin is (1 - a) old + a new, so one bad
  step after good ones leaves it open and a run of bad steps closes it; a closed slot
  re-checked takes the fresh margin alone. pay_smoothing = 1 is the single-step rule."""
  a = 0.3
  planner, cost = _planner(pay_smoothing=a), _step_cost()
  active = jnp.ones((B,), bool)
  good, bad = _half_probs(0.9, 0.9), _half_probs(0.02, 0.02)
  m_good = _margins(good, cost, active, np.ones(B, bool))
  m_bad = _margins(bad, cost, active, np.ones(B, bool))
  assert (m_good > 0).all() and (m_bad < 0).all()  # the instance separates them
  state = planner.init(B)._replace(step=jnp.int32(1))
  assert np.isposinf(np.asarray(state.pay_margin)).all()  # no evidence yet (never NaN)
  margins = []
  for t, probs in enumerate([good, good, bad, bad, bad]):
    state = state._replace(step=jnp.int32(4 * t + 1))  # never an exploration step
    drafting = planner.draft_slots(state, active)
    _, state = planner.plan(state, probs, cost, active=active, drafting=drafting)
    margins.append(np.asarray(state.pay_margin))
  want = m_good
  np.testing.assert_allclose(margins[0], want, rtol=1e-5)
  for t, m in enumerate([m_good, m_bad, m_bad, m_bad], start=1):
    if (want > 0).all():
      want = (1 - a) * want + a * m
    np.testing.assert_allclose(margins[t], want, rtol=1e-4, atol=1e-6)
  opened = [bool((mm > 0).all()) for mm in margins]
  closed = [bool((mm <= 0).all()) for mm in margins]
  assert opened[2], "one bad step after two good ones closed the gate"
  assert closed[-1], "three bad steps in a row left the gate open"
  np.testing.assert_array_equal(state.slot_pays, np.asarray(margins[-1]) > 0)
  # A re-check of the closed slots judges them on the fresh margin alone.
  recheck = state._replace(step=jnp.int32(0), next_recheck=jnp.int32(0),
                           recheck_count=jnp.int32(0))
  drafting = planner.draft_slots(recheck, active)
  assert np.asarray(drafting).any()
  _, after = planner.plan(recheck, good, cost, active=active, drafting=drafting)
  judged = np.asarray(drafting)
  np.testing.assert_allclose(np.asarray(after.pay_margin)[judged],
                             _margins(good, cost, active, judged)[judged], rtol=1e-5)
  assert np.asarray(after.slot_pays)[judged].all()
  # pay_smoothing = 1: the single-step rule, the last step alone decides.
  single = _planner(pay_smoothing=1.0)
  s1 = single.init(B)._replace(step=jnp.int32(1))
  for t, probs in enumerate([good, good, bad]):
    s1 = s1._replace(step=jnp.int32(4 * t + 1))
    _, s1 = single.plan(s1, probs, cost, active=active, drafting=single.draft_slots(s1, active))
  assert not np.asarray(s1.slot_pays).any()


def test_the_outcome_check_reopens_a_slot_whose_accepted_drafts_pay():
  """A slot judged closed on its predicted gain is judged again on its labels
  (`observe`): its accepted drafts among the positions verification labelled, against
  the extra cost of every active slot drafting and verifying that many (hand-computed).
  It reopens where that pays, with that margin; one accepted draft does not pay here, so
  it stays closed (negative control), and so do slots with no labelled position. What
  was pending is cleared; a batch verdict and an ungated planner are left alone."""
  planner, cost = _planner(outcome_check=True), _step_cost()
  active = jnp.ones((B,), bool)
  bad = jnp.full((B, K), 0.02, jnp.float32)
  state = planner.init(B)  # step 0: an exploration step, every slot drafting (untried)
  drafting = planner.draft_slots(state, active)
  assert np.asarray(drafting).all()
  plan, state = planner.plan(state, bad, cost, active=active, drafting=drafting)
  explored = np.asarray(plan.explored)
  assert explored.sum() == 1 and not np.asarray(state.slot_pays).any()
  e = int(np.argmax(explored))
  # Only the explored slot verified positions: it alone is pending, with all K.
  want_depth = np.where(explored, K, 0)
  np.testing.assert_array_equal(state.check_depth, want_depth)
  R = B
  extra = (float(cost.draft_share_cost(R, 1.0)) + float(cost.verify_cost(R + R * K))
           ) / float(cost.verify_cost(R)) - 1.0
  assert extra == pytest.approx(1.13, rel=1e-5)  # (0.13 + 2.0) / 1.0 - 1
  np.testing.assert_allclose(state.check_extra, np.where(explored, extra, 0.0), rtol=1e-5)
  closed_margin = np.asarray(state.pay_margin)

  def labels(accepted_prefix):
    accepted = np.zeros((B, K), bool)
    accepted[e, :accepted_prefix] = True
    labeled = np.zeros((B, K), bool)
    labeled[e, :min(accepted_prefix + 1, K)] = True
    return jnp.asarray(accepted), jnp.asarray(labeled)

  after = planner.observe(state, *labels(K))  # all K accepted: K / 1.13 - 1 > 0
  pays = np.zeros(B, bool)
  pays[e] = True
  np.testing.assert_array_equal(after.slot_pays, pays)
  assert bool(after.drafting_pays)
  m = np.asarray(after.pay_margin)
  assert m[e] == pytest.approx(K / extra - 1.0, rel=1e-5)
  np.testing.assert_array_equal(np.delete(m, e), np.delete(closed_margin, e))
  assert not np.asarray(after.check_depth).any() and not np.asarray(after.check_extra).any()
  assert np.asarray(planner.draft_slots(after, active))[e]
  # Negative control: one accepted draft (1 / 1.13 - 1 < 0) leaves it closed.
  kept = planner.observe(state, *labels(1))
  assert not np.asarray(kept.slot_pays).any()
  np.testing.assert_array_equal(kept.pay_margin, closed_margin)
  # Observed twice: nothing is pending the second time.
  again = planner.observe(kept, *labels(K))
  assert not np.asarray(again.slot_pays).any()
  # A batch verdict ([1]) has nothing per slot; an ungated planner's observe is identity.
  batch = planner.init()
  _, batch = planner.plan(batch, bad, cost, active=active, drafting=True)
  assert np.asarray(batch.check_depth).shape == (1,) and not np.asarray(batch.check_depth).any()
  chex.assert_trees_all_equal(planner.observe(batch, *labels(K)), planner.observe(
      batch, *labels(0)))
  for plain in (_planner(skip_unprofitable_drafts=False, outcome_check=True), _planner()):
    s = plain.init(B)
    assert plain.observe(s, *labels(K)) is s
  # Off (the default): nothing is pending after the same plan.
  _, off = _planner().plan(_planner().init(B), bad, cost, active=active, drafting=drafting)
  assert not np.asarray(off.check_depth).any()
  # Jitted, the same answer.
  jitted = jax.jit(planner.observe)(state, *labels(K))
  chex.assert_trees_all_close(jitted, after)


def test_a_stopped_drafting_loop_is_charged_the_passes_that_ran():
  """With `drafted` a prefix of depth j < K in every slot (a drafting stop), the step is
  charged j / K of the drafting cost: a verdict that flips between the full and the
  partial charge."""
  planner = _planner()
  cost = av_jax.make_cost_model(np.full(B + 1, 2.0), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))
  active = jnp.ones((B,), bool)
  probs = jnp.full((B, K), 0.7, jnp.float32)
  drafted = jnp.asarray(np.arange(K)[None] < 1) & active[:, None]   # depth 1 of K = 4
  state = planner.init(B)._replace(step=jnp.int32(1))
  _, full = planner.plan(state, probs, cost, active=active, drafting=active)
  _, part = planner.plan(state, probs, cost, active=active, drafting=active, drafted=drafted)
  # Reference margins: the partial step verifies at most depth 1 of every slot.
  masked = jnp.where(drafted, probs, 0.0)
  want_part = _margins(masked, cost, active, np.ones(B, bool), share=1 / K)
  np.testing.assert_allclose(np.asarray(part.pay_margin), want_part, rtol=1e-5)
  charged_all = _margins(masked, cost, active, np.ones(B, bool), share=1.0)
  assert (charged_all < 0).all() and (want_part > 0).all()  # the charge decides
  assert np.asarray(part.slot_pays).all()
  assert np.isfinite(np.asarray(full.pay_margin)).all()


def test_a_slot_drafted_past_the_cap_is_judged_at_the_cap():
  """A step that drafted all K (exploration, a re-check) under pass pricing is judged as
  the slot drafts while open: at the next step's depth cap, charged cap / K of the
  drafting cost, on its positions up to the cap. Negative control: without pass pricing
  (no cap) the same step is judged at depth K and closes."""
  cost = av_jax.make_cost_model(np.full(B + 1, 2.0), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))
  active = jnp.ones((B,), bool)
  probs = jnp.asarray(np.tile([0.9, 0.3, 0.3, 0.3], (B, 1)), jnp.float32)
  drafted = jnp.ones((B, K), bool)
  priced = _planner(draft_stop="survival")
  state = priced.init(B)._replace(step=jnp.int32(1))
  _, s = priced.plan(state, probs, cost, active=active, drafting=active, drafted=drafted)
  cap = int(s.depth_cap)
  assert 1 <= cap < K  # the deeper passes do not pay
  within = np.arange(K)[None] < cap
  want = _margins(np.where(within, probs, 0.0), cost, active, np.ones(B, bool),
                  share=cap / K)
  np.testing.assert_allclose(np.asarray(s.pay_margin), want, rtol=1e-5)
  assert (want > 0).all() and np.asarray(s.slot_pays).all()
  unpriced = _planner(draft_stop="survival", stop_price_passes=False)
  _, u = unpriced.plan(unpriced.init(B)._replace(step=jnp.int32(1)), probs, cost,
                       active=active, drafting=active, drafted=drafted)
  full = _margins(probs, cost, active, np.ones(B, bool), share=1.0)
  np.testing.assert_allclose(np.asarray(u.pay_margin), full, rtol=1e-5)
  assert (full < 0).all() and not np.asarray(u.slot_pays).any()


def test_the_drafters_fixed_part_is_charged_whatever_the_depth():
  """Pass pricing with a fixed part (`draft_fixed_ms`: the first pass over the pending
  block, the step's gather and scatter): a slot judged at the cap is charged the fixed
  part and cap / K of the rest (NumPy reference). The same drafts that pay when the
  passes are priced alike (the negative control, fixed part 0) do not pay once a
  depth-1 step costs what it does."""
  verify = 1.0 + 0.02 * np.arange(B * (K + 1) + 1)
  active, drafted = jnp.ones((B,), bool), jnp.ones((B, K), bool)
  probs = jnp.asarray(np.tile([0.9, 0.3, 0.3, 0.3], (B, 1)), jnp.float32)
  priced = _planner(draft_stop="survival")
  verdicts = {}
  for fixed in (0.0, 1.5):
    cost = av_jax.make_cost_model(np.full(B + 1, 2.0), verify,
                                  draft_fixed_ms=np.full(B + 1, fixed))
    state = priced.init(B)._replace(step=jnp.int32(1))
    _, s = priced.plan(state, probs, cost, active=active, drafting=active, drafted=drafted)
    cap = int(s.depth_cap)
    assert 1 <= cap < K  # the deeper passes do not pay
    want = _margins(np.where(np.arange(K)[None] < cap, probs, 0.0), cost, active,
                    np.ones(B, bool), share=cap / K)
    np.testing.assert_allclose(np.asarray(s.pay_margin), want, rtol=1e-5)
    verdicts[fixed] = np.asarray(s.slot_pays)
  assert verdicts[0.0].all() and not verdicts[1.5].any()


def test_pay_smoothing_is_checked():
  for bad in (0.0, 1.5, -0.1, True, "x"):
    with pytest.raises(ValueError, match="pay_smoothing"):
      _planner(pay_smoothing=bad)


# ----------------------------------------------------------------------------------------
# Exactness: drafting decisions read earlier steps only.


def test_draft_slots_do_not_depend_on_this_steps_probabilities():
  planner, cost = _planner(), _step_cost()
  state = planner.init(B)._replace(step=jnp.int32(8), slot_pays=jnp.arange(B) % 3 == 0)
  active = jnp.arange(B) != 5
  before = planner.draft_slots(state, active)
  rng = np.random.default_rng(0)
  for _ in range(3):
    probs = jnp.asarray(rng.uniform(0.0, 1.0, (B, K)), jnp.float32)
    plan, _ = planner.plan(state, probs, cost, active=active, drafting=before)
    np.testing.assert_array_equal(planner.draft_slots(state, active), before)
    np.testing.assert_array_equal(plan.drafting, before)
    # Slots that did not draft verify nothing, whatever their probabilities.
    assert not np.asarray(plan.mask)[~np.asarray(before)].any()


# ----------------------------------------------------------------------------------------
# Re-checks: back-off and round-robin groups.


def _run(planner, state, costs, probs, active):
  """Drives `draft_slots` + `plan`; returns the per-step drafting masks and states."""
  drafted, states = [], []
  for cost in costs:
    drafting = planner.draft_slots(state, active)
    _, state = planner.plan(state, probs, cost, active=active, drafting=drafting)
    drafted.append(np.asarray(drafting))
    states.append(state)
  return np.stack(drafted), states


def test_backoff_doubles_caps_and_resets():
  Bs = 4
  planner = _planner(explore_every=2, recheck_every=2, max_recheck_every=8)
  probs, active = jnp.full((Bs, K), 0.9), jnp.ones((Bs,), bool)
  costs = [_dear_cost(Bs)] * 16 + [_free_cost(Bs)] * 13
  drafted, states = _run(planner, planner.init(Bs), costs, probs, active)
  intervals = [int(s.recheck_interval) for s in states]
  # Step 0 drafts every slot (all paid initially) and none pays; re-checks at steps 2, 6
  # and 14 find nothing: the interval doubles 2 -> 4 -> 8 and stays at the cap.
  assert np.flatnonzero(drafted.any(axis=1)).tolist()[:4] == [0, 2, 6, 14]
  assert drafted[0].all() and not drafted[1].any()
  assert intervals[2] == 4 and intervals[6] == 8 and intervals[14] == 8
  # One slot per re-check (E = ceil(4 / 8) = 1), round-robin: slots 0, 1, 2.
  assert [int(np.flatnonzero(drafted[t])[0]) for t in (2, 6, 14)] == [0, 1, 2]
  # Drafting becomes free at step 16: the re-check at step 22 (slot 3) pays, the interval
  # resets, and that slot drafts on every later step while the others are re-checked
  # every recheck_every steps.
  assert int(states[21].recheck_interval) == 8 and int(states[22].recheck_interval) == 2
  assert drafted[22].tolist() == [False, False, False, True]
  assert drafted[23:, 3].all()
  assert drafted[24].tolist() == [True, False, False, True]
  assert drafted[26].tolist() == [True, True, False, True]
  assert drafted[28].all() and bool(states[-1].slot_pays.all())


def test_recheck_without_active_slots_does_not_count():
  planner = _planner(explore_every=2, recheck_every=2)
  state = planner.init(B)._replace(step=jnp.int32(4), next_recheck=jnp.int32(4),
                                   slot_pays=jnp.zeros((B,), bool))
  idle = jnp.zeros((B,), bool)
  _, new = planner.plan(state, _half_probs(), _dear_cost(), active=idle,
                        drafting=planner.draft_slots(state, idle))
  assert int(new.recheck_count) == 0 and int(new.next_recheck) == 4
  assert int(new.recheck_interval) == 2


@pytest.mark.parametrize("Bs,E,inactive", [(8, None, ()), (10, 3, ()), (10, 3, (1, 4, 5)),
                                          (7, 2, (6,)), (5, 8, ())])
def test_round_robin_rechecks_cover_every_active_slot(Bs, E, inactive):
  planner = _planner(recheck_slots=E)
  active = np.ones(Bs, bool)
  active[list(inactive)] = False
  R = int(active.sum())
  E = E or max(1, math.ceil(Bs / 8))
  covered = np.zeros(Bs, bool)
  closed = planner.init(Bs)._replace(slot_pays=jnp.zeros((Bs,), bool),
                                     next_recheck=jnp.int32(0))
  for count in range(math.ceil(R / E)):
    state = closed._replace(recheck_count=jnp.int32(count), step=jnp.int32(4 * count))
    group = np.asarray(planner.draft_slots(state, jnp.asarray(active)))
    assert group.sum() == min(E, R) and not group[~active].any()
    covered |= group
  np.testing.assert_array_equal(covered, active)
  # Not a re-check step (not an exploration step): closed slots do not draft.
  off = closed._replace(step=jnp.int32(1))
  assert not planner.draft_slots(off, jnp.asarray(active)).any()


def test_exploration_falls_on_a_drafting_slot():
  """Gated: the exploring slot is the first drafting slot at or after the round-robin
  slot, so a re-check explores one of the re-checked slots."""
  planner = _planner(explore_every=2, recheck_every=2, recheck_slots=2)
  state = planner.init(B)._replace(step=jnp.int32(2), next_recheck=jnp.int32(2),
                                   slot_pays=jnp.zeros((B,), bool),
                                   recheck_count=jnp.int32(2))
  active = jnp.ones((B,), bool)
  drafting = planner.draft_slots(state, active)
  assert np.flatnonzero(drafting).tolist() == [4, 5]
  plan, _ = planner.plan(state, jnp.full((B, K), 0.01), _dear_cost(), active=active,
                         drafting=drafting)
  assert np.flatnonzero(plan.explored).tolist() == [4]  # round-robin slot 1 -> next: 4
  assert int(plan.num_verified[4]) == K
  assert not np.asarray(plan.num_verified)[~np.asarray(drafting)].any()


# ----------------------------------------------------------------------------------------
# Jit, traces, gathered rows, old callers.


class GatedStepTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("current", "lagged")
  def test_gated_steps_jitted_and_not_agree(self, policy):
    planner = _planner(policy=policy, explore_every=2, recheck_every=2)

    def step(state, probs, cost, active):
      drafting = planner.draft_slots(state, active)
      plan, state = planner.plan(state, probs, cost, active=active, drafting=drafting)
      return plan, state

    run = self.variant(step)
    rng = np.random.default_rng(1)
    state = eager = planner.init(B)
    for t in range(6):
      probs = jnp.asarray(rng.uniform(0.0, 1.0, (B, K)), jnp.float32)
      active = jnp.asarray(rng.random(B) < 0.9)
      cost = _step_cost() if t % 2 else _dear_cost()
      plan, state = run(state, probs, cost, active)
      eager_plan, eager = step(eager, probs, cost, active)
      chex.assert_trees_all_equal(plan, eager_plan)
      chex.assert_trees_all_equal(state, eager)


def test_gated_step_never_retraces():
  planner = _planner(explore_every=2, recheck_every=2)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, probs, cost, active):
    drafting = planner.draft_slots(state, active)
    return planner.plan(state, probs, cost, active=active, drafting=drafting)

  chex.clear_trace_counter()
  rng = np.random.default_rng(2)
  state = planner.init(B)
  for t in range(8):
    probs = jnp.asarray(rng.uniform(0.0, 1.0, (B, K)), jnp.float32)
    cost = (_step_cost, _dear_cost, _free_cost)[t % 3]()
    _, state = step(state, probs, cost, jnp.asarray(rng.random(B) < 0.9))
  assert int(state.step) == 8


@pytest.mark.parametrize("gated", [True, False])
def test_keep_drafting_on_gathered_rows_equals_full_batch(gated):
  planner = _planner(policy="lagged", draft_stop="survival", explore_every=2,
                     skip_unprofitable_drafts=gated)
  rng = np.random.default_rng(4)
  probs = jnp.asarray(rng.uniform(0.3, 1.0, (B, K)), jnp.float32)
  rows = np.array([0, 3, 6, 7])  # the drafting slots, gathered
  drafting = np.zeros(B, bool)
  drafting[rows] = True
  for step in (2, 4, 6, 12, 14):  # exploration steps whose round-robin slot is 1, 2, 3, 6, 7
    state = planner.init(B)._replace(step=jnp.int32(step), tau=jnp.float32(0.6))
    for depth in range(1, K):
      drafted = jnp.asarray(np.arange(K)[None] < depth) & jnp.asarray(drafting)[:, None]
      full = planner.keep_drafting(state, probs, drafted, depth,
                                   active=jnp.asarray(drafting))
      sub = planner.keep_drafting(state, probs[rows], drafted[rows], depth,
                                  active=jnp.ones(len(rows), bool),
                                  slots=jnp.asarray(rows, jnp.int32))
      np.testing.assert_array_equal(sub, np.asarray(full)[rows])
  with pytest.raises(ValueError, match="slots"):  # a [1] state does not know B
    planner.keep_drafting(planner.init(), probs[rows], drafted[rows], 1,
                          active=jnp.ones(len(rows), bool), slots=jnp.asarray(rows))


def test_scalar_drafting_still_works():
  planner, cost = _planner(), _step_cost()
  probs = _half_probs()
  for init in (lambda: planner.init(), lambda: planner.init(B)):
    state = init()._replace(step=jnp.int32(1))
    scalar, s1 = planner.plan(state, probs, cost, drafting=True)
    vector, s2 = planner.plan(state, probs, cost, drafting=jnp.ones((B,), bool))
    chex.assert_trees_all_equal((scalar, s1), (vector, s2))
    none, s3 = planner.plan(state, probs, cost, drafting=False)
    assert int(none.num_verified.sum()) == 0
    chex.assert_trees_all_equal(s3.slot_pays, state.slot_pays)
    assert int(s3.budget) == int(state.budget)
  # An ungated planner ignores the gate: every active slot drafts, verdicts stay True.
  plain = av_jax.make_planner(policy="current", explore_every=4)
  active = jnp.arange(B) < 5
  np.testing.assert_array_equal(plain.draft_slots(plain.init(B), active), active)
  _, s = plain.plan(plain.init(B), probs, _dear_cost(), active=active)
  assert bool(s.slot_pays.all()) and bool(plain.should_draft(s))


def test_bad_inputs_name_the_argument():
  planner = _planner()
  with pytest.raises(ValueError, match="recheck_slots"):
    _planner(recheck_slots=0)
  with pytest.raises(ValueError, match="max_recheck_every"):
    _planner(max_recheck_every=6)  # not a multiple of explore_every = 4
  with pytest.raises(ValueError, match="num_slots"):
    planner.init(0)
  with pytest.raises(ValueError, match="slot_pays"):
    planner.plan(planner.init(3), _half_probs(), _step_cost())
  with pytest.raises(ValueError, match="drafting"):
    planner.plan(planner.init(B), _half_probs(), _step_cost(), drafting=jnp.ones((3,), bool))


def test_decider_passes_batch_size_and_slots():
  decider = av_jax.make_decider(K, policy="current",
                                planner=av_jax.PlannerConfig(skip_unprofitable_drafts=True))
  state = decider.init(B)
  assert state.planner.slot_pays.shape == (B,)
  assert decider.init().planner.slot_pays.shape == (1,)
  active = jnp.ones((B,), bool)
  np.testing.assert_array_equal(decider.draft_slots(state, active), active)
  assert bool(decider.drafts(state))


def test_a_grown_group_that_pays_resets_the_backoff_where_it_pays():
  """A re-checked slot whose group fails grows it instead of closing; the re-check is not
  a find (the interval doubles), and the step on which the grown group pays resets the
  interval and brings the next re-check within `recheck_every` steps. Negative control:
  the same re-check with a pass cheap enough for the lone slot is a find at once."""
  planner, cost = _planner(), _heavy_pass_cost()
  probs = jnp.full((B, K), 0.9, jnp.float32)
  active = jnp.ones((B,), bool)
  lone = jnp.arange(B) == 0
  state = planner.init(B)._replace(
      step=jnp.int32(8), next_recheck=jnp.int32(8), recheck_interval=jnp.int32(8),
      slot_pays=jnp.zeros((B,), bool),
      pay_margin=jnp.full((B,), av_jax.planner.WAITING, jnp.float32))
  _, grown = planner.plan(state, probs, cost, active=active, drafting=lone)
  G = _grown_size(probs, cost, active, lone, B - 1)
  assert G is not None and 1 < G < B
  np.testing.assert_array_equal(np.asarray(grown.slot_pays), np.arange(B) < G)
  assert int(grown.recheck_interval) == 16 and int(grown.next_recheck) == 24
  grown = grown._replace(step=jnp.int32(9))
  drafting = planner.draft_slots(grown, active)
  np.testing.assert_array_equal(np.asarray(drafting), np.arange(B) < G)
  _, paid = planner.plan(grown, probs, cost, active=active, drafting=drafting)
  # The grown group pays: its slots keep drafting and the slots still waiting reopen.
  assert np.asarray(paid.slot_pays).all()
  assert int(paid.recheck_interval) == 4 and int(paid.next_recheck) == 13
  _, cheap = planner.plan(state, probs, _step_cost(), active=active, drafting=lone)
  assert bool(cheap.slot_pays[0]) and int(cheap.recheck_interval) == 4
