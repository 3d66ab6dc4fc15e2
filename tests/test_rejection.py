"""Rejection sampling: exact emitted laws, acceptance rates, greedy, structure, ragged layout.

Statistical tests use N = 2**18 samples per case, a chi-square goodness-of-fit test with
p-value > 1e-4 on the categories of positive mass, exact zero counts on the categories of
zero mass, and a total-variation bound 5 * sqrt(C / N) for C categories. Rates are compared
with their analytic values within 5 standard errors. Seeds are fixed, so every run is
deterministic; the tolerances say how unlikely a false failure would be.
"""

import zlib

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import av_jax

N = 2**18            # samples per statistical case
P_VALUE_MIN = 1e-4   # chi-square tolerance
NUM_SE = 5.0         # standard errors allowed for rates


def _key(seed):
  """A PRNG key. XLA's RngBitGenerator ("rbg") compiles several times faster than the
  default threefry on CPU, and these tests are dominated by compilation; the tests that
  compare vmapped and per-key results use the default implementation."""
  return jax.random.key(seed, impl="rbg")


# ----------------------------------------------------------------------------------------
# Markov toy tables: drafter q1 [V], Qn [V, V]; target P1 [V], Pn [V, V]. Position i >= 2 of
# a step uses the row of the previous token (draft token, or the emitted token at a new
# step), so the drafter is autoregressive and the target's law of two tokens is
# P1(y1) Pn[y1](y2).


def _normalise(x):
  x = np.asarray(x, np.float64)
  return x / x.sum(-1, keepdims=True)


def _tables(case, V, seed):
  rng = np.random.default_rng(seed)
  q1, Qn, P1, Pn = (rng.dirichlet(np.ones(V), size=s) for s in ((), (V,), (), (V,)))
  if case == "q_zeros":      # the drafter never proposes some tokens the target likes
    q1[:2] = 0.0
    Qn[np.arange(V), np.arange(V)] = 0.0
    Qn[:, 0] = 0.0
  elif case == "p_zeros":    # the target forbids tokens the drafter proposes
    P1[1:3] = 0.0
    Pn[np.arange(V), (np.arange(V) + 1) % V] = 0.0
    Pn[:, -1] = 0.0
  elif case == "p_eq_q":
    q1, Qn = P1.copy(), Pn.copy()
  elif case == "disjoint":   # always rejected at position 1: residual is p
    q1[: V // 2] = 0.0
    P1[V // 2:] = 0.0
  elif case != "dense":
    raise ValueError(case)
  return tuple(_normalise(t) for t in (q1, Qn, P1, Pn))


def _step(key, first_q, first_p, Qn, Pn, num_verified, K):
  """Draws K Markov draft tokens per row and verifies `num_verified` of them.

  first_q, first_p: [N, V] the drafter's and target's distributions at position 1.
  """
  n = first_q.shape[0]
  keys = jax.random.split(key, K + 1)
  rows_q, rows_p, tokens = [first_q], [first_p], []
  for i in range(K):
    x = jax.random.categorical(keys[i], jnp.log(rows_q[-1]), axis=-1)
    tokens.append(x)
    rows_q.append(Qn[x])
    rows_p.append(Pn[x])
  draft_tokens = jnp.stack(tokens, axis=1)                 # [N, K]
  draft_probs = jnp.stack(rows_q[:K], axis=1)              # [N, K, V]
  target_probs = jnp.stack(rows_p, axis=1)                 # [N, K+1, V]
  out = av_jax.rejection_sample(keys[K], draft_probs=draft_probs, draft_tokens=draft_tokens,
                                target_probs=target_probs,
                                num_verified=jnp.broadcast_to(num_verified, (n,)))
  return out, draft_tokens


def _two_steps(key, q1, Qn, P1, Pn, nv1, nv2, *, K):
  """Step 1 from the start; step 2 continues from the first emitted token y1, so that the
  first two tokens of the output are (y1, y2) whether step 1 emitted one token or more."""
  n = nv1.shape[0]
  k1, k2 = jax.random.split(key)
  out1, drafts1 = _step(k1, jnp.broadcast_to(q1, (n, q1.shape[0])),
                        jnp.broadcast_to(P1, (n, P1.shape[0])), Qn, Pn, nv1, K)
  y1 = out1.tokens[:, 0]
  out2, _ = _step(k2, Qn[y1], Pn[y1], Qn, Pn, nv2, K)
  y2 = jnp.where(out1.num_emitted >= 2, out1.tokens[:, 1], out2.tokens[:, 0])
  return out1, drafts1, y1, y2


def _num_verified(mode, K, key):
  if mode == "none":
    return jnp.zeros((N,), jnp.int32)
  if mode == "partial":
    return jnp.full((N,), max(K - 1, 1), jnp.int32)
  if mode == "all":
    return jnp.full((N,), K, jnp.int32)
  return jax.random.randint(key, (N,), 0, K + 1)        # "random": mixed per request


def assert_law(samples, probs, what):
  """Chi-square (p > P_VALUE_MIN) and TV < 5 sqrt(C/N) for `samples` ~ `probs` (flat)."""
  probs = np.asarray(probs, np.float64).reshape(-1)
  counts = np.bincount(np.asarray(samples).reshape(-1), minlength=probs.size)
  assert counts.size == probs.size, f"{what}: sample outside the support"
  n = counts.sum()
  zero = probs <= 0
  assert counts[zero].sum() == 0, (
      f"{what}: {counts[zero].sum()} samples of zero-probability categories "
      f"{np.nonzero(zero & (counts > 0))[0]}")
  tv = 0.5 * np.abs(counts / n - probs).sum()
  bound = 5.0 * np.sqrt(probs.size / n)
  if (~zero).sum() > 1:  # with one category of positive mass the zero-count check is exact
    pvalue = scipy.stats.chisquare(counts[~zero], n * probs[~zero]).pvalue
    assert pvalue > P_VALUE_MIN, f"{what}: chi-square p-value {pvalue:.3g}; tv {tv:.4g}"
  assert tv < bound, f"{what}: total variation {tv:.4g} >= {bound:.4g}"


def assert_rate(hits, prob, what):
  """Empirical rate of bool `hits` equals `prob` within NUM_SE standard errors."""
  hits = np.asarray(hits)
  prob = float(np.clip(prob, 0.0, 1.0))  # analytic sums may round just outside [0, 1]
  rate = hits.mean()
  se = np.sqrt(prob * (1 - prob) / hits.size)
  assert abs(rate - prob) <= NUM_SE * se + 1e-12, (
      f"{what}: rate {rate:.5f} vs analytic {prob:.5f} (se {se:.2g})")


# ----------------------------------------------------------------------------------------
# Emitted distribution.


# One compiled program for every statistical case (same N, V, K): compiling dominates.
V_STAT, K_STAT = 5, 3
_two_steps_jit = jax.jit(_two_steps, static_argnames="K")


def _check_two_step_law(run, case, mode):
  V, K = V_STAT, K_STAT
  q1, Qn, P1, Pn = _tables(case, V, seed=zlib.crc32(f"{case}/{mode}".encode()))
  k_nv1, k_nv2, k_run = jax.random.split(_key(zlib.crc32(mode.encode())), 3)
  nv1 = _num_verified(mode, K, k_nv1)
  nv2 = jax.random.randint(k_nv2, (N,), 0, K + 1)
  out1, _, y1, y2 = run(k_run, *(jnp.asarray(t, jnp.float32) for t in (q1, Qn, P1, Pn)),
                        nv1, nv2, K=K)
  assert_law(y1, P1, f"{case}/{mode}: first token")
  assert_law(np.asarray(y1) * V + np.asarray(y2), P1[:, None] * Pn, f"{case}/{mode}: pair")
  num_emitted = np.asarray(out1.num_emitted)
  if mode == "none":
    np.testing.assert_array_equal(num_emitted, 1)
  else:   # both the one-token and the multi-token branch of step 1 were exercised
    assert (num_emitted >= 2).any() or case == "disjoint"


@pytest.mark.parametrize("case", ["dense", "q_zeros", "p_zeros", "p_eq_q", "disjoint"])
@pytest.mark.parametrize("mode", ["none", "partial", "all", "random"])
def test_first_two_emitted_tokens_follow_target_law(case, mode):
  _check_two_step_law(_two_steps_jit, case, mode)


def test_first_two_emitted_tokens_follow_target_law_without_jit():
  _check_two_step_law(_two_steps, "q_zeros", "random")


@pytest.mark.parametrize("case", ["dense", "q_zeros", "p_zeros", "p_eq_q", "disjoint"])
def test_acceptance_rates_equal_analytic_min_p_q(case):
  """P(positions 1..i all accepted) = sum over prefixes of prod_j min(q_j, p_j)(x_j)."""
  V, K = V_STAT, K_STAT
  q1, Qn, P1, Pn = _tables(case, V, seed=7 + len(case))
  nv = jax.random.randint(_key(5), (N,), 0, K + 1)
  out, _, _, _ = _two_steps_jit(_key(3),
                                *(jnp.asarray(t, jnp.float32) for t in (q1, Qn, P1, Pn)),
                                nv, nv, K=K)
  # reach[x] = P(positions 1..i accepted and x_i = x): forward recursion on min(q, p).
  reach = np.minimum(q1, P1)
  survive = [1.0]
  for _ in range(K):
    survive.append(reach.sum())
    reach = reach @ np.minimum(Qn, Pn)
  nv, num_accepted, accepted = map(np.asarray, (nv, out.num_accepted, out.accepted))
  for m in range(K + 1):
    sel = nv == m
    for a in range(m + 1):   # exact law of num_accepted given m verified
      prob = survive[a] - (survive[a + 1] if a < m else 0.0)
      assert_rate(num_accepted[sel] == a, prob, f"{case}: P(accepted={a} | verified={m})")
  for i in range(K):        # per-position acceptance among rows that verify position i
    sel = nv > i
    assert_rate(accepted[sel, i], survive[i + 1], f"{case}: P(position {i + 1} accepted)")
  if case == "p_eq_q":
    np.testing.assert_array_equal(num_accepted, nv)
  if case == "disjoint":
    np.testing.assert_array_equal(num_accepted, 0)


def test_vmap_over_keys_equals_per_key_calls_and_gives_the_law():
  V, K, n = 4, 2, 2**16
  q1, Qn, P1, Pn = (jnp.asarray(t, jnp.float32) for t in _tables("dense", V, seed=1))
  x1 = int(jnp.argmax(q1 / P1))   # q1(x1) > P1(x1): accepted with probability < 1
  draft_tokens = jnp.array([[x1, 1]])
  draft_probs = jnp.stack([q1, Qn[x1]])[None]
  target_probs = jnp.stack([P1, Pn[x1], Pn[1]])[None]

  def one(key):
    return av_jax.rejection_sample(key, draft_probs=draft_probs, draft_tokens=draft_tokens,
                                   target_probs=target_probs, num_verified=jnp.array([K]))

  keys = jax.random.split(jax.random.key(0), n)   # default (threefry) keys
  out = jax.jit(jax.vmap(one))(keys)
  one_jit = jax.jit(one)
  for i in range(3):
    single = one_jit(keys[i])
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], out), single)
  # Given the fixed draft x1, the first token is x1 with probability alpha = P1/q1 at x1,
  # else drawn from the residual norm(max(0, P1 - q1)).
  alpha = float(P1[x1] / q1[x1])
  assert 0.05 < alpha < 0.95
  residual = np.maximum(np.asarray(P1, np.float64) - np.asarray(q1, np.float64), 0.0)
  law = (1 - alpha) * residual / residual.sum()
  law[x1] += alpha
  assert_law(out.tokens[:, 0, 0], law, "vmapped keys, fixed draft")


# ----------------------------------------------------------------------------------------
# Greedy: one-hot target probabilities.


def _greedy_expected(draft_tokens, target_tokens, num_verified):
  matches = draft_tokens == target_tokens[:, :-1]
  K = draft_tokens.shape[1]
  lead = np.cumprod(matches & (np.arange(K) < num_verified[:, None]), axis=1).sum(1)
  emitted = target_tokens[np.arange(len(lead)), lead]
  return lead, emitted


def _greedy_case(key, B, K, V, *, vocab_draft):
  """One-hot targets; drafts from a small vocabulary so that matches are frequent."""
  kt, kd, kq, kn, kr = jax.random.split(key, 5)
  target_tokens = jax.random.randint(kt, (B, K + 1), 0, vocab_draft)
  draft_tokens = jax.random.randint(kd, (B, K), 0, vocab_draft)
  draft_probs = jax.nn.softmax(jax.random.normal(kq, (B, K, V)), -1)
  num_verified = jax.random.randint(kn, (B,), 0, K + 1)
  out = av_jax.rejection_sample(kr, draft_probs=draft_probs, draft_tokens=draft_tokens,
                                target_probs=jax.nn.one_hot(target_tokens, V),
                                num_verified=num_verified)
  return out, draft_tokens, target_tokens, num_verified


def test_one_hot_target_is_greedy_verification_for_every_key():
  B, K, V = 1024, 3, 6
  run = jax.jit(functools.partial(_greedy_case, B=B, K=K, V=V, vocab_draft=3))
  bonus = []
  for seed in range(8):
    out, drafts, targets, nv = jax.tree.map(np.asarray, run(_key(seed)))
    lead, emitted = _greedy_expected(drafts, targets, nv)
    np.testing.assert_array_equal(out.num_accepted, lead)
    np.testing.assert_array_equal(out.tokens[np.arange(B), lead], emitted)
    np.testing.assert_array_equal(out.num_emitted, lead + 1)
    bonus.append(out.num_accepted == K)
  bonus = np.concatenate(bonus)
  assert bonus.any() and (~bonus).any()  # both the bonus and the rejection branch occur


def test_one_hot_target_is_greedy_for_every_key_large_vocabulary():
  """Regression: the exponential race must never emit a token of zero residual mass.

  `jax.random.exponential` returns exactly 0 with probability 2**-23 per entry (uniform
  u = 0 in -log1p(-u)); then `0 / 0 = NaN` in `residual / E`, and `argmax` returns the NaN
  entry, a token the target gives probability 0. With a one-hot target every other entry
  has zero residual, so this fires at rate ~ V * 2**-23 per emitted token (4e-3 at
  V = 32000). 768 keys x 8 rows x 4096 entries (25M exponential draws) expose it: the
  expected number of affected rows is ~3 (these keys give 1 before the fix).
  """
  B, K, V = 8, 1, 4096

  def one(key):
    kt, kd, kr = jax.random.split(key, 3)
    target_tokens = jax.random.randint(kt, (B, K + 1), 0, V)
    draft_tokens = jnp.where(jax.random.bernoulli(kd, 0.5, (B, K)), target_tokens[:, :K],
                             (target_tokens[:, :K] + 1) % V)
    out = av_jax.rejection_sample(kr, draft_probs=jnp.full((B, K, V), 1.0 / V),
                                  draft_tokens=draft_tokens,
                                  target_probs=jax.nn.one_hot(target_tokens, V),
                                  num_verified=jnp.full((B,), K, jnp.int32))
    lead = (draft_tokens[:, 0] == target_tokens[:, 0]).astype(jnp.int32)
    emitted = jnp.take_along_axis(target_tokens, lead[:, None], axis=1)[:, 0]
    got = jnp.take_along_axis(out.tokens, lead[:, None], axis=1)[:, 0]
    return jnp.sum(out.num_accepted != lead) + jnp.sum(got != emitted)

  run = jax.jit(jax.vmap(one))
  keys = jax.random.split(_key(0), 768)
  wrong = sum(int(run(keys[i:i + 256]).sum()) for i in range(0, 768, 256))
  assert wrong == 0, f"{wrong} rows emitted a token the one-hot target gives probability 0"


# ----------------------------------------------------------------------------------------
# Structure.


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_batch(key, B, K, V):
  kq, kx, kp, kz, kn, kr = jax.random.split(key, 6)
  draft_probs = jax.nn.softmax(2 * jax.random.normal(kq, (B, K, V)), -1)
  draft_tokens = jax.random.categorical(kx, jnp.log(draft_probs), axis=-1)
  target_probs = jax.nn.softmax(2 * jax.random.normal(kp, (B, K + 1, V)), -1)
  # Sparse targets (about half of every row zero, token 0 always kept), as after top-k.
  kill = (jax.random.uniform(kz, target_probs.shape) < 0.5).at[..., 0].set(False)
  target_probs = jnp.where(kill, 0.0, target_probs)
  target_probs = target_probs / target_probs.sum(-1, keepdims=True)
  num_verified = jax.random.randint(kn, (B,), 0, K + 1)
  return kr, dict(draft_probs=draft_probs, draft_tokens=draft_tokens,
                  target_probs=target_probs, num_verified=num_verified)


@pytest.mark.parametrize("B,K,V,jit", [(4096, 4, 8, True), (1, 1, 1, True), (1, 1, 1, False),
                                       (1, 3, 2, True)])
def test_output_structure_invariants(B, K, V, jit):
  key, args = _random_batch(_key(B * 100 + K * 10 + V), B, K, V)
  sample = jax.jit(av_jax.rejection_sample) if jit else av_jax.rejection_sample
  out = sample(key, **args)
  chex.assert_shape(out.tokens, (B, K + 1))
  chex.assert_shape([out.num_emitted, out.num_accepted], (B,))
  chex.assert_shape([out.accepted, out.labeled], (B, K))
  assert out.tokens.dtype == jnp.int32 and out.num_emitted.dtype == jnp.int32
  assert out.num_accepted.dtype == jnp.int32
  assert out.accepted.dtype == jnp.bool_ and out.labeled.dtype == jnp.bool_
  out = jax.tree.map(np.asarray, out)
  drafts, nv = np.asarray(args["draft_tokens"]), np.asarray(args["num_verified"])
  a = out.num_accepted
  pos_k, pos_k1 = np.arange(K)[None], np.arange(K + 1)[None]
  assert np.all(a <= nv) and np.all(a >= 0)
  np.testing.assert_array_equal(out.num_emitted, a + 1)
  np.testing.assert_array_equal(out.accepted, pos_k < a[:, None])                 # a prefix
  np.testing.assert_array_equal(
      out.labeled, out.accepted | ((pos_k == a[:, None]) & (a < nv)[:, None]))
  np.testing.assert_array_equal(out.tokens[pos_k1 > a[:, None]], -1)             # padding
  np.testing.assert_array_equal(np.where(pos_k < a[:, None], out.tokens[:, :K], 0),
                                np.where(pos_k < a[:, None], drafts, 0))         # drafts kept
  emitted = out.tokens[np.arange(B), a]
  assert np.all((emitted >= 0) & (emitted < V))
  # The emitted token has positive mass under the law it is drawn from.
  p_row = np.asarray(args["target_probs"])[np.arange(B), a]
  q_row = np.asarray(args["draft_probs"])[np.arange(B), np.minimum(a, K - 1)]
  law = np.where((a < nv)[:, None], np.maximum(p_row - q_row, 0.0), p_row)
  assert np.all(law[np.arange(B), emitted] > 0)
  if V == 1:  # a single token: always accepted, always emitted
    np.testing.assert_array_equal(a, nv)
    np.testing.assert_array_equal(emitted, 0)


@pytest.mark.parametrize("name,bad,pattern", [
    ("draft_probs", np.ones((4, 2)), "draft_probs"),
    ("draft_tokens", np.zeros((4, 3), np.int32), "draft_tokens"),
    ("draft_tokens", np.zeros((4, 2), np.float32), "draft_tokens"),
    ("target_probs", np.ones((4, 2, 5)), "target_probs"),
    ("target_probs", np.ones((4, 3, 4)), "target_probs"),
    ("num_verified", np.zeros((3,), np.int32), "num_verified"),
    ("num_verified", np.zeros((4,), np.float32), "num_verified"),
])
def test_bad_argument_raises_value_error_naming_it(maybe_jit, name, bad, pattern):
  args = dict(draft_probs=np.full((4, 2, 5), 0.2, np.float32),
              draft_tokens=np.zeros((4, 2), np.int32),
              target_probs=np.full((4, 3, 5), 0.2, np.float32),
              num_verified=np.full((4,), 2, np.int32))
  args[name] = bad
  with pytest.raises(ValueError, match=f"^{pattern}"):
    maybe_jit(av_jax.rejection_sample)(_key(0), **args)


def test_ragged_bad_arguments_raise_value_error_naming_them():
  ok = dict(draft_probs=np.full((3, 4), 0.25, np.float32), draft_tokens=np.zeros((3,), np.int32),
            num_draft_tokens=np.array([1, 2], np.int32),
            target_probs=np.full((5, 4), 0.25, np.float32), max_draft_len=2)
  for name, bad in [("draft_tokens", np.zeros((2,), np.int32)),
                    ("num_draft_tokens", np.array([1.0, 2.0], np.float32)),
                    ("target_probs", np.full((4, 4), 0.25, np.float32)),
                    ("max_draft_len", 0)]:
    with pytest.raises(ValueError, match=f"^{name}"):
      av_jax.rejection_sample_ragged(_key(0), **{**ok, name: bad})


# ----------------------------------------------------------------------------------------
# Ragged layout.


def _to_ragged(rng, draft_probs, draft_tokens, target_probs, counts, extra_drafts):
  """Flattens dense [B, K(+1), V] arrays into the documented ragged layout, with
  `extra_drafts` trailing padding rows (filled with junk)."""
  B, K, V = draft_probs.shape
  T = int(counts.sum()) + extra_drafts
  flat_q = rng.dirichlet(np.ones(V), size=T).astype(np.float32)   # junk unless overwritten
  flat_x = rng.integers(0, V, size=T).astype(np.int32)
  flat_p = rng.dirichlet(np.ones(V), size=T + B).astype(np.float32)
  rows = []   # target rows of request b: cu[b] + b + j, j = 0..counts[b]
  cu = 0
  for b in range(B):
    n = counts[b]
    flat_q[cu:cu + n] = draft_probs[b, :n]
    flat_x[cu:cu + n] = draft_tokens[b, :n]
    flat_p[cu + b:cu + b + n + 1] = target_probs[b, :n + 1]
    rows.append(cu + b + np.arange(n + 1))
    cu += n
  return flat_q, flat_x, flat_p, rows


@pytest.mark.parametrize("seed,jit", [(0, True), (1, True), (2, True), (1, False)])
def test_ragged_equals_dense_relaid(seed, jit):
  rng = np.random.default_rng(seed)
  B, K, V = [(6, 3, 5), (9, 4, 3), (1, 2, 4)][seed]
  counts = rng.integers(0, K + 1, size=B)
  if B > 2:                          # include requests with no and with K draft tokens
    counts[0], counts[-1] = 0, K
  if B == 1:
    counts[0] = K
  draft_probs = rng.dirichlet(np.ones(V), size=(B, K)).astype(np.float32)
  draft_tokens = np.array([[rng.choice(V, p=draft_probs[b, i] / draft_probs[b, i].sum())
                            for i in range(K)] for b in range(B)], np.int32)
  # Targets close to the drafts so that long accepted prefixes occur.
  target_probs = np.concatenate([draft_probs, rng.dirichlet(np.ones(V), (B, 1))], axis=1)
  target_probs = (0.7 * target_probs + 0.3 * rng.dirichlet(np.ones(V), (B, K + 1)))
  target_probs = target_probs.astype(np.float32)
  flat_q, flat_x, flat_p, rows = _to_ragged(rng, draft_probs, draft_tokens, target_probs,
                                            counts, extra_drafts=2)
  ragged, dense = av_jax.rejection_sample_ragged, av_jax.rejection_sample
  if jit:
    ragged = jax.jit(ragged, static_argnames="max_draft_len")
    dense = jax.jit(dense)
  saw_accept = False
  for k in range(10 if jit else 1):
    key = _key(100 * seed + k)
    result = ragged(key, draft_probs=flat_q, draft_tokens=flat_x,
                    num_draft_tokens=counts.astype(np.int32), target_probs=flat_p,
                    max_draft_len=K)
    out = np.asarray(result.tokens)
    ref = dense(key, draft_probs=draft_probs, draft_tokens=draft_tokens,
                target_probs=target_probs, num_verified=counts.astype(np.int32))
    expected = np.full(flat_p.shape[0], -1, np.int32)
    T = flat_x.shape[0]
    want_accepted, want_labeled = np.zeros(T, bool), np.zeros(T, bool)
    cu = np.cumsum(counts) - counts
    for b in range(B):
      expected[rows[b]] = np.asarray(ref.tokens)[b, :counts[b] + 1]
      want_accepted[cu[b]:cu[b] + counts[b]] = np.asarray(ref.accepted)[b, :counts[b]]
      want_labeled[cu[b]:cu[b] + counts[b]] = np.asarray(ref.labeled)[b, :counts[b]]
    chex.assert_shape(out, (flat_p.shape[0],))
    chex.assert_shape([result.accepted, result.labeled], (T,))
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(result.accepted, want_accepted)  # flat draft order
    np.testing.assert_array_equal(result.labeled, want_labeled)
    np.testing.assert_array_equal(result.num_accepted, ref.num_accepted)
    np.testing.assert_array_equal(result.num_emitted, ref.num_emitted)
    saw_accept |= bool(np.any(np.asarray(ref.num_accepted) > 0))
  assert saw_accept


def test_ragged_with_no_draft_tokens_at_all(maybe_jit):
  """T = 0: every request only samples its bonus row."""
  V, B = 4, 3
  target = np.eye(V, dtype=np.float32)[[2, 0, 3]]
  out = maybe_jit(av_jax.rejection_sample_ragged, static_argnames="max_draft_len")(
      _key(0), draft_probs=np.zeros((0, V), np.float32),
      draft_tokens=np.zeros((0,), np.int32), num_draft_tokens=np.zeros((B,), np.int32),
      target_probs=target, max_draft_len=2)
  np.testing.assert_array_equal(out.tokens, [2, 0, 3])
  np.testing.assert_array_equal(out.num_emitted, [1, 1, 1])
  chex.assert_shape([out.accepted, out.labeled], (0,))


def test_ragged_counts_that_do_not_fit_are_refused_eagerly_and_cut_under_jit():
  """sum(num_draft_tokens) > T: a ValueError with concrete values; under jit the counts
  are cut in request order to fit T (documented), never read out of bounds."""
  V = 4
  x = np.array([1, 2, 3], np.int32)
  q = np.full((3, V), 0.25, np.float32)
  p = np.eye(V, dtype=np.float32)[[1, 2, 0, 3, 1]]      # T + B = 5 rows
  args = dict(draft_probs=q, draft_tokens=x, target_probs=p, max_draft_len=2)
  with pytest.raises(ValueError, match="^num_draft_tokens: expected a sum of at most T=3"):
    av_jax.rejection_sample_ragged(_key(0), num_draft_tokens=np.array([2, 2], np.int32),
                                   **args)
  with pytest.raises(ValueError, match=r"^num_draft_tokens: expected values in \[0"):
    av_jax.rejection_sample_ragged(_key(0), num_draft_tokens=np.array([3, 0], np.int32),
                                   **args)
  with pytest.raises(ValueError, match=r"^num_draft_tokens: expected values in \[0"):
    av_jax.rejection_sample_ragged(_key(0), num_draft_tokens=np.array([-1, 2], np.int32),
                                   **args)
  run = jax.jit(av_jax.rejection_sample_ragged, static_argnames="max_draft_len")
  out = run(_key(0), num_draft_tokens=np.array([2, 2], np.int32), **args)
  # Cut to [2, 1]: request 0 rows 0-2 (drafts 1, 2 accepted, bonus from row 2 = 0);
  # request 1 rows 3-4 (draft 3 accepted by one-hot row 3, bonus from row 4 = 1).
  np.testing.assert_array_equal(out.tokens, [1, 2, 0, 3, 1])
  np.testing.assert_array_equal(out.num_accepted, [2, 1])
  np.testing.assert_array_equal(out.accepted, [True, True, True])


def _issue_invalid_id_case():
  """q uniform; p at position 1 on token 1 (accepted surely), at position 2 all on V - 1:
  read as V - 1, the id -1 would be accepted with probability 1."""
  V = 4
  q = np.full((1, 2, V), 1.0 / V, np.float32)
  p = np.stack([np.eye(V)[1], np.eye(V)[V - 1], np.full(V, 1.0 / V)])[None].astype(np.float32)
  return dict(draft_probs=q, draft_tokens=np.array([[1, -1]], np.int32), target_probs=p,
              num_verified=np.array([2], np.int32))


def test_out_of_range_draft_id_is_never_accepted_nor_labelled():
  args = _issue_invalid_id_case()
  out = jax.jit(av_jax.rejection_sample)(_key(0), **args)
  np.testing.assert_array_equal(out.tokens, [[1, 3, -1]])   # emitted from p (all on 3)
  np.testing.assert_array_equal(out.num_accepted, [1])
  np.testing.assert_array_equal(out.accepted, [[True, False]])
  np.testing.assert_array_equal(out.labeled, [[True, False]])  # not a draw from q
  # The same id as unverified padding is safe, and ids >= V are treated like -1.
  for tokens, nv in (([[1, -1]], 1), ([[1, 4]], 2), ([[-7, 4]], 0)):
    out = jax.jit(av_jax.rejection_sample)(
        _key(1), **{**args, "draft_tokens": np.array(tokens, np.int32),
                    "num_verified": np.array([nv], np.int32)})
    assert int(out.num_accepted[0]) == min(nv, 1)
    assert not bool(out.labeled[0, 1])
  # Eagerly, a bad id in a verified position raises, naming the argument; padding doesn't.
  with pytest.raises(ValueError, match=r"^draft_tokens: expected ids in \[0, V=4\)"):
    av_jax.rejection_sample(_key(0), **args)
  out = av_jax.rejection_sample(_key(0), **{**args, "num_verified": np.array([1], np.int32)})
  np.testing.assert_array_equal(out.tokens, [[1, 3, -1]])


def test_out_of_range_draft_id_emits_from_the_target_law():
  """Where a bad id ends verification, the token emitted there follows p exactly (the
  bad id carries no information): 2**16 draws against a non-degenerate p."""
  V, n = 5, 2**16
  rng = np.random.default_rng(3)
  q = rng.dirichlet(np.ones(V), size=(1, 1)).astype(np.float32)
  p = rng.dirichlet(np.ones(V), size=(1, 2)).astype(np.float32)

  def one(key, token):
    return av_jax.rejection_sample(key, draft_probs=q, draft_tokens=token[None, None],
                                   target_probs=p, num_verified=jnp.array([1])).tokens[0, 0]

  keys = jax.random.split(_key(4), n)
  run = jax.jit(jax.vmap(one, in_axes=(0, None)))
  assert_law(run(keys, jnp.int32(-1)), p[0, 0], "bad id: emitted token")
  # Negative control: a valid id that q proposes is accepted at rate min(1, p/q) and
  # the emitted law is then not p in general; the test above must tell them apart.
  x = int(np.argmax(q[0, 0] / p[0, 0]))
  with pytest.raises(AssertionError):
    assert_law(run(keys, jnp.int32(x)), p[0, 0], "valid id (control)")


def test_ragged_out_of_range_ids_in_padding_are_safe():
  V = 4
  x = np.array([1, -1, -1], np.int32)                 # one draft, then padding ids
  out = jax.jit(av_jax.rejection_sample_ragged, static_argnames="max_draft_len")(
      _key(0), draft_probs=np.full((3, V), 0.25, np.float32), draft_tokens=x,
      num_draft_tokens=np.array([1, 0], np.int32),
      target_probs=np.eye(V, dtype=np.float32)[[1, 2, 3, 0, 0]], max_draft_len=2)
  np.testing.assert_array_equal(out.tokens, [1, 2, 3, -1, -1])
  np.testing.assert_array_equal(out.accepted, [True, False, False])
