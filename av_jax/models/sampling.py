"""Drawing tokens from the distribution a sampler actually uses (temperature, then top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from av_jax.sampling import sampling_log_probs


def sampling_probs(logits: jax.typing.ArrayLike, *, temperature: jax.typing.ArrayLike,
                   top_p: jax.typing.ArrayLike) -> jax.Array:
  """`[..., V]` probabilities tokens are drawn from; temperature <= 0 is a greedy point mass.

  The greedy point mass is the one-hot arg-max (what verification must use as q or p);
  features for greedy drafting come from `av_jax.sampling.sampling_log_probs` instead.
  """
  logits = jnp.asarray(logits, jnp.float32)
  temperature = jnp.asarray(temperature, jnp.float32)
  probs = jnp.exp(sampling_log_probs(logits, temperature=temperature, top_p=top_p))
  greedy = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=probs.dtype)
  return jnp.where((temperature <= 0)[..., None], greedy, probs)


def sample_tokens(key: jax.Array, logits: jax.typing.ArrayLike, *,
                  temperature: jax.typing.ArrayLike, top_p: jax.typing.ArrayLike) -> jax.Array:
  """Draws `[...]` int32 tokens from `logits [..., V]`: temperature, then top-p; greedy if T <= 0.

  `temperature` and `top_p` are scalars or `[...]` arrays (traced, no recompile).
  """
  logits = jnp.asarray(logits, jnp.float32)
  temperature = jnp.asarray(temperature, jnp.float32)
  log_probs = sampling_log_probs(logits, temperature=temperature, top_p=top_p)
  drawn = jax.random.categorical(key, log_probs, axis=-1)
  return jnp.where(temperature <= 0, jnp.argmax(logits, -1), drawn).astype(jnp.int32)


def sample_with_log_probs(key: jax.Array, logits: jax.typing.ArrayLike, *,
                          temperature: jax.typing.ArrayLike, top_p: jax.typing.ArrayLike
                          ) -> tuple[jax.Array, jax.Array]:
  """`sample_tokens`, also returning the `[..., V]` log-probabilities drawn from.

  The same draws as `sample_tokens` with the same key. Callers that need the sampling
  distribution afterwards (the engine scores and verifies drafts against it) reuse it
  instead of running temperature and top-p a second time.
  """
  logits = jnp.asarray(logits, jnp.float32)
  temperature = jnp.asarray(temperature, jnp.float32)
  log_probs = sampling_log_probs(logits, temperature=temperature, top_p=top_p)
  drawn = jax.random.categorical(key, log_probs, axis=-1)
  tokens = jnp.where(temperature <= 0, jnp.argmax(logits, -1), drawn).astype(jnp.int32)
  return tokens, log_probs
