"""Tests of the target transformer, the four drafters, training and shipped checkpoints."""

import dataclasses
import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from av_jax import data
from av_jax import models
from av_jax.models import checkpoint, drafters, evaluate, pipeline, transformer

CFG = models.load_config("tiny")
TCFG = CFG.target
V = TCFG.vocab_size


def _params(kind=None, seed=0):
  key = jax.random.key(seed)
  if kind is None:
    return transformer.init_params(TCFG, key)
  return drafters.init_drafter_params(kind, CFG, key)


TARGET = _params()


def _tokens(shape, seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 0, V, jnp.int32)


PAD = 48  # uncached references run on sequences right-padded to this length (one compile)


@functools.partial(jax.jit, static_argnames="cfg")
def _uncached(params, tokens, *, cfg):
  """Causal forward without a cache; right padding does not change earlier positions."""
  return transformer.forward(params, tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]),
                                                              tokens.shape), cfg=cfg)


def _pad(seq):
  return jnp.asarray(list(seq) + [0] * (PAD - len(seq)), jnp.int32)[None]


# ----------------------------------------------------------------------------- target


class TargetTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_shapes(self):
    b, s, m, t = 3, 5, 16, 7
    fwd = self.variant(lambda p, x, pos, c: transformer.forward(p, x, pos, c, cfg=TCFG))
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    out = fwd(TARGET, _tokens((b, s)), pos, transformer.init_cache(TCFG, b, m))
    chex.assert_shape(out.logits, (b, s, V))
    chex.assert_shape(out.hidden, (b, s, TCFG.d_model))
    chex.assert_shape(out.cache.k, (TCFG.num_layers, b, TCFG.num_heads, m, TCFG.head_dim))
    chex.assert_tree_all_finite(out)
    packed = self.variant(lambda p, x, sl, pos, va, c: transformer.forward_packed(
        p, x, slot=sl, positions=pos, valid=va, cache=c, cfg=TCFG))
    out = packed(TARGET, _tokens((t,)), jnp.zeros(t, jnp.int32), jnp.arange(t),
                 jnp.ones(t, bool), transformer.init_cache(TCFG, b, m))
    chex.assert_shape(out.logits, (t, V))
    chex.assert_shape(out.hidden, (t, TCFG.d_model))

  @chex.variants(with_jit=True, without_jit=True)
  def test_cached_equals_uncached(self):
    b, s, m = 2, 12, 20
    toks = _tokens((b, s))
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    ref = _uncached(TARGET, toks, cfg=TCFG)
    fwd = self.variant(lambda p, x, q, c: transformer.forward(p, x, q, c, cfg=TCFG))
    out = fwd(TARGET, toks[:, :5], pos[:, :5], transformer.init_cache(TCFG, b, m))
    logits, hidden, cache = [out.logits], [out.hidden], out.cache
    for i in range(5, s):  # then one token at a time
      out = fwd(TARGET, toks[:, i:i + 1], pos[:, i:i + 1], cache)
      logits.append(out.logits)
      hidden.append(out.hidden)
      cache = out.cache
    chex.assert_trees_all_close(jnp.concatenate(logits, 1), ref.logits, atol=1e-4)
    chex.assert_trees_all_close(jnp.concatenate(hidden, 1), ref.hidden, atol=1e-4)

  def test_stale_cache_entries_are_not_read(self):
    # Writing junk above the current position (a rejected draft) changes nothing.
    b, m = 2, 16
    fwd = jax.jit(functools.partial(transformer.forward, cfg=TCFG))
    toks = _tokens((b, 6))
    pos = jnp.broadcast_to(jnp.arange(6), (b, 6))
    cache = fwd(TARGET, toks[:, :4], pos[:, :4], transformer.init_cache(TCFG, b, m)).cache
    junk = fwd(TARGET, _tokens((b, 4), 9), 4 + pos[:, :4], cache).cache
    a = fwd(TARGET, toks[:, 4:], pos[:, 4:], cache)
    c = fwd(TARGET, toks[:, 4:], pos[:, 4:], junk)
    chex.assert_trees_all_close(a.logits, c.logits, atol=1e-5)

  @chex.variants(with_jit=True)
  def test_packed_equals_dense(self):
    b, m = 3, 24
    prefix = np.array([4, 7, 2])  # per-slot committed lengths
    new = np.array([3, 1, 5])     # new tokens per slot
    full = np.asarray(_tokens((b, 12), 5))
    # Dense reference: the uncached forward of each slot's whole sequence.
    dense_logits = _uncached(TARGET, jnp.asarray(full), cfg=TCFG).logits
    # Prefill every slot's prefix (ragged: positions past the prefix are invalid).
    pos = jnp.broadcast_to(jnp.arange(8), (b, 8))
    cache = jax.jit(functools.partial(transformer.forward, cfg=TCFG))(
        TARGET, jnp.asarray(full[:, :8]), pos, transformer.init_cache(TCFG, b, m),
        valid=pos < prefix[:, None]).cache
    # Packed: all new tokens of all slots, shuffled, plus padding.
    entries = [(i, prefix[i] + j) for i in range(b) for j in range(new[i])]
    order = np.random.default_rng(0).permutation(len(entries))
    entries = [entries[k] for k in order] + [(0, 0), (2, 1)]  # two padding entries
    t = len(entries)
    slot = np.array([e[0] for e in entries], np.int32)
    position = np.array([e[1] for e in entries], np.int32)
    valid = np.arange(t) < t - 2
    tokens = np.where(valid, full[slot, position], 0)
    packed = self.variant(lambda p, x, sl, q, va, c: transformer.forward_packed(
        p, x, slot=sl, positions=q, valid=va, cache=c, cfg=TCFG))
    out = packed(TARGET, tokens, slot, position, valid, cache)
    for k in range(t - 2):
      i, p = entries[k]
      chex.assert_trees_all_close(out.logits[k], dense_logits[i, p], atol=1e-4)
    # Padding wrote nothing: slot 0 position 0 still holds the prefix's K.
    chex.assert_trees_all_close(out.cache.k[:, 0, :, 0], cache.k[:, 0, :, 0])


# ---------------------------------------------------------------------------- drafters


def _drafter_setup(kind, b=3, plen=6, k=4, seed=0):
  prompt = _tokens((b, plen), seed + 10)
  hidden = _uncached(TARGET, prompt, cfg=TCFG).hidden
  d = models.make_drafter(kind, CFG)
  params = _params(kind, seed + 1)
  init = jax.jit(d.init_state, static_argnames=("K", "max_len"))
  state = init(params, TARGET, prompt=prompt, prompt_hidden=hidden,
               next_token=_tokens((b,), seed + 11), K=k, max_len=32)
  return d, params, state


@pytest.mark.parametrize("kind", models.KINDS)
def test_drafter_output_shapes(kind):
  b, k = 3, 4
  d, params, state = _drafter_setup(kind, b=b, k=k)
  assert d.kind == kind and d.drafting == models.DRAFTING[kind]
  draft = jax.jit(d.draft, static_argnames="K")
  out = draft(params, TARGET, state, jax.random.key(0), K=k, temperature=1.0, top_p=0.95)
  chex.assert_shape(out.logits, (b, k, V))
  chex.assert_shape(out.tokens, (b, k))
  assert out.tokens.dtype == jnp.int32
  if kind == "block_head":
    chex.assert_shape(out.conf_logits, (b, k))
  else:
    assert out.conf_logits is None
  chex.assert_tree_all_finite(out.logits)
  chex.assert_trees_all_equal_structs(out.state, state)
  new = d.commit(out.state, emitted_tokens=jnp.full((b, k + 1), -1).at[:, :2].set(1),
                 num_emitted=jnp.full((b,), 2),
                 target_hidden=jnp.zeros((b, k + 1, TCFG.d_model)))
  np.testing.assert_array_equal(new.position, state.position + 1)
  np.testing.assert_array_equal(new.num_pending, 2)


def test_modes():
  assert models.DRAFTING == {"draft_lm": "autoregressive", "eagle": "autoregressive",
                          "block": "parallel", "block_head": "parallel"}


@pytest.mark.parametrize("kind", ["block", "block_head"])
def test_block_distributions_do_not_depend_on_draws(kind):
  d, params, state = _drafter_setup(kind, k=8)
  draft = jax.jit(d.draft, static_argnames="K")
  outs = [draft(params, TARGET, state, jax.random.key(s), K=8, temperature=1.0, top_p=1.0)
          for s in range(4)]
  assert any(not np.array_equal(outs[0].tokens, o.tokens) for o in outs[1:])
  for o in outs[1:]:
    chex.assert_trees_all_equal(o.logits, outs[0].logits)
    chex.assert_trees_all_equal(o.conf_logits, outs[0].conf_logits)
  # A shorter K gives the same first positions.
  short = draft(params, TARGET, state, jax.random.key(0), K=3, temperature=1.0, top_p=1.0)
  chex.assert_trees_all_close(short.logits, outs[0].logits[:, :3])


def test_autoregressive_draft_depends_on_draws():
  d, params, state = _drafter_setup("draft_lm", k=4)
  draft = jax.jit(d.draft, static_argnames="K")
  a = draft(params, TARGET, state, jax.random.key(0), K=4, temperature=1.0, top_p=1.0)
  b = draft(params, TARGET, state, jax.random.key(1), K=4, temperature=1.0, top_p=1.0)
  assert not np.array_equal(a.tokens, b.tokens)
  chex.assert_trees_all_close(a.logits[:, 0], b.logits[:, 0])  # position 1 is fixed


def _committed(prompt, rec, step):
  """Committed sequences (list per slot) at the start of `step` of a rollout."""
  seqs = [list(map(int, p)) for p in prompt]
  for b in range(len(seqs)):
    seqs[b].append(int(rec.ctx_token[0, b]))
    for s in range(step):
      seqs[b] += [int(x) for x in rec.emitted[s, b] if x >= 0]
  return seqs


@jax.jit
def _eagle_uncached(params, feats, tokens):
  head = drafters._eagle_module(CFG, "causal")  # pylint: disable=protected-access
  f, logits, _ = head.apply({"params": params}, transformer.embedding(TARGET), feats, tokens,
                            jnp.broadcast_to(jnp.arange(1, PAD + 1), tokens.shape))
  return f, logits


def test_forward_pick_computes_outputs_for_the_picked_tokens_only():
  """`transformer.forward(..., pick=idx)`: the same cache as the full pass and row b's
  logits and hidden at token idx[b]; a cacheless pick or a wrong-shaped one is refused."""
  cfg = CFG.draft_lm
  params = transformer.init_params(cfg, jax.random.PRNGKey(8))
  B, S, M = 3, 4, 16
  cache = transformer.init_cache(cfg, B, M)
  cache = cache._replace(k=jax.random.normal(jax.random.PRNGKey(9), cache.k.shape),
                         v=jax.random.normal(jax.random.PRNGKey(10), cache.v.shape))
  tokens = jax.random.randint(jax.random.PRNGKey(11), (B, S), 0, cfg.vocab_size)
  positions = jnp.asarray([[2, 3, 4, 5], [0, 1, 2, 3], [7, 8, 9, 10]])
  valid = jnp.asarray([[True] * 4, [True, True, True, False], [True] * 4])
  full = transformer.forward(params, tokens, positions, cache, cfg=cfg, valid=valid)
  idx = jnp.asarray([3, 2, 0])
  out = transformer.forward(params, tokens, positions, cache, cfg=cfg, valid=valid, pick=idx)
  rows = np.arange(B), np.asarray(idx)
  assert out.logits.shape == (B, cfg.vocab_size) and out.hidden.shape == (B, cfg.d_model)
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(full.logits)[rows],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(full.hidden)[rows],
                             rtol=1e-5, atol=1e-5)
  for a, b in zip(out.cache, full.cache):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(np.asarray(full.logits)[:, 0], np.asarray(full.logits)[:, 2],
                         atol=1e-3)
  with pytest.raises(ValueError, match="pick"):
    transformer.forward(params, tokens, positions, cfg=cfg, pick=idx)
  with pytest.raises(ValueError, match="pick"):
    transformer.forward(params, tokens, positions, cache, cfg=cfg, pick=idx[:2])


def test_eagle_head_pick_runs_on_past_the_cache_for_the_picked_columns_only():
  """`EagleHead(..., pick=idx)` (the cached "dense" mode the drafter runs) writes every
  column's keys and values and returns row b's features and logits at column idx[b]
  (`[B, D]`, `[B, V]`): the same as the full pass's picked, the same cache, and
  different columns give different rows (the negative control: a pick that ignored
  `idx` would pass only at one column)."""
  from av_jax.models.layers import LayerKV
  params = models.init_drafter_params("eagle", CFG, jax.random.PRNGKey(3))
  head = drafters._eagle_module(CFG, "dense")  # pylint: disable=protected-access
  B, P, D, M = 3, 5, CFG.target.d_model, 16
  e = CFG.eagle
  cache = LayerKV(jax.random.normal(jax.random.PRNGKey(6), (B, e.num_heads, M, e.head_dim)),
                  jax.random.normal(jax.random.PRNGKey(7), (B, e.num_heads, M, e.head_dim)))
  feats = jax.random.normal(jax.random.PRNGKey(4), (B, P, D))
  tokens = jax.random.randint(jax.random.PRNGKey(5), (B, P), 0, CFG.target.vocab_size)
  positions = jnp.asarray([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4], [8, 9, 10, 11, 12]])
  write = positions.at[1, 4].set(M)  # a padding column writes nothing
  emb = transformer.embedding(TARGET)
  apply = lambda pick: head.apply({"params": params}, emb, feats, tokens, positions, cache,
                                  write, pick)
  f, full, c = apply(None)
  for idx in ([0, 2, 4], [4, 3, 1]):
    idx = jnp.asarray(idx)
    f2, picked, c2 = apply(idx)
    assert f2.shape == (B, D) and picked.shape == (B, CFG.target.vocab_size)
    rows = np.arange(B), np.asarray(idx)
    np.testing.assert_allclose(np.asarray(f2), np.asarray(f)[rows], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(picked), np.asarray(full)[rows], rtol=1e-5,
                               atol=1e-5)
    for a, b in zip(c, c2):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(np.asarray(full)[:, 0], np.asarray(full)[:, 4], atol=1e-3)


def _eagle_reference(params, seq, drafted):
  """Uncached EAGLE logits for the K drafts after committed `seq`, recomputed from scratch.

  Pairs (h_{t-1}, x_t), t = 1..n, with h the uncached target's hidden states, then each
  draft feeds back the head's own feature; every depth reruns the whole causal sequence.
  """
  n = len(seq) - 1
  h = _uncached(TARGET, _pad(seq), cfg=TCFG).hidden[0, :n]
  feats_in, toks, out = h, list(seq[1:]), []
  for j in range(len(drafted)):
    m = len(toks)
    padded = jnp.concatenate([feats_in, jnp.zeros((PAD - m, h.shape[-1]))])[None]
    f, lg = _eagle_uncached(params, padded, _pad(toks))
    out.append(lg[0, m - 1])
    feats_in = jnp.concatenate([feats_in, f[0, m - 1:m]], 0)
    toks.append(int(drafted[j]))
  return jnp.stack(out)


# Every rollout in this file uses these shapes, so each drafter kind compiles once.
ROLL_B, ROLL_P, ROLL_K, ROLL_STEPS = 8, 16, 4, 3


def _rollout(kind, params, prompt, key, temperature, top_p=1.0):
  return evaluate.rollout(TARGET if params is None else params[0],
                          _params(kind, 5) if params is None else params[1], prompt, key,
                          cfg=CFG, drafter=models.make_drafter(kind, CFG), K=ROLL_K,
                          steps=ROLL_STEPS, temperature=temperature, top_p=top_p)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle"])
def test_autoregressive_cached_equals_uncached_across_steps(kind):
  """Draft logits of a multi-step rollout (with commits) equal from-scratch recomputation."""
  params = _params(kind, 5)
  prompt = _tokens((ROLL_B, ROLL_P), 21)
  rec = _rollout(kind, None, prompt, jax.random.key(4), 1.0)
  assert int(np.asarray(rec.num_emitted).max()) > 1  # multi-token commits happen
  for s in range(ROLL_STEPS):
    seqs = _committed(np.asarray(prompt), rec, s)
    for i in range(2):
      drafted = [int(x) for x in rec.draft_tokens[s, i]]
      if kind == "draft_lm":
        n = len(seqs[i])
        ref = _uncached(params, _pad(seqs[i] + drafted[:-1]),
                        cfg=CFG.draft_lm).logits[0, n - 1:n - 1 + ROLL_K]
      else:
        ref = _eagle_reference(params, seqs[i], drafted)
      chex.assert_trees_all_close(rec.draft_logits[s, i], ref, atol=2e-4)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle", "block"])  # block_head drafts as block
def test_greedy_speculative_equals_greedy_target(kind):
  prompt = _tokens((ROLL_B, ROLL_P), 31)
  rec = _rollout(kind, None, prompt, jax.random.key(0), 0.0)
  spec = _committed(np.asarray(prompt), rec, ROLL_STEPS)
  n = min(len(s) for s in spec)
  seq = np.zeros((ROLL_B, PAD), np.int32)
  seq[:, :ROLL_P] = np.asarray(prompt)
  for t in range(ROLL_P, n):  # uncached greedy decoding of the target
    logits = _uncached(TARGET, jnp.asarray(seq), cfg=TCFG).logits
    seq[:, t] = np.argmax(logits[:, t - 1], -1)
  np.testing.assert_array_equal(np.array([s[:n] for s in spec]), seq[:, :n])


def test_sampling():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  probs = models.sampling_probs(logits, temperature=1.0, top_p=0.7)
  chex.assert_trees_all_close(probs, jnp.array([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
  greedy = models.sampling_probs(logits, temperature=0.0, top_p=1.0)
  chex.assert_trees_all_equal(greedy, jnp.array([[1.0, 0.0, 0.0, 0.0]]))
  draws = models.sample_tokens(jax.random.key(0), jnp.broadcast_to(logits, (4000, 4)),
                               temperature=1.0, top_p=0.7)
  freq = np.bincount(np.asarray(draws), minlength=4) / 4000
  assert abs(freq[0] - 0.625) < 5 * np.sqrt(0.625 * 0.375 / 4000) and freq[2:].sum() == 0


def test_auc_matches_pairwise_count():
  rng = np.random.default_rng(0)
  scores = np.round(rng.normal(size=300), 1)  # with ties
  labels = rng.random(300) < 1 / (1 + np.exp(-2 * scores))
  pos, neg = scores[labels], scores[~labels]
  brute = np.mean((pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None]))
  assert abs(evaluate.auc(scores, labels) - brute) < 1e-12


# --------------------------------------------------------------- training and shipping


def test_tiny_trains_end_to_end_loads_drafts_and_guards_hashes(tmp_path):
  # One test (not a fixture shared by several) so that pytest-xdist trains `tiny` once.
  out = str(tmp_path / "tiny")
  summary = pipeline.train_all(CFG, out, progress=False, log=lambda *_: None,
                               work_dir=str(tmp_path / "state"))
  for part in ("target",) + models.KINDS:
    assert os.path.exists(checkpoint.path_of(out, "tiny", part))
  for name, loss in summary["heldout_loss"].items():
    assert loss < np.log(V) - 0.3, (name, loss)  # learnt something on every workload
  assert summary["head_labels"] > 0

  # Every drafter loads by name and runs the speculative loop.
  for kind in models.KINDS:
    pair = models.load("tiny", drafter=kind, directory=out)
    assert pair.cfg == CFG and pair.drafter.kind == kind
    prompts = data.prompts("math", tokenizer=pair.tokenizer, num=ROLL_B, length=ROLL_P,
                           seed=0, config=pair.cfg.data)
    rec = _rollout(kind, (pair.target_params, pair.drafter_params), jnp.asarray(prompts),
                   jax.random.key(0), 1.0, 0.95)
    stats = evaluate.acceptance_stats(rec)
    assert 1.0 <= stats["mean_emitted"] <= ROLL_K + 1
    if kind == "block_head":
      assert np.std(np.asarray(rec.conf_logits)) > 0  # the trained head is not constant

  # The recorded held-out loss is reproduced from the loaded (float16-rounded) weights.
  pair = models.load("tiny", directory=out)
  loss = evaluate.heldout_loss(pair.target_params,
                               pipeline.heldout_windows(CFG, pair.tokenizer, "code"),
                               cfg=CFG.target, batch=min(16, CFG.measure.eval_windows))
  assert abs(loss - summary["heldout_loss"]["code"]) < 1e-4

  # Retraining one part reuses the tokenizer and target on disk and keeps the summary.
  before = checkpoint.read(checkpoint.path_of(out, "tiny", "target")).params
  again = pipeline.train_all(CFG, out, progress=False, log=lambda *_: None,
                             only=("block_head",), work_dir=str(tmp_path / "state_again"))
  assert set(again["retrained"]) == {"block_head"} and again["heldout_loss"] == summary[
      "heldout_loss"]
  chex.assert_trees_all_equal(checkpoint.read(checkpoint.path_of(out, "tiny", "target")).params,
                              before)
  models.load("tiny", drafter="block_head", directory=out)

  # A checkpoint written under another config is refused; the others still load.
  other = dataclasses.replace(CFG, seed=CFG.seed + 1)
  params = checkpoint.read(checkpoint.path_of(out, "tiny", "eagle")).params
  tok_hash = checkpoint.read(checkpoint.path_of(out, "tiny", "eagle")).meta["tokenizer_hash"]
  checkpoint.save(checkpoint.path_of(out, "tiny", "eagle"), params,
                  {"config": dataclasses.asdict(other), "part": "eagle",
                   "config_hash": models.config_hash(other, "eagle"), "tokenizer_hash": tok_hash})
  models.load("tiny", drafter="draft_lm", directory=out)
  with pytest.raises(ValueError, match="config hash"):
    models.load("tiny", drafter="eagle", directory=out)
  # A different tokenizer is refused.
  with open(os.path.join(out, "tokenizer_tiny.json"), "a", encoding="utf-8") as f:
    f.write(" ")
  with pytest.raises(ValueError, match="tokenizer"):
    models.load("tiny", directory=out)


def test_shipped_default_loads_and_reproduces_heldout_loss():
  pair = models.load("default", drafter="block_head")
  recorded = checkpoint.read(checkpoint.path_of(models.assets_dir(), "default", "target")
                             ).meta["heldout_loss"]
  # Recompute the recorded figure from scratch: same windows, loaded float16 weights.
  full = pipeline.heldout_windows(pair.cfg, pair.tokenizer, "math")
  loss = evaluate.heldout_loss(pair.target_params, full, cfg=pair.cfg.target,
                               batch=min(16, pair.cfg.measure.eval_windows))
  assert abs(loss - recorded["math"]) < 1e-4, (loss, recorded)
  assert models.load_summary("default")["heldout_loss"] == recorded
  shipped = [f for f in os.listdir(models.assets_dir())
             if f.startswith(("default_", "tokenizer_default"))]
  total = sum(os.path.getsize(os.path.join(models.assets_dir(), f)) for f in shipped)
  assert total <= 64 * 10**6, total  # issue 11: the shipped files stay within 64 MB


def test_stack_layers_reads_the_per_layer_layout():
  """A format-1 tree (`layer_0` ... `layer_{L-1}`) stacks to `init_params`' layout, leaf
  for leaf; a tree missing a layer is refused, naming what it expected."""
  from av_jax.models import checkpoint, transformer
  cfg = models.TransformerConfig(vocab_size=16, d_model=8, num_layers=3, num_heads=2,
                                 head_dim=4, mlp_dim=16)
  stacked = transformer.init_params(cfg, jax.random.key(0))
  per_layer = {k: v for k, v in stacked.items() if k != "layers"}
  for i in range(cfg.num_layers):
    per_layer[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked["layers"])
  chex.assert_trees_all_equal(checkpoint.stack_layers(per_layer), stacked)
  del per_layer["layer_1"]
  with pytest.raises(ValueError, match="layer_0 ... layer_"):
    checkpoint.stack_layers(per_layer)
