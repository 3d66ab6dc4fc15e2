"""EngineConfig: a small, typed, nested, frozen dataclass; one name per setting."""

import dataclasses
import inspect
import json

import pytest

import av_jax
from av_jax import engine as E
from av_jax.engine import config as config_lib


def test_engine_config_is_small_and_nested():
  names = [f.name for f in dataclasses.fields(E.EngineConfig)]
  assert len(names) <= 10
  assert names == ["num_slots", "max_draft", "max_len", "mode", "policy", "eos_id",
                   "sampling", "estimator", "programs"]
  config = E.EngineConfig()
  assert isinstance(config.sampling, av_jax.Sampling)
  assert isinstance(config.estimator, av_jax.EstimatorConfig)
  assert isinstance(config.programs, E.Programs)
  assert E.Programs is config_lib.Programs and E.EngineConfig is config_lib.EngineConfig
  # Frozen and hashable: an engine holding it is a static argument of jax.jit.
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.num_slots = 4  # type: ignore[misc]
  assert hash(config) == hash(E.EngineConfig()) and config == E.EngineConfig()


@pytest.mark.parametrize("cls", [E.EngineConfig, E.Programs])
def test_every_setting_has_one_comment(cls):
  """Each field's line, or the line above it, holds a comment saying what it is."""
  lines = inspect.getsource(cls).splitlines()
  for field in dataclasses.fields(cls):
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{field.name}:"))
    assert "#" in lines[at] or lines[at - 1].strip().startswith("#"), field.name


def test_unknown_and_flat_names_are_refused():
  with pytest.raises(TypeError, match="bogus"):
    E.EngineConfig(bogus=1)  # type: ignore[call-arg]
  # The nested settings have one name each, on their own config: no flat aliases.
  for name, value in (("temperature", 0.0), ("top_p", 0.9), ("refit_interval", 10),
                      ("num_buckets", 2), ("steps_per_chunk", 4), ("verify_groups", 2)):
    with pytest.raises(TypeError, match=name):
      E.EngineConfig(**{name: value})
    assert not hasattr(E.EngineConfig(), name)
  assert not hasattr(E.EngineConfig(), "greedy")  # `sampling.greedy`
  with pytest.raises(TypeError):
    E.EngineConfig(8)  # type: ignore[misc]  # keyword-only
  with pytest.raises(TypeError, match="temperature"):
    E.Programs(temperature=0.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("settings,match", [
    (dict(sampling=0.5), r"^sampling: expected a Sampling, got 0.5"),
    (dict(estimator=None), r"^estimator: expected a EstimatorConfig, got None"),
    (dict(programs={"num_buckets": 2}), r"^programs: expected a Programs, got \{"),
    (dict(programs=av_jax.Sampling()), r"^programs: expected a Programs"),
    (dict(num_slots=0), r"^num_slots: expected an int >= 1, got 0"),
    (dict(max_draft=2.0), r"^max_draft: expected an int >= 1"),
    (dict(max_draft=8, max_len=10), r"^max_len: expected an int >= max_draft \+ 3 = 11"),
    (dict(eos_id="2"), r"^eos_id: expected an int"),
    (dict(mode="bogus"), r"^mode: expected one of"),
    (dict(policy="bogus"), r"^policy: expected one of"),
    (dict(num_slots=8, programs=E.Programs(verify_groups=3)),
     r"^programs\.verify_groups: expected a divisor of num_slots = 8, got 3"),
    (dict(num_slots=8, programs=E.Programs(buckets=(6, 12), verify_groups=4)),
     r"^programs\.buckets: with verify_groups = 4"),
    (dict(num_slots=4, programs=E.Programs(draft_buckets=(2, 5))),
     r"^programs\.draft_buckets: expected sizes in \[1, num_slots = 4\]"),
    (dict(max_draft=4, programs=E.Programs(drafter_backlog=4)),
     r"^programs\.drafter_backlog: expected an int >= max_draft \+ 1 = 5"),
])
def test_bad_values_are_refused_naming_the_argument(settings, match):
  with pytest.raises(ValueError, match=match):
    E.EngineConfig(**settings)


@pytest.mark.parametrize("settings,match", [
    (dict(num_buckets=0), r"^num_buckets: expected an int >= 1, got 0"),
    (dict(buckets=()), r"^buckets: expected None or a non-empty tuple of ints >= 1"),
    (dict(buckets=(0, 4)), r"^buckets: expected"),
    (dict(draft_buckets="4"), r"^draft_buckets: expected"),
    (dict(drafter_backlog=True), r"^drafter_backlog: expected an int >= 1"),
    (dict(verify_groups=2.0), r"^verify_groups: expected an int >= 1"),
    (dict(steps_per_chunk=0), r"^steps_per_chunk: expected an int >= 1"),
    (dict(quiet_program="yes"), r"^quiet_program: expected a bool"),
    (dict(record_features=1), r"^record_features: expected a bool"),
])
def test_bad_program_values_are_refused_naming_the_argument(settings, match):
  with pytest.raises(ValueError, match=match):
    E.Programs(**settings)


def test_sizes_given_as_lists_are_kept_as_tuples():
  programs = E.Programs(buckets=[8, 16], draft_buckets=[2, 4])
  assert programs.buckets == (8, 16) and programs.draft_buckets == (2, 4)
  assert programs == E.Programs(buckets=(8, 16), draft_buckets=(2, 4))
  hash(E.EngineConfig(programs=programs))


def test_replace_on_the_nested_configs():
  config = E.EngineConfig(num_slots=8, max_draft=8)
  assert config.bucket_sizes() == (8, 17, 35, 72)
  two = dataclasses.replace(config, programs=dataclasses.replace(config.programs,
                                                                 num_buckets=2))
  assert two.programs.num_buckets == 2 and two.bucket_sizes() == (8, 72)
  assert two.programs.steps_per_chunk == config.programs.steps_per_chunk
  assert config.programs.num_buckets == 4  # the original is unchanged
  greedy = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling,
                                                                    temperature=0.0))
  assert greedy.sampling.greedy and not config.sampling.greedy
  assert greedy.sampling.top_p == config.sampling.top_p
  # replace validates again, across the nested configs too.
  with pytest.raises(ValueError, match=r"^programs\.drafter_backlog"):
    dataclasses.replace(config, programs=E.Programs(drafter_backlog=4))
  with pytest.raises(ValueError, match=r"^programs\.verify_groups"):
    dataclasses.replace(config, num_slots=6, programs=E.Programs(verify_groups=4))
  with pytest.raises(TypeError, match="temperature"):
    dataclasses.replace(config, temperature=0.0)


def test_derived_sizes():
  config = E.EngineConfig(num_slots=8, max_draft=4, programs=E.Programs(
      verify_groups=2, draft_buckets=(3,), drafter_backlog=7))
  assert config.groups == 2 and E.EngineConfig().groups == 1
  assert config.group_bucket_sizes()[-1] == 4 * 5 and config.bucket_sizes()[-1] == 8 * 5
  assert config.draft_bucket_sizes() == (3, 8)
  assert config.pending_width() == 7 and E.EngineConfig(max_draft=4).pending_width() == 20


def test_asdict_is_nested_and_json_able():
  config = E.EngineConfig(programs=E.Programs(buckets=(8, 16)))
  blob = dataclasses.asdict(config)
  assert blob["sampling"] == {"temperature": 1.0, "top_p": 1.0}
  assert blob["programs"]["buckets"] == (8, 16) and blob["estimator"]["refit_interval"] == 100
  assert json.loads(json.dumps(blob))["programs"]["buckets"] == [8, 16]
