"""Bring your own model into av_jax's engine: plain Flax NNX models served by `make_engine`.

The target and the drafter are `examples/own_model_loop.py`'s `WindowLM` (next-token
logits from the last W tokens), which know nothing of av_jax. Here the engine runs them
(continuous batching, packed verification in static buckets, AV's plan, rejection
sampling, the online estimator) through two small adapters:

- `make_target`: an `av_jax.engine.protocols.Target`. Its cache is the slots' token
  history `[B, M]` (a window model needs only the last W tokens; a transformer would keep
  keys and values here); `verify` writes the packed tokens into it and reads each token's
  window; `hidden` is the model's last hidden layer (handed to the drafter, which here
  does not read it).
- `make_drafter`: an `av_jax.models.Drafter` (`init_state` / `draft` / `commit`) whose
  cache is its own token history; `draft` draws K tokens autoregressively.

`profile.profile_costs` times the target's `verify` for every bucket and the drafter's
`draft` through these functions, as it times av_jax's own models.

Run: `python examples/own_model_engine.py [--greedy]`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from av_jax import engine as E
from av_jax.engine import profile
from av_jax.engine.protocols import Target, TargetOutput
from av_jax.models import drafters
from av_jax.models.sampling import sample_with_log_probs
from av_jax.sampling import Sampling

import own_model_loop as loop  # the sibling example's models (run from examples/)


def windows(history: jax.Array, rows: jax.Array, positions: jax.Array,
            window: int) -> jax.Array:
  """`[..., W]`: tokens at positions - W + 1 .. positions of `history[rows]`; 0 before 0."""
  index = positions[..., None] - (window - 1) + jnp.arange(window)
  return jnp.where(index >= 0, history[rows[..., None], jnp.maximum(index, 0)], 0)


def make_target(graphdef: nnx.GraphDef, *, vocab: int, width: int, window: int) -> Target:
  """A `WindowLM` target as the engine calls it (parameters: its `nnx.State`)."""

  def init_cache(num_slots, max_len):
    return jnp.zeros((num_slots, max_len), jnp.int32)  # token history, slots on axis 0

  def verify(params, cache, *, tokens, slot, positions, valid):
    # Write first, then read: a token's window includes earlier packed tokens of its slot.
    write = jnp.where(valid, positions, cache.shape[1])  # padding: out of range, dropped
    cache = cache.at[slot, write].set(tokens, mode="drop")
    model = nnx.merge(graphdef, params)
    hidden = model.features(windows(cache, slot, positions, window))    # [T, D]
    return TargetOutput(model.logit_scale * model.out(hidden), hidden, cache)

  # No `prefill`: the engine prefills a prompt with `verify` on slot 0.
  return Target(name=f"WindowLM(V={vocab}, D={width}, W={window})", vocab_size=vocab,
                hidden_size=width, init_cache=init_cache, verify=verify, slot_axis=0)


def make_drafter(graphdef: nnx.GraphDef, *, window: int) -> drafters.Drafter:
  """A `WindowLM` drafter as the engine calls it (parameters: its `nnx.State`).

  Its `DrafterState.cache` is the token history `[B, M]`; the pending tokens (committed,
  not yet consumed) are written into it when drafting. `target_params` and the target's
  hidden states are accepted and not read.
  """

  def init_state(params, target_params, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    del params, target_params
    B, P = prompt.shape
    lens = jnp.full((B,), P, jnp.int32) if prompt_lens is None else prompt_lens
    history = jnp.zeros((B, max_len), jnp.int32).at[:, :P].set(
        jnp.where(jnp.arange(P) < lens[:, None], prompt, 0))
    last_hidden = jnp.take_along_axis(prompt_hidden, (lens - 1)[:, None, None], 1)[:, 0]
    tokens = jnp.zeros((B, K + 1), jnp.int32).at[:, 0].set(next_token)  # x_n pending
    hidden = jnp.zeros((B, K + 1, prompt_hidden.shape[-1]), prompt_hidden.dtype)
    return drafters.DrafterState(cache=history, tokens=tokens,
                                 hidden=hidden.at[:, 0].set(last_hidden),
                                 num_pending=jnp.ones((B,), jnp.int32), position=lens)

  def draft(params, target_params, state, key, *, K, temperature, top_p):
    del target_params
    history = state.cache
    B, M = history.shape
    rows = jnp.arange(B)
    j = jnp.arange(state.tokens.shape[1])
    write = jnp.where(j < state.num_pending[:, None], state.position[:, None] + j, M)
    history = history.at[rows[:, None], write].set(state.tokens, mode="drop")
    last = state.position + state.num_pending - 1                      # position of x_n
    model = nnx.merge(graphdef, params)

    def one(context, key):  # draft token i + 1 reads the drawn token i
      logits = model(context)
      token, log_probs = sample_with_log_probs(key, logits, temperature=temperature,
                                               top_p=top_p)
      return jnp.concatenate([context[:, 1:], token[:, None]], 1), (logits, token, log_probs)

    _, (logits, tokens, log_probs) = jax.lax.scan(
        one, windows(history, rows, last, window), jax.random.split(key, K))
    return drafters.DraftOutput(logits=logits.swapaxes(0, 1), tokens=tokens.T,
                                conf_logits=None, state=state._replace(cache=history),
                                log_probs=log_probs.swapaxes(0, 1))

  return drafters.Drafter(kind="window_lm", drafting="autoregressive", init_state=init_state,
                          draft=draft, commit=drafters.commit)


def make_engine(target: loop.WindowLM, drafter: loop.WindowLM, cfg: loop.Config,
                config: E.EngineConfig) -> tuple[E.Engine, E.Params]:
  """The engine serving `target` with `drafter`, and its parameters."""
  target_def, target_params = nnx.split(target)
  drafter_def, drafter_params = nnx.split(drafter)
  engine = E.make_engine(
      config, target=make_target(target_def, vocab=cfg.vocab, width=cfg.target_width,
                                 window=cfg.window),
      drafter=make_drafter(drafter_def, window=cfg.window))
  return engine, E.Params(target=target_params, drafter=drafter_params)


def target_greedy(target: loop.WindowLM, prompt: list[int], num_tokens: int,
                  window: int) -> list[int]:
  """The target's own greedy decoding of one prompt (the reference)."""
  seq = list(prompt)
  for _ in range(num_tokens):
    context = ([0] * window + seq)[-window:]
    seq.append(int(jnp.argmax(target(jnp.asarray(context)))))
  return seq[len(prompt):]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--greedy", action="store_true", help="greedy drafting and verification")
  args = parser.parse_args()
  cfg = loop.Config()
  target, drafter = loop.make_models(cfg)
  config = E.EngineConfig(num_slots=cfg.num_slots, max_draft=cfg.max_draft, max_len=64,
                          mode="av", sampling=Sampling(temperature=0.0 if args.greedy else 1.0))
  engine, params = make_engine(target, drafter, cfg, config)
  cost, table = profile.profile_costs(engine, params, cache_dir="")
  print(profile.format_profile(table))
  prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
  result = E.generate(engine, params, prompts, max_new_tokens=cfg.max_new,
                      key=jax.random.key(0), cost=cost)
  stats = result.stats
  print(f"{stats['emitted']:.0f} tokens in {stats['steps']:.0f} steps, "
        f"{stats['verified']:.0f} drafts verified")
  for c in result.completions:
    print(c.prompt, "->", c.tokens)
  if args.greedy:
    same = all(c.tokens == target_greedy(target, c.prompt, cfg.max_new, cfg.window)
               for c in result.completions)
    print(f"equals the target's own greedy decoding: {same}")
  return np.asarray([len(c.tokens) for c in result.completions])


if __name__ == "__main__":
  main()
