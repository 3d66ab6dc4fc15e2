"""The lab's policy parts that the replay ground tried and did not adopt
(`av_lab.ablations`) do what their decision records say they do."""

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import policy as P
from av_lab import ablations


def test_request_offsets_learn_what_the_features_do_not_say():
  # Every request drafts the same feature; half of them are accepted with probability 0.9,
  # half 0.1. The features cannot tell them apart (the negative control: the plain lagged
  # memory predicts both halves alike); each request's offset, fitted on its own labels,
  # does. A request admitted afterwards starts from the shared prediction again.
  K, B, steps = 2, 16, 120
  rng = np.random.default_rng(0)
  rate = np.where(np.arange(B) < B // 2, 0.9, 0.1)[:, None]
  predicted = {}
  for name, part in (("offsets", ablations.lagged_with_offsets(
                         P.online_estimator(K, refit_interval=16))),
                     ("plain", P.lagged_features(P.online_estimator(K, refit_interval=16)))):
    update, state = jax.jit(part.update), part.init(B, K)
    for _ in range(steps):
      accepted = rng.random((B, K)) < rate
      accepted[:, 1] &= accepted[:, 0]
      labeled = np.ones((B, K), bool)
      labeled[:, 1] = accepted[:, 0]
      state = update(state, P.StepOutcome(
          features=jnp.zeros((B, K)), drafted=jnp.ones((B, K), bool),
          accepted=jnp.asarray(accepted), labeled=jnp.asarray(labeled),
          step_ms=jnp.float32(1.0), explore_ms=jnp.float32(0.0)))
    predicted[name] = np.asarray(part.predict(state))
    if name == "offsets":
      policy = P.make_policy(K, drafter_kind="autoregressive", memory=part)
      fresh = policy.admit(policy.init(B)._replace(memory=state), jnp.arange(B) == 0)
      shared = np.asarray(P.lagged_features(P.online_estimator(K)).predict(
          fresh.memory._replace(lag=fresh.memory.lag[0])))
      np.testing.assert_allclose(np.asarray(part.predict(fresh.memory))[0], shared[0],
                                 rtol=1e-6)
  easy, hard = predicted["offsets"][:B // 2, 0], predicted["offsets"][B // 2:, 0]
  assert easy.min() > 0.7 and hard.max() < 0.3, (easy, hard)
  plain = predicted["plain"][:, 0]
  assert plain.max() - plain.min() < 1e-6
