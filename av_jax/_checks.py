"""Trace-time argument checks with messages that name the argument and the expectation.

Shapes, ranks and dtypes are static under `jax.jit`, so these checks cost nothing at run
time and fire at the first trace.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def rank_at_least(name: str, x: jax.Array, rank: int) -> None:
  if np.ndim(x) < rank:
    raise ValueError(f"{name}: expected rank >= {rank}, got shape {np.shape(x)}")


def rank(name: str, x: jax.Array, expected: int, letters: str = "") -> None:
  if np.ndim(x) != expected:
    what = f" [{','.join(letters)}]" if letters else ""
    raise ValueError(f"{name}: expected rank {expected}{what}, got shape {np.shape(x)}")


def shape(name: str, x: jax.Array, expected: Sequence[int | None], letters: str = "") -> None:
  """Checks `x.shape` against `expected`; None entries match any size."""
  actual = tuple(np.shape(x))
  expected = tuple(expected)
  ok = len(actual) == len(expected) and all(
      e is None or a == e for a, e in zip(actual, expected))
  if not ok:
    pretty = tuple("?" if e is None else e for e in expected)
    what = f" [{','.join(letters)}]" if letters else ""
    raise ValueError(f"{name}: expected shape {pretty}{what}, got {actual}")


def integer(name: str, x: jax.Array) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
    raise ValueError(f"{name}: expected an integer dtype, got {jnp.result_type(x)}")


def boolean(name: str, x: jax.Array) -> None:
  if jnp.result_type(x) != jnp.bool_:
    raise ValueError(f"{name}: expected dtype bool, got {jnp.result_type(x)}")


def floating(name: str, x: jax.Array) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"{name}: expected a floating dtype, got {jnp.result_type(x)}")
