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
import sys
import time

import jax
import numpy as np

from av_jax import compare as C
from av_jax import costs
from av_jax._flags import at_least, model_set, temperature, top_p
from av_jax import engine as E
from av_jax import models as M
from av_jax.engine import demo
from av_jax.engine import profile as prof
from av_jax.studies import run as studies


def check_lengths(parser: argparse.ArgumentParser, args) -> None:
  """Cross-flag checks: the cache must hold a prompt token, K drafts and the bonus."""
  k, max_len = getattr(args, "k", None), getattr(args, "max_len", None)
  if k is not None and max_len is not None and max_len < k + 3:
    parser.error(f"argument --max-len: expected >= --k + 3 = {k + 3} (a prompt token, "
                 f"K = {k} drafts, the bonus token and one new token), got {max_len}")


def _engine_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--models", default="default", type=model_set,
                 help="shipped model set name")
  p.add_argument("--drafter", default="eagle", choices=("draft_lm", "eagle", "block",
                                                        "block_head"))
  p.add_argument("--mode", default="av",
                 choices=("target_only", "fixed", "av", "av_head", "oracle"))
  p.add_argument("--slots", type=at_least(1), default=8, help="B, concurrent request slots")
  p.add_argument("--k", type=at_least(1), default=8, help="K, maximum draft length")
  p.add_argument("--max-len", type=at_least(4), default=512,
                 help="cache positions per slot (prompt + output + K + 1)")
  p.add_argument("--temperature", type=temperature, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=top_p, default=0.95, help="nucleus mass in (0, 1]")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps-per-chunk", type=at_least(1), default=8,
                 help="decode steps between host syncs (streaming granularity)")
  p.add_argument("--no-profile", action="store_true",
                 help="skip start-up cost profiling (synthetic cost model)")


def _status(message: str) -> None:
  """One status line per phase, on stderr (the text stream stays on stdout)."""
  sys.stderr.write(f"[av-jax] {message}\n")
  sys.stderr.flush()


def _build(args, mode: str | None = None, *, status=lambda message: None):
  start = time.perf_counter()
  status(f"loading model set {args.models!r} with the {args.drafter} drafter ...")
  pair = M.load(args.models, drafter=args.drafter)
  config = E.EngineConfig(num_slots=args.slots, max_draft=args.k, max_len=args.max_len,
                          mode=mode or args.mode, temperature=args.temperature,
                          top_p=args.top_p, eos_id=pair.tokenizer.eos_id,
                          steps_per_chunk=args.steps_per_chunk)
  engine = E.make_engine(config, pair.cfg, pair.drafter)
  params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
  status(f"loaded in {time.perf_counter() - start:.1f} s")
  cost = None
  if not getattr(args, "no_profile", False):
    start = time.perf_counter()
    status(f"profiling step costs (B = {args.slots}, K = {args.k}, max_len = "
           f"{args.max_len}) ...")
    cost, profile = prof.profile_costs(engine, params)
    status(f"{prof.describe_source(profile)}; {time.perf_counter() - start:.1f} s")
  return pair, engine, params, cost


STATS_HELP = """\
print per-chunk statistics on stderr, each line after the text has reached a line end
(or at the end): budget = draft tokens the planner chose to verify per step, summed over
the active requests (at most active requests x K; a step that did not draft counts 0);
verified = draft tokens actually fed to the target per step (the budget's allocation plus
exploration); emitted/step = tokens produced per decode step (1 = no draft accepted);
tokens/s = the chunk's emitted tokens over its wall time (compilation excluded: it runs in
a warm-up before the timed generation)"""


def cmd_generate(args) -> None:
  pair, engine, params, cost = _build(args, status=_status)
  tok = pair.tokenizer
  prompt = tok.encode(args.prompt)
  K = engine.config.max_draft
  key = jax.random.PRNGKey(args.seed)
  start = time.perf_counter()
  _status("compiling the decode step (a short warm-up run) ...")
  E.generate(engine, params, [prompt], max_new_tokens=min(2, args.max_new), key=key,
             cost=cost)
  compile_s = time.perf_counter() - start
  _status(f"compiled in {compile_s:.1f} s; generating")
  out = sys.stdout
  out.write(args.prompt)
  out.flush()
  at_line_start = [args.prompt == "" or args.prompt.endswith("\n")]
  pending: list[str] = []  # stats lines waiting for the text to reach a line end
  shown = [0]
  start = time.perf_counter()
  last = [start]

  def flush_stats():
    if pending:
      sys.stderr.write("".join(pending))
      sys.stderr.flush()
      pending.clear()

  def on_chunk(state, info):
    length, plen = int(state.length[0]), int(state.prompt_len[0])
    new = np.asarray(state.tokens[0, plen + shown[0]:length]).tolist()
    text = tok.decode_bytes(new).decode("utf-8", errors="replace")
    shown[0] += len(new)
    out.write(text)
    out.flush()
    if text:
      at_line_start[0] = text.endswith("\n")
    if args.stats:
      now = time.perf_counter()
      emitted = int(np.sum(info.emitted))
      # What the allocation could use: the budget is at most R x K for R active requests.
      budget = np.minimum(np.asarray(info.budget), np.asarray(info.active) * K)
      budget = np.where(np.asarray(info.drafting), budget, 0)
      pending.append(
          f"[chunk] budget={np.mean(budget):.1f} verified={np.mean(info.verified):.1f} "
          f"emitted/step={np.mean(info.emitted):.2f} "
          f"tokens/s={emitted / max(now - last[0], 1e-9):.1f}\n")
      last[0] = now
      if at_line_start[0]:
        flush_stats()

  result = E.generate(engine, params, [prompt], max_new_tokens=args.max_new, key=key,
                      cost=cost, on_chunk=on_chunk)
  c = result.completions[0]
  if c.finish_reason == "error":
    raise SystemExit(c.error)
  elapsed = time.perf_counter() - start
  out.write("\n")
  out.flush()
  flush_stats()
  s = result.stats
  print(f"--- {len(c.tokens)} tokens in {elapsed:.2f} s ({len(c.tokens) / elapsed:.1f} tok/s, "
        f"compilation excluded; {compile_s:.1f} s compiling before), {s['steps']} steps, "
        f"{s['emitted'] / max(s['steps'], 1):.2f} tokens/step, verified {s['verified']} of "
        f"{s['draft_tokens']} drafts, finish={c.finish_reason}", file=sys.stderr)


def cmd_profile(args) -> None:
  args.no_profile = True
  _, engine, params, _ = _build(args)
  _, profile = prof.profile_costs(engine, params, refresh=args.refresh)
  print(prof.format_profile(profile))


# The demo's concurrencies: a low one, where speculation pays on this CPU, and a high one,
# where the target is compute-bound and it does not (`--concurrency`; `--slots N` alone: N).
DEMO_CONCURRENCY = "1,32"


def cmd_demo(args) -> None:
  """The main job: a short preset of `compare` (the demo's flags mapped onto it)."""
  start = time.perf_counter()
  text = args.concurrency or (str(args.slots) if args.slots else DEMO_CONCURRENCY)
  concurrency = C._int_list("concurrency", text)  # pylint: disable=protected-access
  print(f"av_jax demo = av-jax compare --drafter {args.drafter} --workload {args.workload} "
        f"--concurrency {','.join(map(str, concurrency))} --arms {args.arms} --repeats {args.repeats} "
        f"--clock {args.clock} (models={args.models}, K={args.k}, {args.requests} requests x "
        f"{args.max_new} tokens, device={jax.devices()[0].device_kind})", flush=True)
  result = C.compare(drafters=args.drafter, workloads=args.workload, concurrency=concurrency,
                     arms=args.arms, repeats=args.repeats, clock=args.clock,
                     models=args.models, max_draft=args.k, max_new=args.max_new,
                     prompt_len=args.prompt_len,
                     requests_per_slot=max(1, args.requests // max(concurrency)),
                     temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                     log=lambda line: print(line, flush=True) if not line.startswith(
                         "  compiled") else None)
  if args.json:
    C.write_json(args.json, result)
  print(f"done in {time.perf_counter() - start:.1f} s"
        + (f"; JSON in {args.json}" if args.json else ""))


def _demo_preset_args(p: argparse.ArgumentParser) -> None:
  """The compare flags of the demo preset beyond the demo's own."""
  p.add_argument("--arms", type=_arms_type, default="target_only,fixed:8,av",
                 help="comma-separated arms (av-jax compare --arms)")
  p.add_argument("--clock", type=_clock_type, default="wall",
                 help="wall, DEVICE:SHAPE (e.g. h200:llama3-8b) or a cost-table .json")
  p.add_argument("--json", default=None, help="also write compare's JSON here")
  p.add_argument("--concurrency", type=_positive_ints, default=None,
                 help=f"comma-separated concurrencies (default {DEMO_CONCURRENCY}, or --slots "
                      "alone): the low one shows speculation paying, the high one where the "
                      "target is compute-bound and it does not")
  p.set_defaults(slots=None)  # --slots N alone runs concurrency N


def _checked(parse):
  """An argparse `type` from a parser that raises ValueError (message kept)."""
  def check(text):
    try:
      parse(text)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
    return text
  return check


_arms_type = _checked(C.parse_arms)
_clock_type = _checked(C.parse_clock)


def _positive_ints(text: str) -> str:
  return _checked(lambda t: C._int_list("concurrency", t))(text)  # pylint: disable=protected-access


def _positive_int(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
  return int(text)


def _compare_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--models", default="default", help="shipped model set name")
  p.add_argument("--drafter", default="block", type=_checked(
      lambda t: C._names("drafter", t, M.KINDS)),  # pylint: disable=protected-access
                 help=f"drafter kinds, comma-separated, of {list(M.KINDS)}")
  p.add_argument("--workload", default="mixed", type=_checked(
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
  p.add_argument("--json", default=None, help="write settings and results here")


def cmd_compare(args) -> None:
  result = C.compare(drafters=args.drafter, workloads=args.workload,
                     concurrency=args.concurrency, arms=args.arms, repeats=args.repeats,
                     clock=args.clock, models=args.models, max_draft=args.k,
                     max_new=args.max_new, prompt_len=args.prompt_len,
                     requests_per_slot=args.requests_per_slot, max_len=args.max_len,
                     temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                     context_len=args.context_len, warm_start=args.warm_start,
                     drafter_backlog=args.drafter_backlog, num_buckets=args.num_buckets,
                     steps_per_chunk=args.steps_per_chunk,
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
  _engine_args(g)
  g.add_argument("--prompt", required=True)
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
  d = sub.add_parser("demo", help="AV against fixed K on the shipped models (main job: a "
                                  "short av-jax compare)")
  demo.add_args(d)
  _demo_preset_args(d)
  d.set_defaults(func=cmd_demo)
  b = sub.add_parser("bench", help="the studies suite: report, plots, JSON in reports/")
  studies.add_args(b)
  b.set_defaults(func=cmd_bench)
  args = parser.parse_args(argv)
  check_lengths({"generate": g, "profile": p}.get(args.command, parser), args)
  args.func(args)


if __name__ == "__main__":
  main()
