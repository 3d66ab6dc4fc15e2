"""Drafting stops of autoregressive drafters in the engine: exactness and wiring.

`av` ends each request's drafting at the depth its plan chose (`av_jax.policy`);
`confstop:T` ends the batch's drafting loop by vLLM's confidence rule.

* greedy identity with target-only decoding (eagle, draft_lm; `av`, `confstop:0.5`);
* a drafter whose depth-2 logits are NaN in one slot still verifies position 1 exactly as
  a clean run does;
* the drafted features are the ones the stop computed;
* idle slots draft nothing and change nothing.

The emitted law of `av` in the sensitive regime is tested in tests/test_engine_sensitive.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_jax import engine as E
from av_jax.models.drafters import Drafter
from av_jax.sampling import Sampling
from tests import _engine_fixtures as fx

AR_KINDS = ("eagle", "draft_lm")


# ------------------------------------------------------------------ greedy identity


@pytest.mark.parametrize("mode", ["av", "confstop:0.5"])
def test_greedy_identity_with_target_only(mode):
  prompts, max_new = [[1, 2, 3], [4], [5, 6, 7, 8, 9]], [9, 11, 7]
  want = [fx.greedy_reference(False, p, n) for p, n in zip(prompts, max_new)]
  passes = {}
  for kind in AR_KINDS:
    cfg, drafter, params = fx.pair(kind)
    engine = E.make_engine(E.EngineConfig(num_slots=3, max_draft=3, max_len=40, mode=mode,
                                          sampling=Sampling(temperature=0.0),
                                          programs=E.Programs(num_buckets=1, steps_per_chunk=4)),
                           cfg, drafter)
    assert engine.decider.stop == {"av": "policy"}.get(mode, "confidence")
    result = E.generate(engine, params, prompts, max_new_tokens=max_new, key=fx.key(0),
                        keep_infos=True)
    assert [c.tokens for c in result.completions] == want, kind
    p = np.concatenate([np.asarray(i.draft_passes) for i in result.infos])
    d = np.concatenate([np.asarray(i.drafted_depth) for i in result.infos])
    on = np.concatenate([np.asarray(i.slot_active) for i in result.infos])
    if mode == "av":  # the priced plan: any depth 0..K per request, no more than planned
      assert (p <= 3).all() and (p >= 1).any()
    else:
      assert ((p >= 1) & (p <= 3))[on.any(axis=1)].all()
      assert (d[on] >= 1).all()  # every active slot drafts depth 1
    # No slot drafts deeper than the passes run; idle slots draft nothing.
    assert (d <= p[:, None]).all() and (d[~on] == 0).all()
    passes[kind] = p
  # Random tiny drafters are poor: the stop must have ended drafting early somewhere.
  assert all((p < 3).any() for p in passes.values()), passes


# ------------------------------------------------------- finite prefix verified


@functools.lru_cache(maxsize=None)
def _nan_at_depth_2() -> Drafter:
  """The copy-target draft LM whose depth-2 logits are NaN in slots where `poison`."""
  inner = fx.pair("draft_lm", copy_target=True)[1]

  def init_state(params, target_params, **kwargs):
    return inner.init_state(params[0], target_params, **kwargs)

  def draft(params, target_params, state, key, **kwargs):
    out = inner.draft(params[0], target_params, state, key, **kwargs)
    bad = params[1][:, None] & (jnp.arange(out.logits.shape[1]) == 1)[None]   # [B, K]
    hit = lambda x: jnp.where(bad[..., None], jnp.nan, x)
    return out._replace(logits=hit(out.logits), log_probs=hit(out.log_probs))

  return Drafter(inner.kind, inner.drafting, init_state, draft, inner.commit)


def test_nonfinite_depth_2_still_verifies_position_1():
  cfg = fx.pair("draft_lm", copy_target=True)[0]
  target = fx.pair("draft_lm", copy_target=True)[2].target
  B, K = 2, 3
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=32, mode="fixed",
                                        sampling=Sampling(temperature=1.0),
                                        programs=E.Programs(num_buckets=1)),
                         cfg, _nan_at_depth_2())
  # Fixed verification: every drafted position in both runs.
  cost = av_jax.CostModel(draft_ms=jnp.ones((B + 1,), jnp.float32),
                          verify_ms=jnp.linspace(2.0, 1.0, B * (K + 1) + 1,
                                                 dtype=jnp.float32))
  infos, tokens = {}, {}
  for poisoned in (False, True):
    params = E.Params(target=target, drafter=(target, jnp.asarray([poisoned, False])))
    state = E.init_state(engine, params, fx.key(3), cost)
    for slot, prompt in enumerate(([2, 7, 1], [5, 5])):
      padded = jnp.zeros((8,), jnp.int32).at[:len(prompt)].set(jnp.asarray(prompt))
      state = E.prefill(engine, params, state, prompt=padded, prompt_len=jnp.int32(len(prompt)),
                        slot=jnp.int32(slot), max_new=jnp.int32(10))
    new, info = jax.jit(E.step, static_argnums=0)(engine, params, state)
    infos[poisoned], tokens[poisoned] = jax.device_get(info), np.asarray(new.tokens)
  clean, bad = infos[False], infos[True]
  assert clean.num_verified.tolist() == [K, K]          # a copy of the target: all verified
  assert bad.num_verified.tolist() == [1, K]            # the finite prefix of slot 0
  # Position 1 of slot 0: the same draft, verified and accepted as in the clean run, and
  # the same token emitted; the clean slot is untouched by the other's fault.
  assert bad.accepted[0, 0] == clean.accepted[0, 0] == True
  assert bad.labeled[0].tolist() == [True, False, False]
  np.testing.assert_array_equal(tokens[True][0, :5], tokens[False][0, :5])
  np.testing.assert_array_equal(tokens[True][1], tokens[False][1])
  np.testing.assert_array_equal(bad.accepted[1], clean.accepted[1])


# ------------------------------------------- features kept from the drafting stop


@pytest.mark.parametrize("kind", AR_KINDS)
def test_drafts_carry_the_features_the_stop_computed(kind):
  """With a stop, `_draft` takes each drafted depth's feature from the stop's own
  per-depth computation (`DraftOutput.keep_aux`) instead of recomputing `logit_qmax` over
  `[B, K, V]`: the features must equal that recomputation, the uniform row's feature at
  the positions not drafted, and the early stop must have left some undrafted."""
  from av_jax import features as F
  from av_jax.engine import core
  cfg, drafter, params = fx.pair(kind)
  B, K = 3, 4
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=40, mode="av",
                                        sampling=Sampling(temperature=1.0),
                                        programs=E.Programs(num_buckets=1)), cfg, drafter)
  # Dear passes and verification: the plan ends drafting early (positions not drafted).
  cost = av_jax.make_cost_model(np.full(B + 1, 5.0), 1.0 + 0.5 * np.arange(B * (K + 1) + 1))
  state = E.init_state(engine, params, fx.key(5), cost)
  for slot, prompt in enumerate(([1, 2, 3], [4, 9], [5, 6, 7, 8])):
    padded = jnp.zeros((8,), jnp.int32).at[:len(prompt)].set(jnp.asarray(prompt))
    state = E.prefill(engine, params, state, prompt=padded, prompt_len=jnp.int32(len(prompt)),
                      slot=jnp.int32(slot), max_new=jnp.int32(20))
  V = cfg.target.vocab_size

  @jax.jit
  def both(state, key):
    decision = core._prepared(engine, state)
    drafts = core._draft(engine, params, state.drafter, key, decision, active=state.active)
    keep_fn, aux0 = core._keep_fn(engine, state.active, decision)
    out = engine.drafter.draft(params.drafter, params.target, state.drafter, key, K=K,
                               temperature=1.0, top_p=1.0, keep_fn=keep_fn, keep_init=aux0)
    return drafts, out

  step = jax.jit(E.step, static_argnums=0)
  checked, seen = np.zeros((B, K), bool), np.zeros((B, K), bool)
  for seed in range(4):
    drafts, out = both(state, jax.random.PRNGKey(seed))
    assert out.keep_aux is not None
    drafted = np.arange(K)[None] < np.asarray(out.depth)[:, None]
    log_probs = jnp.where(jnp.asarray(drafted)[..., None], out.log_probs, -jnp.log(V * 1.0))
    want = np.asarray(F.logit_qmax(log_probs))
    np.testing.assert_allclose(np.asarray(drafts.features), want, rtol=1e-5, atol=1e-5)
    checked |= ~drafted
    seen |= drafted
    state, _ = step(engine, params, state)
  # Both branches are covered: drafted positions and positions the plan left undrafted.
  assert checked.any() and seen.any()


# ------------------------------------------------------------- idle slots inert


@pytest.mark.parametrize("mode", ["av", "confstop:0.5"])
def test_idle_slots_draft_nothing_and_change_nothing(mode):
  cfg, drafter, params = fx.pair("eagle")
  B, K = 3, 3
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=32, mode=mode,
                                        sampling=Sampling(temperature=1.0),
                                        programs=E.Programs(num_buckets=1)), cfg, drafter)
  state = E.init_state(engine, params, fx.key(4))
  padded = jnp.zeros((8,), jnp.int32).at[:3].set(jnp.asarray([1, 2, 3]))
  state = E.prefill(engine, params, state, prompt=padded, prompt_len=jnp.int32(3),
                    slot=jnp.int32(1), max_new=jnp.int32(12))
  run = jax.jit(E.run_chunk, static_argnums=(0, 3))
  new, info = run(engine, params, state, 4)
  info = jax.device_get(info)
  idle = np.array([True, False, True])
  assert (info.drafted_depth[:, idle] == 0).all() and (info.num_verified[:, idle] == 0).all()
  if mode != "av":  # the confidence stop drafts depth 1 for every active slot
    assert (info.drafted_depth[:, 1] >= 1).all()
  for name in ("tokens", "length", "active"):
    np.testing.assert_array_equal(np.asarray(getattr(new, name))[idle],
                                  np.asarray(getattr(state, name))[idle])
  for old, upd in zip(jax.tree.leaves(state.drafter._replace(cache=None)),
                      jax.tree.leaves(new.drafter._replace(cache=None))):
    np.testing.assert_array_equal(np.asarray(old)[idle], np.asarray(upd)[idle])
  # An all-idle batch drafts no pass at all.
  empty = E.init_state(engine, params, fx.key(4))
  _, info0 = run(engine, params, empty, 4)
  assert (np.asarray(info0.draft_passes) == 0).all()


def test_the_drafting_stop_sees_each_rows_own_drafted_depths():
  """A row that stopped rides along in later passes, but the stop is told it drafted only
  up to where it stopped: after depth 2, row 0 (stopped at 1) has one drafted position,
  row 1 two."""
  from types import SimpleNamespace
  from av_jax.engine import drafting
  seen = []

  class Recorder:
    def score(self, decision, features):
      return jnp.full(features.shape, 0.5)

    def keep_drafting(self, decision, probs, drafted, depth, **kwargs):
      seen.append(np.asarray(drafted))
      return jnp.asarray([False, True])  # row 0 stops after every depth, row 1 never

  B, K, V = 2, 3, 5
  engine = SimpleNamespace(config=E.EngineConfig(num_slots=B, max_draft=K, max_len=16),
                           decider=Recorder(), target=SimpleNamespace(vocab_size=V))
  keep_fn, aux = drafting._keep_fn(engine, jnp.ones((B,), bool), None)
  logits = jnp.zeros((B, V))
  for depth in (1, 2):
    keep, aux = keep_fn(jnp.int32(depth), logits, None, aux)
  np.testing.assert_array_equal(seen[0], [[True, False, False], [True, False, False]])
  np.testing.assert_array_equal(seen[1], [[True, False, False], [True, True, False]])
  np.testing.assert_array_equal(keep, [False, True])
