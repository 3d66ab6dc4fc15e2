"""Golden engine outputs: record them, or compare a fresh run with the recorded ones.

Each case runs `av_jax.engine.generate` for fixed seeds and records, bit for bit, the
emitted tokens, the estimator state after every chunk, every step's record (`StepInfo`)
and the engine's running statistics. `tests/test_golden.py` re-runs the cases and
compares with the committed files, so a refactor that changes behaviour is caught.

    python -m tests.golden.make_golden --check    # compare every case (~4 min on CPU)
    python -m tests.golden.make_golden            # rewrite all three golden files
    python -m tests.golden.make_golden --default  # only the `default` model-set case

Three files: `tiny.json` (random `tiny` models from `tests/_engine_fixtures.py`, every
mode x drafter kind at temperatures 0 and 1, plus a few settings that take other code
paths), `simulate.json` (the synthetic simulator, every mode) and `default.json` (one
case on the shipped `default` checkpoints, keyed by their SHA-256 so that a retrained
model set reads as such, not as a behaviour change: regenerate it with `--default`).
Run from the repository root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import zlib

import jax
import numpy as np

from av_jax import engine as E
from av_jax import models as M
from av_lab import simulate
from av_jax.estimator import EstimatorConfig
from av_jax.models import checkpoint
from av_jax.sampling import Sampling
from av_jax.selection import make_cost_model
from tests import _engine_fixtures as fx

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_PATH = os.path.join(HERE, "tiny.json")
SIMULATE_PATH = os.path.join(HERE, "simulate.json")
DEFAULT_PATH = os.path.join(HERE, "default.json")
REGENERATE = "python -m tests.golden.make_golden"

PROMPTS = [[1, 2, 3], [4], list(range(5, 15)), [7, 7, 7, 7]]
MAX_NEW = [7, 10, 5, 8]
BASE = dict(num_slots=3, max_draft=3, max_len=40, steps_per_chunk=4, refit_interval=3,
            num_buckets=3)
KINDS = ("draft_lm", "eagle", "block", "block_head")
DEFAULT_KIND = "block_head"


def _tiny_cases() -> dict[str, dict]:
  cases = {}
  for kind in KINDS:
    modes = ("target_only", "fixed", "av", "oracle") + (("av_head",) if kind == "block_head"
                                                         else ())
    for mode in modes:
      for temperature in (0.0, 1.0):
        cases[f"{kind}/{mode}/t{temperature:g}"] = dict(kind=kind, mode=mode,
                                                         temperature=temperature)
  # Other code paths, combined to keep the runs few: nucleus sampling with an EOS stop,
  # recorded features, verify groups, and a cost table under which drafting never pays.
  cases["eagle/av/top_p_eos"] = dict(kind="eagle", mode="av", temperature=1.0, top_p=0.7,
                                     eos_id=5)
  cases["block/av/top_p_features"] = dict(kind="block", mode="av", temperature=1.0,
                                          top_p=0.7, record_features=True)
  cases["draft_lm/av/groups"] = dict(kind="draft_lm", mode="av", temperature=1.0,
                                     num_slots=4, verify_groups=2)
  for kind in ("block", "block_head"):
    mode = "av_head" if kind == "block_head" else "av"
    cases[f"{kind}/{mode}/dear_drafts"] = dict(kind=kind, mode=mode, temperature=1.0,
                                               cost="dear_drafts")
  return cases


TINY_CASES = _tiny_cases()
# The cases `tests/test_golden.py` re-runs in the primary suite (each compiles an engine,
# ~4 s on CPU): every mode, drafter kind, policy and temperature, and the extra paths.
# `python -m tests.golden.make_golden --check` compares every case.
FAST_CASES = ("eagle/av/top_p_eos", "block/av/top_p_features", "block_head/av_head/dear_drafts",
              "draft_lm/fixed/t0", "block/oracle/t1", "draft_lm/av/groups",
              "eagle/target_only/t0")


def engine_config(*, num_slots: int, max_draft: int, max_len: int, mode: str,
                  temperature: float, top_p: float = 1.0, eos_id: int = -1,
                  refit_interval: int, steps_per_chunk: int, num_buckets: int = 4,
                  verify_groups: int | None = None,
                  record_features: bool = False) -> E.EngineConfig:
  """The engine config of a case's settings (the one place that builds it); the
  defaults are the library's."""
  return E.EngineConfig(
      num_slots=num_slots, max_draft=max_draft, max_len=max_len, mode=mode, eos_id=eos_id,
      sampling=Sampling(temperature=temperature, top_p=top_p),
      estimator=EstimatorConfig(refit_interval=refit_interval),
      programs=E.Programs(steps_per_chunk=steps_per_chunk, num_buckets=num_buckets,
                          verify_groups=verify_groups, record_features=record_features))


def _cost(name: str | None, config: E.EngineConfig):
  if name is None:
    return None
  B, K = config.num_slots, config.max_draft
  assert name == "dear_drafts", name
  return make_cost_model(np.full(B + 1, 100.0), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))


def _tree(x) -> dict:
  """A NamedTuple of arrays as {field: nested lists} (floats exact: float32 -> float64)."""
  return {name: np.asarray(value).tolist() for name, value in x._asdict().items()}


def _record(engine, params, *, cost, seed: int, prompts, max_new) -> dict:
  chunks = []
  on_chunk = lambda state, info: chunks.append(_tree(jax.device_get(state.estimator)))
  result = E.generate(engine, params, prompts, max_new_tokens=max_new, key=fx.key(seed),
                      cost=cost, keep_infos=True, on_chunk=on_chunk)
  infos = [_tree(info) for info in result.infos]
  steps = {name: [row for chunk in infos for row in chunk[name]] for name in infos[0]}
  return dict(tokens=[c.tokens for c in result.completions],
              finish=[c.finish_reason for c in result.completions],
              estimator=chunks, steps=steps, stats=result.stats)


def run_tiny(name: str) -> dict:
  """Runs one `TINY_CASES` case; returns what the golden file records for it."""
  case = dict(TINY_CASES[name])
  kind, cost = case.pop("kind"), case.pop("cost", None)
  cfg, drafter, params = fx.pair(kind)
  config = engine_config(**{**BASE, **case})
  engine = E.make_engine(config, cfg, drafter)
  seed = zlib.crc32(name.encode()) % 1000
  return _record(engine, params, cost=_cost(cost, config), seed=seed, prompts=PROMPTS,
                 max_new=MAX_NEW)


SIMULATE_MODES = ("target_only", "fixed", "av", "oracle")


def run_simulate(mode: str) -> dict:
  """A short synthetic run (`av_lab.simulate.run`): per-step stats and final estimator."""
  workload = simulate.SyntheticWorkload(num_slots=6, num_positions=3, vocab_size=16)
  cost = make_cost_model(np.full(7, 0.3), 1.0 + 0.05 * np.arange(6 * 4 + 1))
  stats, est = simulate.run(jax.random.key(3), workload, cost, mode=mode, num_steps=12,
                            refit_interval=4)
  return dict(steps=_tree(jax.device_get(stats)), estimator=_tree(jax.device_get(est)))


def default_hash(kind: str = DEFAULT_KIND) -> str:
  """SHA-256 of the shipped `default` target and `kind` drafter checkpoint files."""
  digest = hashlib.sha256()
  for part in ("target", kind):
    with open(checkpoint.path_of(checkpoint.assets_dir(), "default", part), "rb") as f:
      digest.update(f.read())
  return digest.hexdigest()


def run_default() -> dict:
  """One AV run on the shipped `default` model set (confidence-head drafter, sampling)."""
  pair = M.load("default", drafter=DEFAULT_KIND)
  config = engine_config(num_slots=2, max_draft=4, max_len=64, steps_per_chunk=4,
                         refit_interval=3, mode="av", temperature=1.0)
  engine = E.make_engine(config, pair.cfg, pair.drafter)
  params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
  prompts = [pair.tokenizer.encode("def add(a, b):"), pair.tokenizer.encode("The ")]
  return dict(checkpoint_sha256=default_hash(), kind=DEFAULT_KIND,
              **_record(engine, params, cost=None, seed=0, prompts=prompts, max_new=[9, 6]))


# Fields renamed since the golden files were recorded: {recorded path: current name}.
RENAMED: dict[str, str] = {"/stats/drafted": "draft_tokens",   # EngineStats.draft_tokens
                           "/steps/drafted": "drafting"}       # StepInfo.drafting


def renamed(record, where: str = ""):
  """A recorded case under the current names (what a fresh run of it returns)."""
  if not isinstance(record, dict):
    return record
  return {RENAMED.get(f"{where}/{k}", k): renamed(v, f"{where}/{k}") for k, v in record.items()}


def differences(want, got, where: str = "", *, rtol: float = 0.0) -> list[str]:
  """Where `got` differs from the recorded `want`, bit for bit (JSON round trip).

  Every recorded field must be there and equal; fields added since are not compared.
  `rtol > 0`: floats need only agree to `rtol` (relative, with an absolute floor of
  `rtol` near zero); ints, bools and tokens stay exact.
  """
  if rtol > 0:
    got = json.loads(json.dumps(got, sort_keys=True))
    if _close(want, got, rtol):
      return []
  if isinstance(want, dict):
    if not isinstance(got, dict):
      return [f"{where}: expected a mapping, got {type(got).__name__}"]
    out = []
    for key, value in want.items():
      name = RENAMED.get(f"{where}/{key}", key)
      if name not in got:
        out.append(f"{where}/{key}: missing")
      else:
        out += differences(value, got[name], f"{where}/{key}", rtol=rtol)
    return out
  canon = lambda x: json.dumps(x, sort_keys=True)
  got = json.loads(canon(got))
  if canon(want) == canon(got):
    return []
  if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
    firsts = [i for i, (a, b) in enumerate(zip(want, got)) if canon(a) != canon(b)]
    return [f"{where}[{firsts[0]}]: recorded {canon(want[firsts[0]])[:200]}, got "
            f"{canon(got[firsts[0]])[:200]} ({len(firsts)} entries differ)"]
  return [f"{where}: recorded {canon(want)[:200]}, got {canon(got)[:200]}"]


def _close(want, got, rtol: float) -> bool:
  """Equal structure and exact non-floats; floats within `rtol` (see `differences`)."""
  if isinstance(want, dict):
    return (isinstance(got, dict) and want.keys() <= got.keys()
            and all(_close(v, got[k], rtol) for k, v in want.items()))
  if isinstance(want, list):
    return (isinstance(got, list) and len(want) == len(got)
            and all(_close(a, b, rtol) for a, b in zip(want, got)))
  if isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
    return abs(want - got) <= rtol * max(1.0, abs(want))
  return want == got and type(want) is type(got)


def load(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def check() -> int:
  """Re-runs every case against the committed files; prints differences; returns the
  number of failing cases."""
  failed = 0
  runs = [(f"tiny:{name}", want, lambda name=name: run_tiny(name))
          for name, want in load(TINY_PATH).items()]
  runs += [(f"simulate:{mode}", want, lambda mode=mode: run_simulate(mode))
           for mode, want in load(SIMULATE_PATH).items()]
  want = load(DEFAULT_PATH)
  if want["checkpoint_sha256"] != default_hash(want["kind"]):
    print(f"default: the checkpoints changed; regenerate with `{REGENERATE} --default`")
    failed += 1
  else:
    runs.append(("default", want, run_default))
  for name, want, run in runs:
    diff = differences(want, run())
    failed += bool(diff)
    print(f"{name}: {'ok' if not diff else 'DIFFERS'}", *diff[:5], sep="\n  ")
  return failed


def _write(path: str, data: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, sort_keys=True, separators=(",", ":"))
    f.write("\n")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--default", action="store_true", help="only the default model-set case")
  p.add_argument("--simulate", action="store_true", help="only the simulator cases")
  p.add_argument("--check", action="store_true",
                 help="compare every case with the committed files instead of writing")
  args = p.parse_args(argv)
  if args.check:
    raise SystemExit(1 if check() else 0)
  if args.simulate:
    _write(SIMULATE_PATH, {mode: run_simulate(mode) for mode in SIMULATE_MODES})
    print(f"wrote {SIMULATE_PATH}")
    return
  _write(SIMULATE_PATH, {mode: run_simulate(mode) for mode in SIMULATE_MODES})
  if not args.default:
    _write(TINY_PATH, {name: run_tiny(name) for name in TINY_CASES})
    print(f"wrote {TINY_PATH} ({len(TINY_CASES)} cases)")
  _write(DEFAULT_PATH, run_default())
  print(f"wrote {DEFAULT_PATH}")


if __name__ == "__main__":
  main()
