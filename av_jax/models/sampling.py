"""Drawing tokens from the distribution a sampler actually uses (temperature, then top-p).

A temperature given as a Python number is static: at <= 0 (greedy) the draw is the
arg-max and neither the softmax nor the nucleus is computed where the result does not
need them; above 0 no greedy branch is built. Arrays select per row at run time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from av_jax.sampling import check_options, sampling_log_probs


def _static(temperature) -> bool:
  return isinstance(temperature, (int, float))


def sampling_probs(logits: jax.typing.ArrayLike, *, temperature: jax.typing.ArrayLike,
                   top_p: jax.typing.ArrayLike) -> jax.Array:
  """`[..., V]` probabilities tokens are drawn from; temperature <= 0 is a greedy point mass.

  The greedy point mass is the one-hot arg-max (what verification must use as q or p);
  features for greedy drafting come from `av_jax.sampling.sampling_log_probs` instead.
  """
  logits = jnp.asarray(logits, jnp.float32)
  greedy = lambda: jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
  if _static(temperature) and temperature <= 0:
    check_options(logits, temperature, top_p)
    return greedy()
  probs = jnp.exp(sampling_log_probs(logits, temperature=temperature, top_p=top_p))
  if _static(temperature):
    return probs
  temperature = jnp.asarray(temperature, jnp.float32)
  return jnp.where((temperature <= 0)[..., None], greedy(), probs)


def _draw(key, logits, log_probs, temperature) -> jax.Array:
  """The sampled token of each row, or the arg-max where temperature <= 0."""
  if _static(temperature) and temperature <= 0:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  drawn = jax.random.categorical(key, log_probs, axis=-1)
  if _static(temperature):
    return drawn.astype(jnp.int32)
  temperature = jnp.asarray(temperature, jnp.float32)
  return jnp.where(temperature <= 0, jnp.argmax(logits, -1), drawn).astype(jnp.int32)


def sample_tokens(key: jax.Array, logits: jax.typing.ArrayLike, *,
                  temperature: jax.typing.ArrayLike, top_p: jax.typing.ArrayLike) -> jax.Array:
  """Draws `[...]` int32 tokens from `logits [..., V]`: temperature, then top-p; greedy if T <= 0.

  `temperature` and `top_p` are scalars or `[...]` arrays (traced, no recompile).
  """
  logits = jnp.asarray(logits, jnp.float32)
  if _static(temperature) and temperature <= 0:
    check_options(logits, temperature, top_p)
    return _draw(key, logits, None, temperature)
  log_probs = sampling_log_probs(logits, temperature=temperature, top_p=top_p)
  return _draw(key, logits, log_probs, temperature)


def sample_with_log_probs(key: jax.Array, logits: jax.typing.ArrayLike, *,
                          temperature: jax.typing.ArrayLike, top_p: jax.typing.ArrayLike
                          ) -> tuple[jax.Array, jax.Array]:
  """`sample_tokens`, also returning the `[..., V]` log-probabilities drawn from.

  The same draws as `sample_tokens` with the same key. Callers that need the sampling
  distribution afterwards (the engine scores and verifies drafts against it) reuse it
  instead of running temperature and top-p a second time. Greedy rows return the
  temperature-1 distribution (with top-p), which the features read.
  """
  logits = jnp.asarray(logits, jnp.float32)
  log_probs = sampling_log_probs(logits, temperature=temperature, top_p=top_p)
  return _draw(key, logits, log_probs, temperature), log_probs
