"""`av-jax` command line: generate (streaming), profile (cost tables), compare (arms side
by side), demo (main job: a short compare), bench (the studies suite).

    av-jax generate --prompt "def fib(n):" --drafter eagle --mode av
    av-jax profile --drafter block --slots 16
    av-jax compare --drafter block --workload mixed --concurrency 1,4,16 \
        --arms target_only,fixed:2,fixed:8,av --clock h200:llama3-8b --json out.json
    av-jax demo
    av-jax bench --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time

_IMPORTED = time.perf_counter()  # the command's start (after `import av_jax`)

import jax  # pylint: disable=wrong-import-position
import numpy as np

from av_lab import compare as C
from av_jax import costs
from av_lab._flags import at_least, checked, model_set, temperature, top_p
from av_jax import engine as E
from av_jax import models as M
from av_lab import demo
from av_jax.engine import profile as prof
from av_jax.sampling import Sampling
from av_lab.studies import run as studies


def check_lengths(parser: argparse.ArgumentParser, args) -> None:
  """Cross-flag checks: the cache must hold a prompt token, K drafts and the bonus."""
  k, max_len = getattr(args, "k", None), getattr(args, "max_len", None)
  if k is not None and max_len is not None and max_len < k + 3:
    parser.error(f"argument --max-len: expected >= --k + 3 = {k + 3} (a prompt token, "
                 f"K = {k} drafts, the bonus token and one new token), got {max_len}")


def _engine_args(p: argparse.ArgumentParser, *, slots: int = 8, max_len: int = 512) -> None:
  p.add_argument("--models", default="default", type=model_set,
                 help="shipped model set name")
  p.add_argument("--drafter", default="eagle", choices=("draft_lm", "eagle", "block",
                                                        "block_head"))
  p.add_argument("--mode", default="av",
                 choices=("target_only", "fixed", "av", "av_head", "oracle"))
  p.add_argument("--slots", type=at_least(1), default=slots, help="B, concurrent request slots")
  p.add_argument("--k", type=at_least(1), default=8, help="K, maximum draft length")
  p.add_argument("--max-len", type=at_least(4), default=max_len,
                 help="cache positions per slot (prompt + output + K + 1)")
  p.add_argument("--temperature", type=temperature, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=top_p, default=0.95, help="nucleus mass in (0, 1]")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps-per-chunk", type=at_least(1), default=8,
                 help="decode steps between host syncs (streaming granularity)")


def _status(message: str) -> None:
  """One status line per phase, on stderr (the text stream stays on stdout)."""
  sys.stderr.write(f"[av-jax] {message}\n")
  sys.stderr.flush()


def _load(args, mode: str | None = None, *, status=lambda message: None):
  """The model pair, the engine of `mode` (default `args.mode`) and its parameters."""
  start = time.perf_counter()
  status(f"loading model set {args.models!r} with the {args.drafter} drafter ...")
  pair = M.load(args.models, drafter=args.drafter)
  config = E.EngineConfig(num_slots=args.slots, max_draft=args.k, max_len=args.max_len,
                          mode=mode or args.mode, eos_id=pair.tokenizer.eos_id,
                          sampling=Sampling(temperature=args.temperature, top_p=args.top_p),
                          programs=E.Programs(steps_per_chunk=args.steps_per_chunk))
  engine = E.make_engine(config, pair.cfg, pair.drafter)
  params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
  status(f"loaded in {time.perf_counter() - start:.1f} s")
  return pair, engine, params


def _build(args, mode: str | None = None, *, status=lambda message: None):
  """`_load`, then the engine's measured cost tables (`av_jax.engine.profile`)."""
  pair, engine, params = _load(args, mode, status=status)
  start = time.perf_counter()
  status(f"profiling step costs (B = {args.slots}, K = {args.k}, max_len = "
         f"{args.max_len}) ...")
  cost, profile = prof.profile_costs(engine, params)
  status(f"{prof.describe_source(profile)}; {time.perf_counter() - start:.1f} s")
  return pair, engine, params, cost


def step_costs(args, engine, params, *, status=lambda message: None):
  """The cost tables AV decides with, and a line saying where they came from.

  "modelled" (the default, ~3 s): `av_jax.costs.roofline_costs` of the shipped model
  shapes on this machine's measured rates (`costs.cpu_spec`), for this engine's buckets;
  "profiled": every verify bucket and drafter program timed (`av_jax.engine.profile`,
  minutes on a 2-core CPU, cached on disk); "synthetic": an affine stand-in
  (`core.default_cost`), right for correctness only.
  """
  cfg = engine.config
  if args.cost == "profiled":
    status(f"profiling step costs (B = {cfg.num_slots}, K = {cfg.max_draft}, max_len = "
           f"{cfg.max_len}) ...")
    cost, profile = prof.profile_costs(engine, params)
    return cost, prof.describe_source(profile)
  if args.cost == "synthetic":
    return None, "synthetic cost tables (an affine stand-in: --cost profiled measures them)"
  tables = C.machine_tables(args.models, args.drafter, cfg)
  return tables.cost, (f"cost tables {tables.label} (no profiling; --cost profiled "
                       "measures them)")


STATS_HELP = """\
print per-chunk statistics on stderr, each line after the text has reached a line end
(or at the end): budget = draft tokens the planner chose to verify per step, summed over
the active requests (at most active requests x K; a step that did not draft counts 0);
verified = draft tokens actually fed to the target per step (the budget's allocation plus
exploration); emitted/step = tokens produced per decode step (1 = no draft accepted);
tokens/s = the chunk's emitted tokens over its wall time (compilation excluded but for
the target-only tokens' first chunk, which includes compiling their program)"""


class _Handover(Exception):
  """Raised from a chunk callback: the speculative engine is ready to take over."""


class _Stream:
  """Writes the decoded text of request 0 as chunks arrive, with --stats lines held back
  until the text reaches a line end."""

  def __init__(self, tok, prompt_text: str, *, stats: bool, K: int, start: float):
    self.tok, self.stats, self.K, self.start = tok, stats, K, start
    self.tokens: list[int] = []  # generated so far (all phases)
    self.shown = 0               # of the current phase's request
    self.at_line_start = prompt_text == "" or prompt_text.endswith("\n")
    self.pending: list[str] = []
    self.first_s: float | None = None  # seconds from `start` to the first token
    self.last = time.perf_counter()
    sys.stdout.write(prompt_text)
    sys.stdout.flush()

  def flush_stats(self):
    if self.pending:
      sys.stderr.write("".join(self.pending))
      sys.stderr.flush()
      self.pending.clear()

  def on_chunk(self, state, info):
    length, plen = int(state.length[0]), int(state.prompt_len[0])
    new = np.asarray(state.tokens[0, plen + self.shown:length]).tolist()
    self.shown += len(new)
    self.tokens += new
    if new and self.first_s is None:
      self.first_s = time.perf_counter() - self.start
    text = self.tok.decode_bytes(new).decode("utf-8", errors="replace")
    sys.stdout.write(text)
    sys.stdout.flush()
    if text:
      self.at_line_start = text.endswith("\n")
    if self.stats:
      now = time.perf_counter()
      emitted = int(np.sum(info.emitted))
      # What the allocation could use: the budget is at most R x K for R active requests.
      budget = np.minimum(np.asarray(info.budget), np.asarray(info.active) * self.K)
      budget = np.where(np.asarray(info.drafting), budget, 0)
      self.pending.append(
          f"[chunk] budget={np.mean(budget):.1f} verified={np.mean(info.verified):.1f} "
          f"emitted/step={np.mean(info.emitted):.2f} "
          f"tokens/s={emitted / max(now - self.last, 1e-9):.1f}\n")
      self.last = now
      if self.at_line_start:
        self.flush_stats()


def cmd_generate(args) -> None:
  """Streams a continuation of the prompt.

  A speculative engine's drafting program takes the longest to compile (~20 s on a
  2-core CPU), so a speculative mode decodes its first `--plain-tokens` tokens with the
  target alone (a program that compiles in a few seconds) while a background thread
  prices the steps (`step_costs`) and compiles the speculative engine, which then
  continues from the text so far. Both sample every token from the target's
  distribution, so the handover changes when tokens arrive, not their distribution.
  Example: `--plain-tokens 16 --max-new 128`: 16 tokens from the target alone (the first
  after ~5 s), then 112 from AV.
  """
  start = _IMPORTED
  pair, engine, params = _load(args, status=_status)
  tok = pair.tokenizer
  prompt = tok.encode(args.prompt)
  K = engine.config.max_draft
  key = jax.random.PRNGKey(args.seed)
  ready = threading.Event()
  prepared: dict = {}
  overlap = engine.arm.drafts and args.plain_tokens > 0 and args.cost != "profiled"

  def prepare():
    try:
      began = time.perf_counter()
      prepared["cost"], prepared["source"] = step_costs(args, engine, params, status=_status)
      prepared["source"] += f"; {time.perf_counter() - began:.1f} s"
      if not overlap:  # else said at the handover, not in the middle of the streamed text
        _status(prepared["source"])
      began = time.perf_counter()
      # Compiles the engine's programs, prefill included at the length the handover
      # prefills (the prompt and the target-only tokens).
      handover = len(prompt) + (min(args.plain_tokens, args.max_new) if overlap else 0)
      warm = (prompt * (handover // max(len(prompt), 1) + 1))[:handover]
      E.generate(engine, params, [warm], max_new_tokens=min(2, args.max_new), key=key,
                 cost=prepared["cost"])
      prepared["compile_s"] = time.perf_counter() - began
    except BaseException as e:  # pylint: disable=broad-except
      prepared["error"] = e
    ready.set()

  plain_tokens = 0
  if overlap:
    _status(f"compiling the {args.mode} engine in the background; the first "
            f"{args.plain_tokens} tokens come from the target alone meanwhile")
  stream = _Stream(tok, args.prompt, stats=args.stats, K=K, start=start)
  if overlap:
    worker = threading.Thread(target=prepare, daemon=True)
    plain = E.make_engine(dataclasses.replace(engine.config, mode="target_only"), pair.cfg,
                          pair.drafter)

    def on_plain_chunk(state, info):
      stream.on_chunk(state, info)
      if worker.ident is None:  # not started yet
        # Started once the plain program runs: its compile and the rates `step_costs`
        # measures do not share the CPU with each other.
        worker.start()
      if ready.is_set():
        raise _Handover

    try:
      result = E.generate(plain, params, [prompt], max_new_tokens=min(args.plain_tokens,
                                                                      args.max_new),
                          key=key, on_chunk=on_plain_chunk)
    except _Handover:
      result = None
    plain_tokens = len(stream.tokens)
    if worker.ident is None:  # not started yet
      worker.start()
    if result is not None:  # the plain run finished first
      c = result.completions[0]
      if c.finish_reason == "error":
        raise SystemExit(c.error)
    ready.wait()
  else:
    _status(f"compiling the {args.mode} engine (a short warm-up run) ...")
    prepare()
  if "error" in prepared:
    raise prepared["error"]
  done = (plain_tokens >= args.max_new
          or (stream.tokens and stream.tokens[-1] == tok.eos_id))
  spec_start = time.perf_counter()
  finish, s = "length", None
  if not done:
    if overlap:
      if not stream.at_line_start:  # the status lines start a line of their own (stderr)
        sys.stderr.write("\n")
      stream.flush_stats()
      _status(f"{prepared['source']}")
      _status(f"{args.mode} engine ready (compiled in {prepared['compile_s']:.1f} s); "
              f"continuing after {plain_tokens} target-only tokens")
    else:
      _status(f"compiled in {prepared['compile_s']:.1f} s; generating")
    stream.shown = 0
    stream.last = time.perf_counter()  # chunk rates exclude the wait for the compile
    result = E.generate(engine, params, [prompt + stream.tokens],
                        max_new_tokens=args.max_new - plain_tokens,
                        key=jax.random.fold_in(key, 1), cost=prepared["cost"],
                        on_chunk=stream.on_chunk)
    c = result.completions[0]
    if c.finish_reason == "error":
      raise SystemExit(c.error)
    finish, s = c.finish_reason, result.stats
  elapsed = time.perf_counter() - spec_start
  sys.stdout.write("\n")
  sys.stdout.flush()
  stream.flush_stats()
  first = "none" if stream.first_s is None else f"{stream.first_s:.1f} s"
  line = (f"--- first tokens {first} after the command started; {len(stream.tokens)} tokens "
          f"({plain_tokens} target-only while compiling)")
  if s is not None:
    spec = len(stream.tokens) - plain_tokens
    line += (f"; {args.mode}: {spec} tokens in {elapsed:.2f} s ({spec / elapsed:.1f} tok/s), "
             f"{s['steps']} steps, {s['emitted'] / max(s['steps'], 1):.2f} tokens/step, "
             f"verified {s['verified']} of {s['draft_tokens']} drafts, finish={finish}")
  print(line, file=sys.stderr)


def cmd_profile(args) -> None:
  _, engine, params = _load(args)
  _, profile = prof.profile_costs(engine, params, refresh=args.refresh)
  print(prof.format_profile(profile))


def cmd_demo(args) -> None:
  """The main job (`av_lab.demo`)."""
  demo.main(args)


_arms_type = checked(C.parse_arms)
_clock_type = checked(C.parse_clock)


def _positive_ints(text: str) -> str:
  return checked(lambda t: C._int_list("concurrency", t))(text)  # pylint: disable=protected-access


def _positive_int(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
  return int(text)


def _compare_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--models", default="default", help="shipped model set name")
  p.add_argument("--drafter", default="block", type=checked(
      lambda t: C._names("drafter", t, M.KINDS)),  # pylint: disable=protected-access
                 help=f"drafter kinds, comma-separated, of {list(M.KINDS)}")
  p.add_argument("--workload", default="mixed", type=checked(
      lambda t: C._names("workload", t, C.workload_names())),  # pylint: disable=protected-access
                 help=f"workloads, comma-separated, of {list(C.workload_names())}")
  p.add_argument("--concurrency", default="1,2,4,8", type=_positive_ints,
                 help="comma-separated concurrencies (slots)")
  p.add_argument("--arms", default=C.DEFAULT_ARMS, type=_arms_type,
                 help="comma-separated arms: target_only, fixed:K, av, av_head, oracle "
                      "(av_jax.arms)")
  p.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per arm, interleaved")
  p.add_argument("--clock", default="wall", type=_clock_type,
                 help="wall, DEVICE:SHAPE (e.g. h200:llama3-8b; devices "
                      f"{list(costs.DEVICE_NAMES)}) or a cost-table .json file")
  p.add_argument("--context-len", type=_positive_int, default=C.DEFAULT_CONTEXT,
                 help="KV positions per request of a DEVICE:SHAPE clock")
  p.add_argument("--k", type=_positive_int, default=8, help="K of arms given without :K")
  p.add_argument("--max-new", type=_positive_int, default=48, help="tokens generated per request")
  p.add_argument("--prompt-len", type=_positive_int, default=32, help="prompt tokens")
  p.add_argument("--requests-per-slot", type=_positive_int, default=2,
                 help="requests per run = this x concurrency (at least 4)")
  p.add_argument("--max-len", type=int, default=None,
                 help="cache positions per slot (default prompt + output + K + 8)")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=0.95)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--warm-start", action="store_true",
                 help="fit the estimator on a warm-up run first; runs continue from it")
  p.add_argument("--drafter-backlog", type=_positive_int, default=None,
                 help="pending tokens an autoregressive drafter that skips drafting keeps before "
                      "absorbing them (default 4 (K + 1); 1: the eager catch-up, K + 1)")
  p.add_argument("--steps-per-chunk", type=_positive_int, default=8,
                 help="decode steps between host syncs; a freed slot is refilled only "
                      "there (1: every step, as a serving scheduler admits)")
  p.add_argument("--num-buckets", type=_positive_int, default=None,
                 help="verify buckets of every engine (default: the engine's)")
  p.add_argument("--depth-cap", action="store_true",
                 help="the av arm runs on the engine of the depth cap av_jax.policy.depth_cap "
                      "picks from its warm-up (needs --warm-start and a modelled clock)")
  p.add_argument("--wall-cost", default="profiled", choices=("profiled", "modelled"),
                 help="the tables AV plans with on the wall clock: profiled on this machine "
                      "(cached on disk; noisy where other work shares it) or modelled (the "
                      "roofline of the shipped shapes on this machine's measured rates, "
                      "as `make demo` plans)")
  p.add_argument("--json", default=None, help="write settings and results here")


def _wall_cost(args):
  """`compare`'s `wall_cost` for `--wall-cost`: None profiles the tables."""
  if args.wall_cost == "profiled":
    return None
  return lambda pair, engine: C.machine_tables(args.models, pair.drafter.kind,
                                               engine.config).cost


def cmd_compare(args) -> None:
  result = C.compare(drafters=args.drafter, workloads=args.workload,
                     concurrency=args.concurrency, arms=args.arms, repeats=args.repeats,
                     clock=args.clock, models=args.models, max_draft=args.k,
                     max_new=args.max_new, prompt_len=args.prompt_len,
                     requests_per_slot=args.requests_per_slot, max_len=args.max_len,
                     temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                     context_len=args.context_len, warm_start=args.warm_start,
                     drafter_backlog=args.drafter_backlog, num_buckets=args.num_buckets,
                     steps_per_chunk=args.steps_per_chunk, wall_cost=_wall_cost(args),
                     depth_cap=args.depth_cap,
                     log=lambda line: print(line, flush=True))
  if args.json:
    C.write_json(args.json, result)
    print(f"wrote {args.json} ({len(result['results'])} records)")


def cmd_bench(args) -> None:
  studies.run(args)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="av-jax", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate text, streaming, with per-step statistics",
                     description="Streams the continuation of --prompt to stdout; status "
                     "lines (loading, profiling, compiling) and --stats go to stderr.")
  _engine_args(g, slots=1, max_len=256)
  g.add_argument("--prompt", required=True)
  g.add_argument("--cost", default="modelled", choices=("modelled", "profiled", "synthetic"),
                 help="step-cost tables AV decides with: modelled (the roofline of the "
                      "shipped shapes on this machine's measured rates, ~3 s), profiled "
                      "(timed, minutes, cached on disk) or synthetic")
  g.add_argument("--plain-tokens", type=int, default=16,
                 help="tokens decoded by the target alone while the speculative engine "
                      "compiles (0: wait for it; ignored with --cost profiled)")
  g.add_argument("--max-new", type=at_least(1), default=128)
  g.add_argument("--stats", action="store_true", help=STATS_HELP)
  g.set_defaults(func=cmd_generate)
  p = sub.add_parser("profile", help="measure and print the cost tables")
  _engine_args(p)
  p.add_argument("--refresh", action="store_true", help="re-measure even if cached")
  p.set_defaults(func=cmd_profile)
  c = sub.add_parser("compare", help="any arms side by side, wall or modelled clock, JSON")
  _compare_args(c)
  c.set_defaults(func=cmd_compare)
  d = sub.add_parser("demo", help="main job: AV against the target alone and fixed K, "
                                  "low and high concurrency, modelled and wall clock")
  demo.add_args(d)
  d.set_defaults(func=cmd_demo)
  b = sub.add_parser("bench", help="the studies suite: report, plots, JSON in reports/")
  studies.add_args(b)
  b.set_defaults(func=cmd_bench)
  args = parser.parse_args(argv)
  check_lengths({"generate": g, "profile": p}.get(args.command, parser), args)
  args.func(args)


if __name__ == "__main__":
  main()
