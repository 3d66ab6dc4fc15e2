"""Run in a fresh process with 8 fake CPU devices (see test_sharding.py).

Decodes the same requests on one device and on a (4 data x 2 model) mesh with Explicit
axis types (Auto: tests/test_multiprocess.py), sampling, and prints a JSON verdict.
"""

import json

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from av_jax import engine as E  # noqa: E402
from av_jax.engine import sharding  # noqa: E402
from av_jax.estimator import EstimatorConfig  # noqa: E402
from av_jax.sampling import Sampling  # noqa: E402
from tests import _engine_fixtures as fx  # noqa: E402


def main() -> None:
  assert len(jax.devices()) == 8, jax.devices()
  out = {}
  prompts = [[1, 2, 3], [4], list(range(5, 22)), [7] * 6, [3, 9], [2] * 11]
  # Auto axes with a parallel drafter are covered across processes by
  # tests/test_multiprocess.py; here: Explicit axes with an autoregressive drafter.
  for kind, temperature, explicit in (("eagle", 1.0, True),):
    cfg, drafter, params = fx.pair(kind)
    engine = E.make_engine(E.EngineConfig(num_slots=4, max_draft=3, max_len=48, mode="av",
                                          sampling=Sampling(temperature=temperature),
                                          estimator=EstimatorConfig(refit_interval=3),
                                          programs=E.Programs(steps_per_chunk=4)), cfg, drafter)
    key = fx.key(3)
    single = E.generate(engine, params, prompts, max_new_tokens=12, key=key)
    mesh = sharding.make_mesh(4, 2, explicit=explicit)
    with jax.set_mesh(mesh):
      sharded = E.generate(engine, params, prompts, max_new_tokens=12, key=key, mesh=mesh)
    est = sharded.state.estimator
    replicas = [np.asarray(s.data) for s in est.intercepts.addressable_shards]
    cache_spec = sharded.state.target_cache.k.sharding.spec
    out[f"{kind}-T{temperature}-{'explicit' if explicit else 'auto'}"] = dict(
        equal=[c.tokens for c in single.completions] == [c.tokens for c in sharded.completions],
        refits=int(est.num_refits),
        replicas_identical=all(np.array_equal(r, replicas[0]) for r in replicas),
        num_replicas=len(replicas),
        coef_equal=bool(np.allclose(np.asarray(est.intercepts),
                                    np.asarray(single.state.estimator.intercepts), atol=1e-5)),
        cache_spec=str(cache_spec))
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main()
