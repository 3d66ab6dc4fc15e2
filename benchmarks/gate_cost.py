"""The cost of a quiet AV step (its plan drafts for no slot) against a target-only step.

For each drafter and concurrency, times side by side in one process a target-only
engine chunk and an AV chunk in which no slot drafts (autoregressive
drafters catch up), repeats interleaved, and prints / writes the median ratio and its
range. Goal: <= 1.05 at every concurrency. Logic: `av_jax.engine.gate_cost`. A chunk is
the AV engine's backlog of steps by default (one absorb of a full backlog per slot);
`--backlog K+1` times the eager catch-up, `--steps` a shorter stretch.

    .venv/bin/python benchmarks/gate_cost.py --config tiny --concurrency 1,4 --repeats 3
    .venv/bin/python benchmarks/gate_cost.py --config default --json gate_cost.json
"""

from __future__ import annotations

import argparse
import json

import jax

from av_jax import models as M
from av_jax.engine import gate_cost


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="tiny", help="model set: tiny | default")
  p.add_argument("--drafters", default="draft_lm,eagle,block", help="drafter kinds")
  p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="slot counts B")
  p.add_argument("--repeats", type=int, default=10, help="interleaved timed chunks")
  p.add_argument("--max-draft", type=int, default=4, help="K")
  p.add_argument("--max-len", type=int, default=256, help="cache positions per slot")
  p.add_argument("--prompt-len", type=int, default=64, help="tokens prefilled per slot")
  p.add_argument("--backlog", type=int, default=None,
                 help="the AV engine's drafter_backlog (default 4 (K + 1); K + 1: eager)")
  p.add_argument("--steps", type=int, default=None,
                 help="steps per timed chunk (default: the backlog, one absorb per chunk)")
  p.add_argument("--json", default="", help="write the rows to this file")
  args = p.parse_args(argv)
  rows = gate_cost.measure_gate_cost(
      M.load_config(args.config), kinds=tuple(args.drafters.split(",")),
      concurrency=tuple(int(b) for b in args.concurrency.split(",")), repeats=args.repeats,
      max_draft=args.max_draft, max_len=args.max_len, prompt_len=args.prompt_len,
      backlog=args.backlog, steps=args.steps)
  print(f"device: {jax.devices()[0].device_kind}, models: {args.config}")
  print(gate_cost.format_rows(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(config=args.config, device=jax.devices()[0].device_kind, rows=rows), f,
                indent=1)


if __name__ == "__main__":
  main()
