"""av_jax's four drafter kinds: their flax modules (`EagleHead`, `BlockDrafter`), random
parameters (`init_drafter_params`), and `Drafter`s (`make_drafter`): `draft_lm` and
`eagle` draft autoregressively, `block` and `block_head` in parallel. See the
`av_jax.models.drafters` docstring."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.models import transformer
from av_jax.models.config import (BlockConfig, EagleConfig, ModelsConfig, TransformerConfig,
                                  kv_cache_dtype)
from av_jax.models.drafters.protocol import DRAFTING, KINDS, DraftOutput, Drafter
from av_jax.models.drafters.state import DrafterState, _pick, commit
from av_jax.models.layers import Block, LayerKV, RMSNorm
from av_jax.models.sampling import sample_with_log_probs


# ----------------------------------------------------------------------------- modules


def _output_logits(features: jax.Array, embedding: jax.Array, rank: int) -> jax.Array:
  """Draft logits `[..., V]` of `features [..., D]` (call inside a compact module).

  `rank == 0`: the target's tied head, `features @ embedding.T` (D*V multiply-adds per token).
  `rank > 0`: the drafter's own factored head D -> rank -> V (rank*(D+V) per token): with a
  4096-token vocabulary at D = 384 the tied head alone is 10% of a 16M target's compute per
  token, so drafters in the proportions of deployed pairs (EAGLE-3 shrinks its head to a
  reduced draft vocabulary for the same reason) need a cheaper head.
  """
  if rank == 0:
    return features @ embedding.T
  low = nn.Dense(rank, use_bias=False, name="head_down")(features)
  return nn.Dense(embedding.shape[0], use_bias=False, name="head_up")(low)


class EagleHead(nn.Module):
  """EAGLE-style head: `fc([h_{t-1}; e(x_t)])`, one transformer layer, norm, shared head.

  Reference: Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty". Input at position t is the target feature that predicted x_t and x_t's
  embedding; the output approximates the target feature at t (which predicts x_{t+1}).
  """
  d_model: int
  cfg: EagleConfig
  rope_theta: float
  mode: str = "causal"

  @nn.compact
  def __call__(self, embedding, hidden, tokens, positions, cache=None, write_positions=None,
               pick=None):
    """`(features [B, P, D], logits [B, P, V], new cache)`; with `pick [B]` (mode
    "dense") every column writes the cache but only row b's column `pick[b]` goes on
    past its keys and values: features `[B, D]`, logits `[B, V]` (the query, the MLP
    and the head run on the column used, not on every pending one)."""
    e = embedding[tokens] * math.sqrt(self.d_model)
    x = nn.Dense(self.d_model, use_bias=False, name="fc")(jnp.concatenate([hidden, e], -1))
    x, new_cache = Block(self.cfg.num_heads, self.cfg.head_dim, self.cfg.mlp_dim,
                         self.rope_theta, self.mode, name="layer")(x, positions, cache, None,
                                                                   write_positions, pick)
    features = RMSNorm(name="norm")(x)
    if pick is not None:
      features = features[:, 0]
    return features, _output_logits(features, embedding, self.cfg.head_rank), new_cache


class BlockDrafter(nn.Module):
  """Parallel block drafter: K_max positions in one bidirectional pass.

  The context vector `fc([h_n-1; e(x_n)])` plus a learned slot embedding forms K_max+1
  slots; `num_layers` bidirectional blocks mix them; slot i (1..K_max) predicts x_{n+i}
  through the target's shared output head. No slot sees a drawn token, so the K
  distributions do not depend on the draws (references: Cai et al. 2024 "Medusa";
  DFlash-style block diffusion drafters). With `with_head`, a linear layer on each slot's
  hidden state gives confidence logits (DSpark-style head).
  """
  d_model: int
  cfg: BlockConfig
  with_head: bool = False

  @nn.compact
  def __call__(self, embedding, hidden, tokens):
    e = embedding[tokens] * math.sqrt(self.d_model)
    ctx = nn.Dense(self.d_model, use_bias=False, name="fc")(jnp.concatenate([hidden, e], -1))
    # Unit scale, like the context vector: with a small init every slot starts as the same
    # function of the context and slot 1 learns a blend of all depths (measured: position-1
    # acceptance 0.2-0.4 with stddev 0.02).
    slots = self.param("slot_embed", nn.initializers.normal(1.0),
                       (self.cfg.block_size + 1, self.d_model))
    x = ctx[..., None, :] + slots  # [..., K_max+1, D]
    for i in range(self.cfg.num_layers):
      x, _ = Block(self.cfg.num_heads, self.cfg.head_dim, self.cfg.mlp_dim, 1.0,
                   "bidirectional", name=f"layer_{i}")(x, None)
    feats = RMSNorm(name="norm")(x[..., 1:, :])  # [..., K_max, D]
    logits = _output_logits(feats, embedding, self.cfg.head_rank)
    conf = None
    if self.with_head:
      conf = nn.Dense(1, name="conf_head")(jax.lax.stop_gradient(feats))[..., 0]
    return feats, logits, conf


def _eagle_module(cfg: ModelsConfig, mode: str) -> EagleHead:
  return EagleHead(cfg.target.d_model, cfg.eagle, cfg.target.rope_theta, mode)


def _block_module(cfg: ModelsConfig, kind: str) -> BlockDrafter:
  return BlockDrafter(cfg.target.d_model, cfg.block, with_head=(kind == "block_head"))


def init_drafter_params(kind: str, cfg: ModelsConfig, key: jax.Array):
  """Random parameters of drafter `kind` (does not include the shared target embedding)."""
  d = cfg.target.d_model
  emb = jnp.zeros([cfg.target.vocab_size, d])
  if kind == "draft_lm":
    return transformer.init_params(cfg.draft_lm, key)
  if kind == "eagle":
    return _eagle_module(cfg, "causal").init(key, emb, jnp.zeros([1, 4, d]),
                                             jnp.zeros([1, 4], jnp.int32),
                                             jnp.arange(4)[None])["params"]
  if kind in ("block", "block_head"):
    return _block_module(cfg, kind).init(key, emb, jnp.zeros([1, d]),
                                         jnp.zeros([1], jnp.int32))["params"]
  raise KeyError(f"unknown drafter kind {kind!r}; known: {KINDS}")


# ------------------------------------------------------------------------ shared helpers


def _last_pending(state: DrafterState):
  """(token [B], hidden [B, D], position [B]) of the newest committed token x_n."""
  idx = state.num_pending - 1
  tok = jnp.take_along_axis(state.tokens, idx[:, None], 1)[:, 0]
  hid = jnp.take_along_axis(state.hidden, idx[:, None, None], 1)[:, 0]
  return tok, hid, state.position + idx


def _pending_inputs(state: DrafterState):
  width = state.tokens.shape[1]
  offs = jnp.arange(width)[None]
  return state.position[:, None] + offs, offs < state.num_pending[:, None]


def _pending_from_prompt(prompt_hidden, next_token, prompt_lens, K):
  batch, _, d = prompt_hidden.shape
  last_h = _pick(prompt_hidden, prompt_lens - 1)
  tokens = jnp.zeros([batch, K + 1], jnp.int32).at[:, 0].set(next_token)
  hidden = jnp.zeros([batch, K + 1, d], prompt_hidden.dtype).at[:, 0].set(last_h)
  return tokens, hidden


def _check_init(prompt, prompt_hidden, next_token):
  _checks.rank("prompt", prompt, 2, "BP")
  _checks.shape("prompt_hidden", prompt_hidden, prompt.shape + (None,), "BPD")
  _checks.shape("next_token", next_token, prompt.shape[:1], "B")


def _init_inputs(prompt, prompt_hidden, next_token, prompt_lens):
  """Checked, typed `init_state` inputs; `lens [B]` defaults to the full prompt length."""
  prompt, prompt_hidden = jnp.asarray(prompt), jnp.asarray(prompt_hidden)
  next_token = jnp.asarray(next_token, jnp.int32)
  _check_init(prompt, prompt_hidden, next_token)
  batch, length = prompt.shape
  lens = jnp.full([batch], length, jnp.int32) if prompt_lens is None else jnp.asarray(
      prompt_lens, jnp.int32)
  return prompt, prompt_hidden, next_token, lens


def _autoregressive(step, carry, first, keys, K, keep_fn=None, keep_init=None):
  """Depths 2..K of an autoregressive draft after depth 1 (`first`).

  `step(carry, (key,)) -> (carry, (logits [B,V], token [B], log_probs [B,V]))` runs one
  drafter pass. Without `keep_fn` a `lax.scan` runs all K - 1 passes. With it a
  `lax.while_loop` runs pass j + 1 while some row keeps drafting after depth j: rows that
  stopped still ride along in a pass that runs (their outputs are discarded, their cache
  writes land above the prefix the next step consumes and are never read), and a pass
  no row needs is not run. Depth j's key is `keys[j - 1]` either way, so what a row
  drafts does not depend on where other rows stopped.

  Returns `(carry, logits [B,K,V], tokens [B,K], log_probs [B,K,V], depth [B] | None,
  passes [] | None, aux | None)` (`aux`: the `keep_fn`'s last).
  """
  logits0, tok0, lp0 = first
  if keep_fn is None:
    carry, (logits, toks, lps) = jax.lax.scan(step, carry, (keys[1:],))
    stack = lambda f, rest: jnp.concatenate([f[:, None], jnp.moveaxis(rest, 0, 1)], 1)
    return (carry, stack(logits0, logits), stack(tok0, toks), stack(lp0, lps), None, None,
            None)
  B = tok0.shape[0]
  buffer = lambda x: jnp.zeros((B, K) + x.shape[1:], x.dtype).at[:, 0].set(x)
  keep, aux = keep_fn(jnp.int32(1), logits0, lp0, keep_init)
  init = (jnp.int32(1), carry, buffer(logits0), buffer(tok0), buffer(lp0),
          jnp.ones((B,), jnp.int32), keep, aux)

  def cond(loop):
    j, keep = loop[0], loop[6]
    return (j < K) & jnp.any(keep)

  def body(loop):
    j, carry, logits, toks, lps, depth, keep, aux = loop
    carry, (lg, tok, lp) = step(carry, (keys[j],))
    row = lambda x: keep.reshape((B,) + (1,) * (x.ndim - 1))
    put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(
        buf, jnp.where(row(x), x, jnp.zeros_like(x)), j, axis=1)
    more, aux = keep_fn(j + 1, lg, lp, aux)
    return (j + 1, carry, put(logits, lg), put(toks, tok), put(lps, lp),
            depth + keep.astype(jnp.int32), keep & more, aux)

  passes, carry, logits, toks, lps, depth, _, aux = jax.lax.while_loop(cond, body, init)
  return carry, logits, toks, lps, depth, passes, aux


# ------------------------------------------------------------------------------ draft_lm


def _make_draft_lm(cfg: ModelsConfig) -> Drafter:
  lm_cfg: TransformerConfig = cfg.draft_lm

  def init_state(params, target_params, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    del target_params
    prompt, prompt_hidden, next_token, lens = _init_inputs(prompt, prompt_hidden, next_token,
                                                           prompt_lens)
    batch, length = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(length), prompt.shape)
    cache = transformer.init_cache(lm_cfg, batch, max_len, kv_cache_dtype(cfg))
    cache = transformer.forward(params, prompt, positions, cache, cfg=lm_cfg,
                                valid=positions < lens[:, None]).cache
    tokens, hidden = _pending_from_prompt(prompt_hidden, next_token, lens, K)
    return DrafterState(cache, tokens, hidden, jnp.ones([batch], jnp.int32), lens)

  def draft(params, target_params, state, key, *, K, temperature=1.0, top_p=1.0,
            keep_fn=None, keep_init=None):
    del target_params
    positions, valid = _pending_inputs(state)
    # Every pending token writes the cache; only the newest predicts depth 1, so the last
    # layer's query and MLP and the head run on it alone (`transformer.forward` pick).
    out = transformer.forward(params, state.tokens, positions, state.cache, cfg=lm_cfg,
                              valid=valid, pick=state.num_pending - 1)
    logits0 = out.logits
    _, _, pos_n = _last_pending(state)
    keys = jax.random.split(key, K)
    tok0, lp0 = sample_with_log_probs(keys[0], logits0, temperature=temperature, top_p=top_p)

    def step(carry, inp):
      cache, tok, pos = carry
      k, = inp
      o = transformer.forward(params, tok[:, None], pos[:, None], cache, cfg=lm_cfg)
      logits = o.logits[:, 0]
      nxt, lp = sample_with_log_probs(k, logits, temperature=temperature, top_p=top_p)
      return (o.cache, nxt, pos + 1), (logits, nxt, lp)

    (cache, _, _), logits, toks, lps, depth, passes, aux = _autoregressive(
        step, (out.cache, tok0, pos_n + 1), (logits0, tok0, lp0), keys, K, keep_fn,
        keep_init)
    return DraftOutput(logits, toks, None, state._replace(cache=cache), lps, depth, passes,
                       aux)

  def absorb(params, target_params, state):
    del target_params
    positions, valid = _pending_inputs(state)
    out = transformer.forward(params, state.tokens, positions, state.cache, cfg=lm_cfg,
                              valid=valid)
    return state._replace(cache=out.cache)

  return Drafter("draft_lm", DRAFTING["draft_lm"], init_state, draft, commit, stepwise=True,
                 absorb=absorb, skips=True)


# --------------------------------------------------------------------------------- eagle


def _make_eagle(cfg: ModelsConfig) -> Drafter:
  ecfg = cfg.eagle
  dense_head = _eagle_module(cfg, "dense")
  one_layer = TransformerConfig(vocab_size=1, d_model=cfg.target.d_model, num_layers=1,
                                num_heads=ecfg.num_heads, head_dim=ecfg.head_dim,
                                mlp_dim=ecfg.mlp_dim)

  def run(params, emb, hidden, tokens, positions, cache, write, pick=None):
    layer = LayerKV(cache.k[0], cache.v[0])
    feats, logits, new = dense_head.apply({"params": params}, emb, hidden, tokens, positions,
                                          layer, write, pick)
    return feats, logits, transformer.KVCache(new.k[None], new.v[None])

  def init_state(params, target_params, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    prompt, prompt_hidden, next_token, lens = _init_inputs(prompt, prompt_hidden, next_token,
                                                           prompt_lens)
    batch, length = prompt.shape
    cache = transformer.init_cache(one_layer, batch, max_len, kv_cache_dtype(cfg))
    # The pair (h_{t-1}, x_t) of sequence position t >= 1 lives at head position t - 1, so
    # every head-cache entry at or below a query's position is written (RoPE makes the
    # shift invisible to the outputs).
    positions = jnp.broadcast_to(jnp.arange(length - 1), (batch, length - 1))
    write = jnp.where(positions + 1 < lens[:, None], positions, max_len)
    if length > 1:
      _, _, cache = run(params, transformer.embedding(target_params), prompt_hidden[:, :-1],
                        prompt[:, 1:], positions, cache, write)
    tokens, hidden = _pending_from_prompt(prompt_hidden, next_token, lens, K)
    return DrafterState(cache, tokens, hidden, jnp.ones([batch], jnp.int32), lens)

  def draft(params, target_params, state, key, *, K, temperature=1.0, top_p=1.0,
            keep_fn=None, keep_init=None):
    emb = transformer.embedding(target_params)
    positions, valid = _pending_inputs(state)
    positions = positions - 1  # head position = sequence position - 1 (see init_state)
    max_len = transformer.cache_len(state.cache)
    # Every pending column writes the head's cache; only the newest predicts depth 1, so
    # only it runs on past its keys and values (`EagleHead` pick).
    idx = state.num_pending - 1
    feat0, logits0, cache = run(params, emb, state.hidden, state.tokens, positions,
                                state.cache, jnp.where(valid, positions, max_len), idx)
    _, _, pos_n = _last_pending(state)
    keys = jax.random.split(key, K)
    tok0, lp0 = sample_with_log_probs(keys[0], logits0, temperature=temperature, top_p=top_p)

    def step(carry, inp):
      cache, feat, tok, pos = carry
      k, = inp
      f, lg, cache = run(params, emb, feat[:, None], tok[:, None], pos[:, None], cache,
                         pos[:, None])
      f, lg = f[:, 0], lg[:, 0]
      nxt, lp = sample_with_log_probs(k, lg, temperature=temperature, top_p=top_p)
      return (cache, f, nxt, pos + 1), (lg, nxt, lp)

    (cache, _, _, _), logits, toks, lps, depth, passes, aux = _autoregressive(
        step, (cache, feat0, tok0, pos_n), (logits0, tok0, lp0), keys, K, keep_fn,
        keep_init)
    return DraftOutput(logits, toks, None, state._replace(cache=cache), lps, depth, passes,
                       aux)

  def absorb(params, target_params, state):
    positions, valid = _pending_inputs(state)
    positions = positions - 1  # head position = sequence position - 1 (see init_state)
    _, _, cache = run(params, transformer.embedding(target_params), state.hidden,
                      state.tokens, positions, state.cache,
                      jnp.where(valid, positions, transformer.cache_len(state.cache)))
    return state._replace(cache=cache)

  return Drafter("eagle", DRAFTING["eagle"], init_state, draft, commit, stepwise=True,
                 absorb=absorb, skips=True)


# --------------------------------------------------------------------------------- block


def _make_block(cfg: ModelsConfig, kind: str) -> Drafter:
  module = _block_module(cfg, kind)

  def init_state(params, target_params, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    del params, target_params, max_len
    prompt, prompt_hidden, next_token, lens = _init_inputs(prompt, prompt_hidden, next_token,
                                                           prompt_lens)
    batch, length = prompt.shape
    tokens, hidden = _pending_from_prompt(prompt_hidden, next_token, lens, K)
    return DrafterState(None, tokens, hidden, jnp.ones([batch], jnp.int32), lens)

  def draft(params, target_params, state, key, *, K, temperature=1.0, top_p=1.0):
    if K > cfg.block.block_size:
      raise ValueError(f"K={K} exceeds the block drafter's block_size {cfg.block.block_size}")
    tok, hid, _ = _last_pending(state)
    _, logits, conf = module.apply({"params": params}, transformer.embedding(target_params),
                                   hid, tok)
    logits = logits[:, :K]
    # All K distributions are fixed before any draw: independent draws per position.
    toks, log_probs = sample_with_log_probs(key, logits, temperature=temperature, top_p=top_p)
    return DraftOutput(logits, toks, None if conf is None else conf[:, :K], state, log_probs)

  return Drafter(kind, DRAFTING[kind], init_state, draft, commit, skips=True)


@functools.lru_cache(maxsize=64)
def make_drafter(kind: str, cfg: ModelsConfig) -> Drafter:
  """The `Drafter` of `kind` for model set `cfg` (functions close over the config only).

  Cached: equal `(kind, cfg)` give the same object, so jitted callers taking the drafter
  as a static argument do not recompile.

  Example:
    >>> d = make_drafter("eagle", cfg)
    >>> draft = jax.jit(d.draft, static_argnames="K")
  """
  if kind == "draft_lm":
    return _make_draft_lm(cfg)
  if kind == "eagle":
    return _make_eagle(cfg)
  if kind in ("block", "block_head"):
    return _make_block(cfg, kind)
  raise KeyError(f"unknown drafter kind {kind!r}; known: {KINDS}")
