"""Cost profiling: tables are step functions of the bucket, monotone, cached on disk."""

import numpy as np
import pytest

from av_jax import engine as E
from av_jax.engine import profile as prof
from tests import _engine_fixtures as fx


def test_cost_model_from_profile_is_monotone_step_function():
  profile = dict(buckets=[4, 10, 20], bucket_ms=[2.0, 1.5, 5.0], draft_ms=0.7)
  with pytest.warns(UserWarning, match="verify_ms: not monotone"):  # repaired, not silently
    cost = prof.cost_model_from_profile(profile, num_slots=4, max_tokens=20)
  verify = np.asarray(cost.verify_ms)
  assert verify.shape == (21,)
  np.testing.assert_allclose(verify[:5], 2.0)      # T <= 4 costs the first bucket
  np.testing.assert_allclose(verify[5:11], 2.0)    # 1.5 repaired to the running max
  np.testing.assert_allclose(verify[11:], 5.0)
  np.testing.assert_allclose(cost.draft_ms, np.full(5, 0.7))


def test_profile_measures_every_bucket_and_caches(tmp_path):
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=32, mode="av",
                                        num_buckets=2), cfg, drafter)
  cost, profile = prof.profile_costs(engine, params, repeats=2, cache_dir=str(tmp_path))
  assert not profile["cached"] and profile["buckets"] == list(engine.buckets)
  assert all(ms > 0 for ms in profile["bucket_ms"]) and profile["draft_ms"] > 0
  assert np.all(np.diff(np.asarray(cost.verify_ms)) >= 0)
  again, cached = prof.profile_costs(engine, params, cache_dir=str(tmp_path))
  assert cached["cached"] and cached["bucket_ms"] == profile["bucket_ms"]
  np.testing.assert_array_equal(again.verify_ms, cost.verify_ms)
  # A corrupt cache entry is re-measured, not trusted.
  (path,) = tmp_path.iterdir()
  path.write_text("{not json")
  _, fresh = prof.profile_costs(engine, params, repeats=1, cache_dir=str(tmp_path))
  assert not fresh["cached"]
  assert "bucket T" in prof.format_profile(fresh)
