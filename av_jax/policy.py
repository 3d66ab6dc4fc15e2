"""The decision: who drafts, how deep, and what is verified, from one priced objective.

At every step AV picks, among the candidate sets of draft positions, the one that
maximises expected emitted tokens per unit of priced step time:

    rate(n) = (R + S_(1) + ... + S_(n)) / (draft_ms(rows, depths) + verify_ms(R + n))

R is the number of active requests (each emits at least one token a step), S_(i) the i-th
largest survival (the probability that a draft position and every one before it is
accepted) among the candidate positions, ranked with ties to the lower position, then the
lower slot. Because survival never increases along a request, every prefix of the ranking
is a prefix of each request's positions: candidate n drafts, for each request, the
positions of it among the top n. So "drafting does not pay" (n = 0), "only these
requests draft" and "stop after depth 2" are outcomes of one argmax (`choose`), priced by
the deployment's tables: `draft_depth_ms[R_k, k]` for the R_k requests that draft depth
k + 1, `verify_ms[T]` for T verified tokens.

The choice is made before drafting and again as drafts arrive, each time with what is
known then; every use is exact (docs/algorithm.md sections 5 and 10):

1. `plan`, before drafting, from information fixed before this step's draws: every
   active request's predicted survival curve gives the rows that draft and each row's
   depth. The curve is a second estimator's (`lagged_features`) on the request's latest
   drafted features centred on each depth's running mean (0 where it has none), fitted
   on those reads against the outcomes of the step they planned: what the last step's
   features say about the next step.
2. `keep_drafting`, after each pass of a sampled autoregressive drafter: the drafted
   positions are sunk and will be verified, their survival from their own features;
   a request drafts on while the best candidate holds a later position (it may stop
   before its planned depth or go past it). The decision to draft depth j + 1 reads
   features of depths <= j: a stopping rule.
3. `verify`, after drafting: with a parallel drafter or greedy drafting the drafts'
   distributions do not depend on this step's draws, so the choice is made again over
   the drafted positions with their own features (the drafting cost now sunk); with
   sampled autoregressive drafting every drafted position is verified.

Exploration (`explore_credit`) keeps labels arriving at every depth: one request, round
robin, drafts and verifies all K positions whenever the exploration credit, a stated
share of the step time so far, covers the priced cost of doing so.

The policy is a composition of parts (`av_jax.parts`), each an `(init, update)` pair over
its own state: the estimator (coefficients), the memory (each request's latest features) and
the explorer. An ablation is another composition (`make_policy(..., memory=...,
explorer=...)`).

The engine's shape is priced by the same objective (`depth_cap`): an engine of depth cap
K pays for its K in every drafting step (an autoregressive drafter's first pass reads the
K + 1 pending tokens a request, a parallel drafter drafts its whole block), so the cap is
the K under which the plan's own choice, on batches of the deployment's requests, has the
highest predicted tokens per ms.

Example (one request, K = 2, verify 1.0 ms + 0.1 ms a token, drafting 0.2 ms a depth):
survivals [0.9, 0.5] give rates 1/1.0, 1.9/1.3 = 1.46, 2.4/1.6 = 1.5: draft and verify
both positions. Survivals [0.3, 0.1] give 1/1.0, 1.3/1.3 = 1.0, 1.4/1.6: draft nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from av_jax.estimator import EstimatorConfig, identity_estimator, online_estimator
from av_jax.parts import (ExploreState, MemoryState, Part, StepOutcome, estimator_part,
                          explore_credit, lagged_features, latest_features, no_exploration)

DRAFTER_KINDS = ("autoregressive", "parallel")


class StepCost(NamedTuple):
  """Priced step time of one deployment (milliseconds by convention; a pytree)."""
  # [R_max + 1, K] float32, what drafting depth k + 1 adds for R requests: an
  # autoregressive drafter's pass k + 1; for a parallel drafter, its pass with a block of
  # k + 1 positions less its pass with k (`parallel_depths`), so drafting d positions
  # costs the first d columns either way.
  draft_depth_ms: jax.Array
  verify_ms: jax.Array  # [T_max + 1] float32, one target pass over T tokens
  # [] the least a step that drafts pays to verify (`CostModel.drafting_floor_ms`): a
  # candidate that drafts is priced `max(verify_ms[T], floor)`; one that does not, `verify_ms[T]`.
  drafting_floor_ms: jax.typing.ArrayLike = 0.0

  @classmethod
  def from_tables(cls, tables) -> "StepCost":
    """From `av_jax.costs.CostTables` (modelled or measured)."""
    floor = tables.cost.drafting_floor_ms
    return cls(jnp.asarray(tables.draft_depth_ms, jnp.float32),
               jnp.asarray(tables.cost.verify_ms, jnp.float32),
               0.0 if floor is None else jnp.asarray(floor, jnp.float32))

  @staticmethod
  def parallel_depths(pass_ms) -> np.ndarray:
    """`[R_max + 1, K]` depth increments of a parallel drafter from `pass_ms [K, R_max +
    1]`, its pass with a block of k + 1 positions for R requests (kept non-decreasing
    in the block)."""
    passes = np.maximum.accumulate(np.asarray(pass_ms, np.float64), axis=0)
    return np.diff(passes, axis=0, prepend=0.0).T

  def draft(self, rows_at_depth: jax.Array) -> jax.Array:
    """Drafting cost of `rows_at_depth [..., K]` requests drafting each depth."""
    R_max, K = self.draft_depth_ms.shape[0] - 1, self.draft_depth_ms.shape[1]
    rows = jnp.minimum(rows_at_depth, R_max)
    # A depth no request drafts costs nothing (whatever the table's row 0 holds).
    return jnp.sum(jnp.where(rows > 0, self.draft_depth_ms[rows, jnp.arange(K)], 0.0), axis=-1)

  def verify(self, tokens: jax.Array) -> jax.Array:
    return self.verify_ms[jnp.minimum(tokens, self.verify_ms.shape[0] - 1)]

  def drafting_verify(self, tokens: jax.Array) -> jax.Array:
    """Verification of `tokens` in a step that drafts: at least the drafting floor."""
    return jnp.maximum(self.verify(tokens), self.drafting_floor_ms)


def survival_of(probs: jax.Array) -> jax.Array:
  """`[B, K]`: survival `S[b, i] = prod_{j <= i} probs[b, j]` (probabilities clipped to
  [0, 1]; NaN counts as 0, so nothing after it survives)."""
  probs = jnp.clip(jnp.nan_to_num(probs, nan=0.0), 0.0, 1.0)
  return jnp.cumprod(probs, axis=1)


class Choice(NamedTuple):
  num: jax.Array       # [B] int32, chosen positions of each request (a prefix)
  budget: jax.Array    # [] int32, positions chosen (sum of num)
  expected: jax.Array  # [] float32, expected emitted tokens
  cost_ms: jax.Array   # [] float32, priced step time


def choose(survival: jax.Array, *, eligible: jax.Array, forced: jax.Array,
           active: jax.Array, cost: StepCost, sunk_ms: jax.typing.ArrayLike = 0.0,
           price_drafting: bool = True, shared_passes: bool = False,
           others: jax.typing.ArrayLike = 0) -> Choice:
  """The candidate set of draft positions with the highest expected tokens per ms.

  Candidates: for each depth cap d = 1..K (drafting passes or block size), the top n of
  the eligible positions at depths <= d ranked by survival (ties to the lower position,
  then the lower slot), n = 0.. their number. A cap matters because a drafter pass costs
  about the same for one request as for all: "every request to depth 2" can beat "one
  request to depth 4" at equal survival.

  Args:
    survival: `[B, K]` survival of each position (non-increasing along a row).
    eligible: `[B, K]` bool, positions that may be chosen (a prefix of each row).
    forced: `[B, K]` bool, positions that must be chosen (eligible ones; exploration).
    active: `[B]` bool, requests decoding this step.
    cost: the step's prices.
    sunk_ms: time already spent this step (drafting done), added to every candidate.
    price_drafting: charge the drafting of the chosen rows and depths and try every
      depth cap (before drafting); False after drafting (one cap, K).
    shared_passes: every drafting request pays every pass up to the deepest chosen depth
      (a parallel drafter's block; a static-shape batch of an autoregressive drafter,
      whose passes run every drafting row); else each request pays its own depths.
    others: active requests outside these rows (they emit their one token and are
      verified with the step: counted in the expected tokens and the verify price).

  Returns:
    The `Choice`; n = 0 (nothing drafted or verified) when nothing pays.
  """
  B, K = survival.shape
  M = B * K
  eligible = eligible & active[:, None]
  forced = forced & eligible
  key = jnp.where(forced, 2.0 + survival, jnp.where(eligible, survival, -1.0))
  # Position-major flattening (index k * B + b) and a stable sort: ties go to the lower
  # position, then the lower slot.
  order = jnp.argsort(-key.T.reshape(-1), stable=True)
  ranked_s = jnp.where(eligible, survival, 0.0).T.reshape(-1)[order]     # [M]
  ranked_k = (order // B).astype(jnp.int32)
  ranked_ok = eligible.T.reshape(-1)[order]
  caps = jnp.arange(1, K + 1) if price_drafting else jnp.asarray([K])
  in_cap = (ranked_k[None, :] < caps[:, None]) & ranked_ok[None, :]       # [C, M]
  prefix = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), jnp.cumsum(x, axis=1)], 1)
  gain = prefix(jnp.where(in_cap, ranked_s[None, :], 0.0))                  # [C, M + 1]
  n = prefix(in_cap.astype(jnp.int32))                                      # [C, M + 1]
  num_active = jnp.sum(active, dtype=jnp.int32) + jnp.asarray(others, jnp.int32)
  # A candidate that drafts (n > 0, or any after drafting) runs the drafting step.
  drafts = (n > 0) if price_drafting else jnp.ones_like(n, bool)
  total = jnp.asarray(sunk_ms, jnp.float32) + jnp.where(
      drafts, cost.drafting_verify(num_active + n), cost.verify(num_active + n))
  if price_drafting:
    total = total + _drafting_ms(cost, ranked_k, ranked_ok, caps, shared_passes)
  expected = num_active + gain
  # A candidate ends on an entry within its cap (or is empty), keeps every forced entry.
  ends_in_cap = jnp.concatenate([jnp.ones_like(in_cap[:, :1]), in_cap], axis=1)
  deepest_forced = jnp.max(jnp.where(forced, jnp.arange(1, K + 1), 0))
  ok = ends_in_cap & (n >= jnp.sum(forced)) & (caps[:, None] >= deepest_forced)
  value = jnp.where(ok, expected / jnp.maximum(total, 1e-9), -jnp.inf)
  flat = jnp.argmax(value)  # the smallest cap, then the smallest n, among equal values
  c, i = flat // (M + 1), flat % (M + 1)
  chosen = jnp.zeros((M,), bool).at[order].set(in_cap[c] & (jnp.arange(M) < i))
  num = jnp.sum(chosen.reshape(K, B).T, axis=1, dtype=jnp.int32)
  return Choice(num=jnp.where(active, num, 0), budget=n[c, i].astype(jnp.int32),
                expected=expected[c, i], cost_ms=total[c, i])


def _drafting_ms(cost: StepCost, ranked_k, ranked_ok, caps, shared_passes: bool):
  """`[C, M + 1]`: drafting price of the first n ranked entries within each cap.

  The requests drafting depth k among the first n entries do not depend on the cap
  (a cap only drops depths >= it), so one `[M + 1, K]` count serves every cap: the
  price of cap c is the running sum over depths < c of each depth's price.
  """
  K = cost.draft_depth_ms.shape[1]
  R_max = cost.draft_depth_ms.shape[0] - 1
  hits = jax.nn.one_hot(ranked_k, K, dtype=jnp.int32) * ranked_ok[:, None]  # [M, K]
  rows = jnp.concatenate([jnp.zeros_like(hits[:1]), jnp.cumsum(hits, axis=0)], 0)
  price = lambda r: jnp.where(r > 0, cost.draft_depth_ms[jnp.minimum(r, R_max),
                                                         jnp.arange(K)], 0.0)
  running = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), jnp.cumsum(x, 1)], 1)
  if shared_passes:  # every drafting request pays each pass up to the deepest depth
    depth = running((rows > 0).astype(jnp.int32))[:, caps]               # [M + 1, C]
    by_depth = running(price(jnp.broadcast_to(rows[:, :1], rows.shape)))  # [M + 1, K + 1]
    return jnp.take_along_axis(by_depth, depth, axis=1).T
  return running(price(rows))[:, caps].T


class DepthCap(NamedTuple):
  cap: int              # the chosen depth cap K (>= 1)
  rates: np.ndarray     # [K_max] predicted tokens per ms of the engine of cap k + 1


def depth_cap(survival, costs: Sequence[StepCost], *, num_slots: int, weights=None,
              shared_passes: bool = False) -> DepthCap:
  """The depth cap K of an engine: the k under which the plan's own choice (`choose`,
  depths <= k, cap k's tables) on batches of `num_slots` of the deployment's requests has
  the most expected tokens per ms (ties to the smaller k). A deeper cap makes every
  drafting step dearer (a wider first pass or block); the plan drafts deep only where it
  pays, so the cap is priced for its choices, not for "every request verifies k".

  A request joins a batch with probability proportional to the steps it holds its slot,
  `w_n / t_n(k)`, `t_n(k) = 1 + sum_{j < k} S[n, j]` (one that accepts little holds it
  longer); batches are stratified draws, the same for every cap.

  Args:
    survival: `[N, K_max]` predicted survival curves: one per recent request, or several
      per request with `weights` (e.g. `predicted_survival` after every chunk).
    costs: `StepCost` of the engine of each cap k = 1..K_max (`costs[k - 1]` with >= k
      depth columns and verify entries up to `num_slots (k + 1)` tokens).
    num_slots: B, the concurrency the engine serves.
    weights: `[N]` non-negative, the tokens each curve's request emitted since its
      previous curve, so a request's weights sum to its length (None: equal).
    shared_passes: as `choose` (a parallel drafter's block: True).

  Example: survival [[0.9, 0.5, 0.1]], B = 1, verify 1.0 ms plus 0.1 ms a draft token,
  drafting 0.2 ms a depth: caps 1, 2, 3 choose 1, 2 and 2 positions, 1.9 / 1.3 = 1.46,
  2.4 / 1.6 = 1.50, 1.50 tokens per ms: cap 2.
  """
  S = np.clip(np.nan_to_num(np.asarray(survival, np.float64), nan=0.0), 0.0, 1.0)
  if S.ndim != 2 or S.shape[0] == 0:
    raise ValueError(f"survival: expected [N >= 1, K] curves, got shape {S.shape}")
  K = S.shape[1]
  if len(costs) != K:
    raise ValueError(f"costs: expected one StepCost per cap 1..{K}, got {len(costs)}")
  B = int(num_slots)
  if B < 1:
    raise ValueError(f"num_slots: expected an int >= 1, got {num_slots!r}")
  w = np.ones(S.shape[0]) if weights is None else np.asarray(weights, np.float64)
  if w.shape != S.shape[:1] or not np.all(w >= 0) or not w.sum() > 0:
    raise ValueError(f"weights: expected [{S.shape[0]}] non-negative with a positive sum, "
                     f"got shape {w.shape}")
  stacked = _stacked_caps(costs, B)
  held = w[:, None] / (1.0 + np.cumsum(S, axis=1))                       # [N, K]
  draws = B * int(np.clip(-(-64 * S.shape[0] // B), 4, max(4, 16384 // B)))
  u = (np.random.default_rng(0).permutation(draws) + 0.5) / draws
  cdf = np.cumsum(held, axis=0) / held.sum(axis=0)
  pick = np.stack([np.minimum(np.searchsorted(cdf[:, k], u), len(S) - 1) for k in range(K)])
  expected, ms = _cap_rates(jnp.asarray(S[pick].reshape(K, -1, B, K), jnp.float32), stacked,
                            shared_passes)
  rates = np.asarray(expected, np.float64).sum(1) / np.asarray(ms, np.float64).sum(1)
  return DepthCap(cap=int(np.argmax(rates)) + 1, rates=rates)


def _stacked_caps(costs: Sequence[StepCost], B: int) -> StepCost:
  """Every cap's tables in one `StepCost` of `[K]`-stacked arrays: cap k's drafting columns
  past k priced 0 (never chosen), rows and verify entries padded with their last."""
  K, R = len(costs), max(np.shape(c.draft_depth_ms)[0] for c in costs)
  T = max(max(np.shape(c.verify_ms)[0] for c in costs), B * (K + 1) + 1)
  depth, verify = [], []
  for k, c in enumerate(costs, start=1):
    d = np.asarray(c.draft_depth_ms, np.float32)
    if d.ndim != 2 or d.shape[1] < k or d.shape[0] < 2:
      raise ValueError(f"costs[{k - 1}]: expected draft_depth_ms [R + 1, >= {k}], got "
                       f"{d.shape}")
    d = np.pad(d[:, :k], ((0, R - d.shape[0]), (0, K - k)), mode="edge")
    d[:, k:] = 0.0
    depth.append(d)
    verify.append(np.pad(np.asarray(c.verify_ms, np.float32), (0, T - np.shape(c.verify_ms)[0]),
                         mode="edge"))
  floors = [np.float32(c.drafting_floor_ms) for c in costs]
  return StepCost(jnp.asarray(np.stack(depth)), jnp.asarray(np.stack(verify)),
                  jnp.asarray(floors, jnp.float32))


@functools.partial(jax.jit, static_argnums=2)
def _cap_rates(curves: jax.Array, costs: StepCost, shared_passes: bool):
  """`[C, batches]` expected tokens and priced ms of the plan's choice on each batch of
  `curves [C, batches, B, K]` under cap c + 1 (depths <= c + 1, `costs` stacked by cap)."""
  C, _, B, K = curves.shape

  def one(S, cost, cap):
    ok = jnp.broadcast_to(jnp.arange(K) < cap, (B, K))
    got = choose(S, eligible=ok, forced=jnp.zeros_like(ok), active=jnp.ones((B,), bool),
                 cost=cost, shared_passes=shared_passes)
    return got.expected, got.cost_ms

  per_cap = jax.vmap(one, in_axes=(0, None, None))
  return jax.lax.map(lambda a: per_cap(*a), (curves, costs, jnp.arange(1, C + 1)))


# ---------------------------------------------------------------------------- policy


class PolicyState(NamedTuple):
  estimator: Any        # the estimator part's state (coefficients and round statistics)
  memory: MemoryState   # the memory part's state
  explore: ExploreState  # the explorer's state


class Plan(NamedTuple):
  """What a step drafts, decided before drafting."""
  draft: jax.Array     # [B] bool, requests that draft
  depth: jax.Array     # [B] int32, depths each drafts (K for a parallel drafter)
  num: jax.Array       # [B] int32, positions the plan would verify (the lagged choice)
  explore: jax.Array   # [B] bool, the request exploring (all K drafted and verified)
  explore_ms: jax.Array  # [] float32, priced cost of the exploration (0: none)
  expected: jax.Array  # [] float32, expected emitted tokens of the plan
  cost_ms: jax.Array   # [] float32, priced time of the plan


@dataclasses.dataclass(frozen=True)
class Policy:
  """The decision's verbs; build with `make_policy`."""
  num_positions: int
  drafter_kind: str
  current: bool  # re-choose after drafting (parallel drafter, or greedy drafting)
  estimator: Any  # OnlineEstimator-like: init(), predict(state, x), update(...)
  parts: tuple[Part, ...]  # estimator, memory, explorer
  shared_passes: bool = False  # a drafter pass costs every drafting row (static shapes)

  def init(self, num_slots: int) -> PolicyState:
    K = self.num_positions
    return PolicyState(*(p.init(num_slots, K) for p in self.parts))

  def admit(self, state: PolicyState, slots: jax.Array) -> PolicyState:
    """New requests in `slots [B]`: their memory starts empty."""
    return state._replace(memory=state.memory._replace(
        known=state.memory.known & ~slots[:, None]))

  def survival(self, state: PolicyState, features: jax.Array) -> jax.Array:
    """`[B, K]`: survival of drafts with `features` under the current coefficients."""
    return survival_of(self.estimator.predict(state.estimator, features))

  def predicted_survival(self, state: PolicyState) -> jax.Array:
    """`[B, K]`: every request's predicted survival curve for its next step."""
    return survival_of(self._predicted(state))

  def _predicted(self, state: PolicyState) -> jax.Array:
    """`[B, K]`: every request's predicted acceptance per depth for its next step."""
    memory = self.parts[1]
    if memory.predict is not None:
      return memory.predict(state.memory)
    return self.estimator.predict(state.estimator, memory.read(state.memory))

  def plan(self, state: PolicyState, active: jax.Array, cost: StepCost) -> Plan:
    """Before drafting: the rows that draft and their depths (reads no draw of this
    step)."""
    B, K = state.memory.latest.shape
    survival = self.predicted_survival(state)
    explore = self._explorer(state, active, cost)
    all_k = jnp.ones((B, K), bool)
    parallel = self.drafter_kind == "parallel"
    choice = choose(survival, eligible=all_k, forced=explore[:, None] & all_k,
                    active=active, cost=cost, shared_passes=parallel or self.shared_passes)
    draft = choice.num > 0
    depth = jnp.where(draft, jnp.max(choice.num) if parallel else choice.num, 0)
    return Plan(draft=draft, depth=depth.astype(jnp.int32), num=choice.num, explore=explore,
                explore_ms=jnp.where(jnp.any(explore), self._explore_ms(active, cost), 0.0),
                expected=choice.expected, cost_ms=choice.cost_ms)

  def keep_drafting(self, state: PolicyState, plan: Plan, probs: jax.Array,
                    drafted: jax.Array, depth: jax.typing.ArrayLike, *, active: jax.Array,
                    cost: StepCost, num_active: jax.typing.ArrayLike | None = None
                    ) -> jax.Array:
    """After `depth` passes of an autoregressive drafter: `[B]` bool, the requests that
    draft depth + 1. The choice is made again with what is now known: the drafted
    positions (`drafted [B, K]`) are sunk and will be verified, with acceptance `probs
    [B, K]` from their own features (read where drafted); the later positions of the
    requests still drafting carry their predicted acceptance; passes up to `depth` are
    sunk, later ones priced. A request drafts on iff the best candidate holds a position
    past its drafted ones. Whether depth j + 1 is drafted reads features up to depth j
    only: a stopping rule, so verifying every drafted position stays exact
    (docs/algorithm.md section 10). `num_active`: the step's active requests when `active`
    covers a subset of them (the drafting rows), for the verify price.

    Example (one request, K = 3, predicted acceptance 0.4 at every depth, verify 1.0 ms
    for the base token + 0.1 ms a draft, a pass 0.1 ms): the plan drafts 1 position
    (rate 1.4 / 1.2 beats 1.56 / 1.4). If the drafted feature reads acceptance 0.95,
    depth 2 now pays ((1.95 + 0.38) / 1.4 > 1.95 / 1.2) and the request drafts on; if
    it reads 0.5, it stops (1.7 / 1.4 < 1.5 / 1.2).
    """
    B, K = drafted.shape
    col = jnp.arange(K)[None, :]
    going = jnp.asarray(active, bool) & drafted[:, jnp.maximum(depth - 1, 0)]
    predicted = self._predicted(state)
    survival = survival_of(jnp.where(drafted, probs, predicted))
    eligible = going[:, None] | drafted
    forced = (drafted | plan.explore[:, None]) & eligible
    rows = jnp.sum(drafted, axis=0, dtype=jnp.int32)
    if self.shared_passes:
      rows = jnp.where(col[0] < depth, jnp.max(rows), 0)
    later = cost._replace(draft_depth_ms=jnp.where(col[0] < depth, 0.0, cost.draft_depth_ms))
    others = (0 if num_active is None
              else jnp.asarray(num_active, jnp.int32) - jnp.sum(active, dtype=jnp.int32))
    choice = choose(survival, eligible=eligible, forced=forced, active=active, cost=later,
                    sunk_ms=cost.draft(rows), shared_passes=self.shared_passes,
                    others=others)
    return going & (choice.num > depth)

  def verify(self, state: PolicyState, plan: Plan, features: jax.Array, active: jax.Array,
             cost: StepCost, draft_ms: jax.typing.ArrayLike) -> jax.Array:
    """After drafting: `[B]` positions each request verifies."""
    if not self.current:
      return plan.num
    K = self.num_positions
    drafted = jnp.arange(K)[None, :] < plan.depth[:, None]
    survival = self.survival(state, features)
    choice = choose(survival, eligible=drafted, forced=drafted & plan.explore[:, None],
                    active=active, cost=cost, sunk_ms=draft_ms, price_drafting=False)
    return choice.num

  def learn(self, state: PolicyState, step: StepOutcome, *,
            axis_name: str | None = None) -> PolicyState:
    """Every part's update with what the step did; `axis_name`: the mesh axis over which
    data-parallel replicas sum the estimators' round statistics (so their coefficients
    agree)."""
    parts = list(self.parts)
    if axis_name is not None:
      parts[0] = parts[0]._replace(update=lambda s, o: self.estimator.update(
          s, o.features, o.accepted, o.labeled, axis_name=axis_name))
      memory = parts[1].update
      parts[1] = parts[1]._replace(update=lambda s, o: memory(s, o, axis_name=axis_name))
    return PolicyState(*(p.update(s, step) for p, s in zip(parts, state)))

  def _explore_ms(self, active, cost: StepCost) -> jax.Array:
    K = self.num_positions
    R = jnp.sum(active, dtype=jnp.int32)
    return (cost.draft(jnp.ones((K,), jnp.int32)) + cost.drafting_verify(R + K)
            - cost.verify(R))

  def _explorer(self, state: PolicyState, active, cost: StepCost) -> jax.Array:
    """`[B]` bool: the request that explores this step (none, or one)."""
    e = state.explore
    B = active.shape[0]
    due = jnp.any(active) & (e.credit_ms >= self._explore_ms(active, cost))
    # The first active slot at or after the pointer, cyclically.
    distance = (jnp.arange(B) - e.next_slot) % B
    slot = jnp.argmin(jnp.where(active, distance, B))
    return due & (jnp.arange(B) == slot)


def make_policy(num_positions: int, *, drafter_kind: str, greedy: bool = False,
                estimator: Any = None, memory: Part | None = None,
                explorer: Part | None = None, shared_passes: bool = False,
                estimator_config: EstimatorConfig | None = None) -> Policy:
  """Builds the policy for a drafter.

  Args:
    num_positions: K, draft positions per request.
    drafter_kind: "parallel" (one pass drafts all K) or "autoregressive" (a pass per depth).
    greedy: drafts are the drafter's arg-max (its distributions do not depend on draws).
    estimator: an `OnlineEstimator`-like object (default: `online_estimator(K)`).
    memory: the memory part (default `lagged_features` with an estimator of the default
      estimator's settings: the plan's prediction fitted on the plan's own inputs).
    explorer: the exploration part (default `explore_credit(0.01)`).
    shared_passes: an autoregressive drafter's passes run every drafting row until the
      deepest stops (an engine of static shapes, like av_jax's); False: each row pays its
      own depths (ragged kernels).
    estimator_config: settings of the default estimator.

  Returns:
    A `Policy`: `init(B)`, `admit`, `plan`, `verify`, `learn`, `predicted_survival`.

  Example:
    >>> policy = make_policy(8, drafter_kind="parallel")
    >>> state = policy.init(B)
    >>> plan = policy.plan(state, active, cost)                  # before drafting
    >>> num = policy.verify(state, plan, features, active, cost, draft_ms)
    >>> state = policy.learn(state, StepOutcome(...))             # after verification
  """
  if drafter_kind not in DRAFTER_KINDS:
    raise ValueError(f"drafter_kind: expected one of {DRAFTER_KINDS}, got {drafter_kind!r}")
  K = int(num_positions)
  if K < 1:
    raise ValueError(f"num_positions: expected an int K >= 1, got {num_positions!r}")
  estimator = estimator or online_estimator(K, estimator_config)
  memory = memory or lagged_features(online_estimator(
      K, estimator_config or getattr(estimator, "config", None)))
  parts = (estimator_part(estimator), memory,
           explorer or explore_credit())
  return Policy(num_positions=K, drafter_kind=drafter_kind,
                current=(drafter_kind == "parallel" or greedy), estimator=estimator,
                parts=parts, shared_passes=shared_passes)
