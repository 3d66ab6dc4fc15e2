"""Shared test fixtures: a jit/no-jit switch for pure functions."""

import jax
import pytest


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Returns `jax.jit` or the identity, so each test runs both ways."""
  if request.param:
    return jax.jit
  return lambda fn, **kwargs: fn
