"""Measurements of trained models: held-out loss and speculative-decoding acceptance.

`rollout` is a minimal batched speculative decoder (one fixed K for every slot, every
draft token verified) used to measure acceptance and to collect confidence-head labels.
It exercises the same interface the engine uses: target prefill with a KV cache,
`drafter.init_state`, `drafter.draft`, a dense verification forward of `[x_n, d_1..d_K]`,
`av_jax.rejection.rejection_sample`, and `drafter.commit`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from av_jax.models import transformer
from av_jax.models.config import ModelsConfig
from av_jax.models.drafters import Drafter
from av_jax.models.sampling import sample_tokens, sampling_probs
from av_jax.rejection import rejection_sample


class RolloutRecord(NamedTuple):
  """Per-step records of a rollout, stacked over `steps`."""
  accepted: jax.Array      # [N, B, K] bool, draft position accepted
  labeled: jax.Array       # [N, B, K] bool, position has an accept/reject label
  num_emitted: jax.Array   # [N, B] int32 tokens emitted by the step
  conf_logits: jax.Array   # [N, B, K] float32 confidence logits (zeros without a head)
  draft_logits: jax.Array  # [N, B, K, V] float32 raw draft logits
  ctx_hidden: jax.Array    # [N, B, D] target hidden that predicted x_n (block drafter input)
  ctx_token: jax.Array     # [N, B] int32 x_n, the newest committed token
  emitted: jax.Array       # [N, B, K+1] int32 emitted tokens, -1 padded
  draft_tokens: jax.Array  # [N, B, K] int32 drawn draft tokens


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "K", "steps"))
def rollout(target_params, drafter_params, prompts: jax.Array, key: jax.Array, *,
            cfg: ModelsConfig, drafter: Drafter, K: int, steps: int,
            temperature: jax.typing.ArrayLike, top_p: jax.typing.ArrayLike) -> RolloutRecord:
  """Runs `steps` speculative decoding steps from `prompts [B, P]`, verifying all K drafts.

  Args:
    target_params: target parameters.
    drafter_params: drafter parameters.
    prompts: `[B, P]` int32 prompts (equal length).
    key: PRNG key.
    cfg: model set config (static).
    drafter: the `Drafter` (static).
    K: draft length (static).
    steps: decode steps (static).
    temperature: sampling temperature of drafter and target; 0 = greedy.
    top_p: nucleus mass of drafter and target.

  Returns:
    A `RolloutRecord`.
  """
  tcfg = cfg.target
  batch, plen = prompts.shape
  max_len = plen + (steps + 1) * (K + 1) + 1
  cache = transformer.init_cache(tcfg, batch, max_len)
  positions = jnp.broadcast_to(jnp.arange(plen), prompts.shape)
  pre = transformer.forward(target_params, prompts, positions, cache, cfg=tcfg)
  key, sub = jax.random.split(key)
  first = sample_tokens(sub, pre.logits[:, -1], temperature=temperature, top_p=top_p)
  dstate = drafter.init_state(drafter_params, target_params, prompt=prompts,
                              prompt_hidden=pre.hidden, next_token=first, K=K,
                              max_len=max_len)
  pos_n = jnp.full([batch], plen, jnp.int32)

  def step(carry, k):
    cache, dstate, last, pos_n = carry
    k_draft, k_verify = jax.random.split(k)
    idx = dstate.num_pending - 1
    ctx_hidden = jnp.take_along_axis(dstate.hidden, idx[:, None, None], 1)[:, 0]
    out = drafter.draft(drafter_params, target_params, dstate, k_draft, K=K,
                        temperature=temperature, top_p=top_p)
    verify_tokens = jnp.concatenate([last[:, None], out.tokens], 1)
    verify_pos = pos_n[:, None] + jnp.arange(K + 1)[None]
    tout = transformer.forward(target_params, verify_tokens, verify_pos, cache, cfg=tcfg)
    res = rejection_sample(
        k_verify,
        draft_probs=sampling_probs(out.logits, temperature=temperature, top_p=top_p),
        draft_tokens=out.tokens,
        target_probs=sampling_probs(tout.logits, temperature=temperature, top_p=top_p),
        num_verified=jnp.full([batch], K, jnp.int32))
    dstate = drafter.commit(out.state, emitted_tokens=res.tokens,
                            num_emitted=res.num_emitted, target_hidden=tout.hidden)
    new_last = jnp.take_along_axis(res.tokens, (res.num_emitted - 1)[:, None], 1)[:, 0]
    conf = out.conf_logits if out.conf_logits is not None else jnp.zeros([batch, K])
    rec = RolloutRecord(res.accepted, res.labeled, res.num_emitted, conf, out.logits, ctx_hidden,
                        last, res.tokens, out.tokens)
    return (tout.cache, dstate, new_last, pos_n + res.num_emitted), rec

  _, recs = jax.lax.scan(step, (pre.cache, dstate, first, pos_n),
                         jax.random.split(key, steps))
  return recs


def acceptance_stats(rec: RolloutRecord) -> dict:
  """Per-position acceptance statistics of a rollout.

  Returns:
    `acceptance[i]`: accepted / labelled at position i+1, the acceptance rate given positions
    1..i were accepted (what the estimator's pi models); `labels[i]`: its sample size;
    `survival[i]`: fraction of steps with positions 1..i+1 all accepted; `mean_emitted`.
  """
  acc = np.asarray(rec.accepted).reshape(-1, rec.accepted.shape[-1])
  lab = np.asarray(rec.labeled).reshape(-1, rec.labeled.shape[-1])
  n = lab.sum(0)
  rate = np.where(n > 0, acc.sum(0) / np.maximum(n, 1), np.nan)
  return {"acceptance": rate.tolist(), "labels": n.tolist(),
          "survival": acc.mean(0).tolist(),  # P(positions 1..i all accepted)
          "mean_emitted": float(np.asarray(rec.num_emitted).mean())}


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """Area under the ROC curve by the rank-sum (Mann-Whitney) formula, ties averaged."""
  scores, labels = np.asarray(scores, np.float64), np.asarray(labels, bool)
  pos, neg = labels.sum(), (~labels).sum()
  if pos == 0 or neg == 0:
    return float("nan")
  order = np.argsort(scores, kind="mergesort")
  ranks = np.empty(len(scores))
  sorted_scores = scores[order]
  i = 0
  while i < len(scores):  # average ranks over ties
    j = i
    while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
      j += 1
    ranks[order[i:j + 1]] = (i + j) / 2 + 1
    i = j + 1
  return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _batch_nll(params, tokens, *, cfg):
  return transformer.lm_loss(params, tokens, cfg=cfg)


def heldout_loss(params, windows: np.ndarray, *, cfg, batch: int = 16) -> float:
  """Mean next-token loss (nats/token) of `windows [N, S+1]` under the target."""
  losses = [float(_batch_nll(params, jnp.asarray(windows[i:i + batch]), cfg=cfg))
            for i in range(0, len(windows) - batch + 1, batch)]
  return float(np.mean(losses))


def heldout_bits_per_byte(params, windows: np.ndarray, byte_lengths: np.ndarray, *, cfg,
                          batch: int = 16) -> float:
  """Bits per byte of text of `windows [N, S+1]` under the target (comparable across tokenizers).

  The summed next-token cross-entropy of the predicted tokens `windows[:, 1:]`, in bits,
  over the bytes of text those tokens stand for (`byte_lengths [V]`, e.g.
  `Tokenizer.byte_lengths()`; `<|endoftext|>` stands for no text but its prediction is
  charged). Uses the same full batches as `heldout_loss`.
  """
  used = (len(windows) // batch) * batch
  if used == 0:
    raise ValueError(f"windows: expected at least batch={batch} windows, got {len(windows)}")
  nats = sum(float(_batch_nll(params, jnp.asarray(windows[i:i + batch]), cfg=cfg)) *
             batch * (windows.shape[1] - 1) for i in range(0, used, batch))
  num_bytes = int(np.asarray(byte_lengths)[windows[:used, 1:]].sum())
  return nats / np.log(2.0) / num_bytes


@functools.partial(jax.jit, static_argnames=("cfg", "steps"))
def sample_continuations(params, prompts: jax.Array, key: jax.Array, *, cfg, steps: int,
                         temperature: jax.typing.ArrayLike,
                         top_p: jax.typing.ArrayLike) -> jax.Array:
  """`steps` tokens sampled from the target after each of `prompts [B, P]`: `[B, steps]`.

  Target-only decoding with a KV cache (temperature 0 = greedy), for sample generations.
  """
  batch, plen = prompts.shape
  cache = transformer.init_cache(cfg, batch, plen + steps)
  positions = jnp.broadcast_to(jnp.arange(plen), prompts.shape)
  out = transformer.forward(params, prompts, positions, cache, cfg=cfg)
  key, sub = jax.random.split(key)
  first = sample_tokens(sub, out.logits[:, -1], temperature=temperature, top_p=top_p)

  def step(carry, k):
    cache, last, pos = carry
    o = transformer.forward(params, last[:, None], pos[:, None], cache, cfg=cfg)
    nxt = sample_tokens(k, o.logits[:, 0], temperature=temperature, top_p=top_p)
    return (o.cache, nxt, pos + 1), last

  pos = jnp.full([batch], plen, jnp.int32)
  _, toks = jax.lax.scan(step, (out.cache, first, pos), jax.random.split(key, steps))
  return toks.T
