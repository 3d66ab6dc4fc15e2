"""Bring your own model: AV speculative decoding of a plain Flax NNX target and drafter.

The target and the drafter are ordinary `flax.nnx` modules that know nothing of av_jax:
next-token logits from the last `W` tokens (tiny shapes, so the example runs in seconds
on a CPU). The decode loop uses av_jax's core functions only, one jitted step:

  draft K tokens -> logit_qmax (features of the distribution the drafter sampled from)
  -> estimator.predict -> planner.plan (num_verified [B]) -> target forward
  -> rejection_sample -> estimator.update (this step's labels, used from the next step).

The cost tables come from timing the target's packed forward and the drafter with
`av_jax.profile_costs`. For simplicity the target scores all K + 1 positions of every
slot; a server packs only each slot's `num_verified + 1` rows into the smallest bucket
that holds them, which is where AV saves target compute (docs/integration.md).

Run: `python examples/own_model_loop.py [--greedy]`.
"""

from __future__ import annotations

import argparse
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import av_jax


class WindowLM(nnx.Module):
  """Next-token logits from the last `window` tokens: embed, concatenate, MLP."""

  def __init__(self, vocab: int, width: int, window: int, *, logit_scale: float = 1.0,
               rngs: nnx.Rngs):
    self.logit_scale = logit_scale  # > 1 sharpens a random init into a peaked LM
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.hidden = nnx.Linear(window * width, width, rngs=rngs)
    self.out = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, windows: jax.Array) -> jax.Array:  # [..., W] int -> [..., V] logits
    return self.logit_scale * self.out(self.features(windows))

  def features(self, windows: jax.Array) -> jax.Array:  # [..., W] int -> [..., D] hidden
    x = self.embed(windows)
    x = x.reshape(*windows.shape[:-1], -1)
    return jax.nn.gelu(self.hidden(x))


class Config(NamedTuple):
  vocab: int = 16         # V
  window: int = 2         # W, tokens of context each model reads
  target_width: int = 32  # D of the target
  draft_width: int = 8    # D of the drafter (smaller: it only approximates the target)
  num_slots: int = 4      # B
  max_draft: int = 4      # K
  max_new: int = 24       # tokens generated per slot
  temperature: float = 1.0  # <= 0: greedy drafting and verification
  top_p: float = 1.0


class LoopState(NamedTuple):
  context: jax.Array           # [B, W] int32, last W tokens of each sequence
  output: jax.Array            # [B, max_new] int32, generated tokens, -1 past the end
  length: jax.Array            # [B] int32, tokens generated so far
  estimator: av_jax.EstimatorState
  planner: av_jax.PlannerState
  key: jax.Array


def make_models(cfg: Config, seed: int = 0) -> tuple[WindowLM, WindowLM]:
  """A random target and a drafter distilled towards it (a few hundred Adam steps)."""
  target = WindowLM(cfg.vocab, cfg.target_width, cfg.window, logit_scale=20.0,
                    rngs=nnx.Rngs(seed))
  drafter = WindowLM(cfg.vocab, cfg.draft_width, cfg.window, rngs=nnx.Rngs(seed + 1))
  return target, distill(drafter, target, cfg)


def distill(drafter: WindowLM, target: WindowLM, cfg: Config, steps: int = 300) -> WindowLM:
  """Fits the drafter to the target's next-token distribution on every context."""
  contexts = jnp.asarray(list(itertools.product(range(cfg.vocab), repeat=cfg.window)))
  teacher = jax.nn.softmax(target(contexts))
  graphdef, params = nnx.split(drafter)
  tx = optax.adam(1e-2)

  def loss(params):
    log_q = jax.nn.log_softmax(nnx.merge(graphdef, params)(contexts))
    return -jnp.mean(jnp.sum(teacher * log_q, axis=-1))

  def train_step(_, carry):
    params, opt_state = carry
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  train = jax.jit(lambda params: jax.lax.fori_loop(0, steps, train_step,
                                                    (params, tx.init(params)))[0])
  params = train(params)
  return nnx.merge(graphdef, params)


def sampling_probs(logits: jax.Array, cfg: Config) -> jax.Array:
  """The distribution a sampler draws from: temperature and top-p, or greedy's one-hot."""
  if cfg.temperature <= 0:
    return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1])
  return jnp.exp(av_jax.sampling_log_probs(logits, temperature=cfg.temperature,
                                           top_p=cfg.top_p))


def draft(drafter: WindowLM, context: jax.Array, key: jax.Array, cfg: Config):
  """K autoregressive draft tokens: logits [B, K, V], probs q [B, K, V], tokens [B, K]."""
  def one(carry, key):
    logits = drafter(carry)
    probs = sampling_probs(logits, cfg)
    token = jax.random.categorical(key, jnp.log(probs)).astype(jnp.int32)
    return jnp.concatenate([carry[:, 1:], token[:, None]], axis=1), (logits, probs, token)

  _, (logits, probs, tokens) = jax.lax.scan(one, context, jax.random.split(key, cfg.max_draft))
  return logits.swapaxes(0, 1), probs.swapaxes(0, 1), tokens.T


def verify_windows(context: jax.Array, drafts: jax.Array, window: int) -> jax.Array:
  """`[B, K + 1, W]`: the W tokens before each draft position and before the bonus row."""
  seq = jnp.concatenate([context, drafts], axis=1)              # [B, W + K]
  starts = jnp.arange(drafts.shape[1] + 1)[:, None] + jnp.arange(window)[None, :]
  return seq[:, starts]


def make_decoder(cfg: Config, cost: av_jax.CostModel, target_def: nnx.GraphDef,
                 drafter_def: nnx.GraphDef):
  """`(init, step)` of the AV decode loop.

  `step(target_params, drafter_params, state) -> (state, num_verified [B])` is jitted;
  the models' structure (graph definitions) is static, their parameters are arguments.
  """
  greedy = cfg.temperature <= 0
  est = av_jax.online_estimator(cfg.max_draft, refit_interval=4)
  planner = av_jax.make_planner(
      policy=av_jax.exact_policy(drafter_kind="autoregressive", greedy=greedy))
  B, K = cfg.num_slots, cfg.max_draft

  def init(prompt: jax.Array, key: jax.Array) -> LoopState:  # prompt [B, W]
    return LoopState(context=jnp.asarray(prompt, jnp.int32),
                     output=jnp.full((B, cfg.max_new), -1, jnp.int32),
                     length=jnp.zeros((B,), jnp.int32), estimator=est.init(),
                     planner=planner.init(), key=key)

  @jax.jit
  def step(target_params: nnx.State, drafter_params: nnx.State, state: LoopState):
    target = nnx.merge(target_def, target_params)
    drafter = nnx.merge(drafter_def, drafter_params)
    key, key_draft, key_verify = jax.random.split(state.key, 3)
    active = state.length < cfg.max_new

    # 1. Draft, and the feature on the distribution the drafter sampled from.
    draft_logits, draft_probs, draft_tokens = draft(drafter, state.context, key_draft, cfg)
    features = av_jax.logit_qmax(draft_logits, temperature=cfg.temperature, top_p=cfg.top_p)
    # 2. Predict acceptance and plan how many drafts each slot verifies.
    probs = est.predict(state.estimator, features)
    plan, planner_state = planner.plan(state.planner, probs, cost, active=active)
    # 3. The target scores the drafts (a server packs only the verified rows).
    target_logits = target(verify_windows(state.context, draft_tokens, cfg.window))
    out = av_jax.rejection_sample(key_verify, draft_probs=draft_probs,
                                  draft_tokens=draft_tokens,
                                  target_probs=sampling_probs(target_logits, cfg),
                                  num_verified=plan.num_verified)
    # 4. Learn from this step's labels (inactive slots give none).
    estimator = est.update(state.estimator, features, out.accepted,
                           out.labeled & active[:, None])

    # Append the emitted tokens; the context becomes the last W tokens.
    i = jnp.arange(K + 1)
    index = jnp.where((i < out.num_emitted[:, None]) & active[:, None],
                      state.length[:, None] + i, cfg.max_new)       # out of range: dropped
    output = state.output.at[jnp.arange(B)[:, None], index].set(out.tokens, mode="drop")
    seq = jnp.concatenate([state.context, jnp.maximum(out.tokens, 0)], axis=1)
    shift = jnp.where(active, out.num_emitted, 0)
    context = jnp.take_along_axis(seq, shift[:, None] + jnp.arange(cfg.window), axis=1)
    length = jnp.minimum(state.length + shift, cfg.max_new)
    new_state = LoopState(context=context, output=output, length=length,
                          estimator=estimator, planner=planner_state, key=key)
    return new_state, plan.num_verified

  return init, step


def profile(target: WindowLM, drafter: WindowLM, cfg: Config) -> av_jax.CostModel:
  """Cost tables from timing the target's packed forward and one drafting step."""
  target_def, target_params = nnx.split(target)
  drafter_def, drafter_params = nnx.split(drafter)
  verify = jax.jit(lambda p, windows: nnx.merge(target_def, p)(windows))
  drafting = jax.jit(lambda p, context, key: draft(nnx.merge(drafter_def, p), context, key, cfg))
  B, K, W = cfg.num_slots, cfg.max_draft, cfg.window
  return av_jax.profile_costs(
      verify, drafting,
      verify_args=lambda T: (target_params, jnp.zeros((T, W), jnp.int32)),  # T packed rows
      draft_args=(drafter_params, jnp.zeros((B, W), jnp.int32), jax.random.key(0)),
      buckets=(B, B * (K + 1) // 2, B * (K + 1)), num_slots=B, max_draft=K)


def generate(target: WindowLM, drafter: WindowLM, prompt: jax.Array, cfg: Config, *,
             cost: av_jax.CostModel, seed: int = 0) -> tuple[np.ndarray, LoopState, int]:
  """Decodes `cfg.max_new` tokens per slot; returns (tokens [B, max_new], state, steps)."""
  target_def, target_params = nnx.split(target)
  drafter_def, drafter_params = nnx.split(drafter)
  init, step = make_decoder(cfg, cost, target_def, drafter_def)
  state = init(prompt, jax.random.key(seed))
  steps = 0
  while bool(jnp.any(state.length < cfg.max_new)):
    state, _ = step(target_params, drafter_params, state)
    steps += 1
  return np.asarray(state.output), state, steps


def target_greedy(target: WindowLM, prompt: jax.Array, num_tokens: int) -> np.ndarray:
  """The target's own greedy decoding, one token at a time (the reference)."""
  graphdef, params = nnx.split(target)

  def one(params, context):
    token = jnp.argmax(nnx.merge(graphdef, params)(context), -1).astype(jnp.int32)
    return jnp.concatenate([context[:, 1:], token[:, None]], axis=1), token

  run = jax.jit(lambda params, context: jax.lax.scan(
      lambda c, _: one(params, c), context, None, length=num_tokens)[1])
  return np.asarray(run(params, jnp.asarray(prompt, jnp.int32)).T)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--greedy", action="store_true", help="greedy drafting and verification")
  args = parser.parse_args()
  cfg = Config(temperature=0.0 if args.greedy else 1.0)
  target, drafter = make_models(cfg)
  cost = profile(target, drafter, cfg)
  prompt = jnp.arange(cfg.num_slots * cfg.window).reshape(cfg.num_slots, cfg.window) % cfg.vocab
  tokens, state, steps = generate(target, drafter, prompt, cfg, cost=cost)
  print(f"{steps} steps for {cfg.max_new} tokens per slot "
        f"({cfg.max_new / steps:.2f} tokens per step)")
  print(f"estimator: slope {float(state.estimator.slope):.3f}, intercepts "
        f"{np.round(np.asarray(state.estimator.intercepts), 3).tolist()}")
  if args.greedy:
    same = np.array_equal(tokens, target_greedy(target, prompt, cfg.max_new))
    print(f"equals the target's own greedy decoding: {same}")
  print(tokens)


if __name__ == "__main__":
  main()
