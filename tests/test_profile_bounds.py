"""The engine's profile times the shapes the engine runs, refuses one that misses the
planner's shapes, and says what it timed."""

import numpy as np
import pytest

from av_jax import engine as E
from av_jax.engine import profile as prof
from tests import _engine_fixtures as fx


def test_a_profile_short_of_the_largest_step_is_refused():
  profile = dict(buckets=[2, 4], bucket_ms=[1.0, 2.0], draft_ms=0.5)
  with pytest.raises(ValueError, match=r"profile: its largest bucket is 4 tokens, the planner "
                                       r"prices steps of up to 6: T = 5..6 are missing"):
    prof.cost_model_from_profile(profile, num_slots=2, max_tokens=6)
  # Negative control: one that holds the largest step is accepted.
  cost = prof.cost_model_from_profile(dict(profile, buckets=[2, 6]), num_slots=2, max_tokens=6)
  assert np.shape(cost.verify_ms) == (7,)


def test_the_printout_says_what_was_timed():
  profile = dict(device_kind="cpu", repeats=3, draft_ms=0.5, buckets=[2, 4, 6],
                 bucket_ms=[1.0, 1.5, 2.0], skipped_buckets=[12, 24], cached=False, path="")
  text = prof.format_profile(profile)
  assert ("timed: verify at T = 2, 4, 6 (the buckets up to the largest step, 6 tokens), "
          "not 12, 24 (never run); drafter at all slots") in text
  gated = dict(profile, skipped_buckets=[], draft_buckets=[1, 2], draft_bucket_ms=[0.3, 0.5])
  assert "timed: verify at T = 2, 4, 6 (the buckets up to the largest step, 6 tokens); " \
         "drafter at E = 1, 2 drafting slots" in prof.format_profile(gated)


def test_buckets_past_the_largest_step_are_not_timed(tmp_path):
  cfg, drafter, params = fx.pair("block")
  # Two slots of K = 2 pack 6 tokens at most: the configured 12 and 24 never run.
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=32, mode="av",
                                        programs=E.Programs(buckets=(2, 4, 6, 12, 24))),
                         cfg, drafter)
  cost, profile = prof.profile_costs(engine, params, repeats=1, cache_dir=str(tmp_path))
  assert profile["buckets"] == [2, 4, 6] and profile["skipped_buckets"] == [12, 24]
  assert len(profile["bucket_ms"]) == 3
  assert np.shape(cost.verify_ms) == (7,)
  assert "not 12, 24 (never run)" in prof.format_profile(profile)
