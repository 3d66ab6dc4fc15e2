"""Retrains a model set (tokenizer, target, every drafter) and writes it to av_jax/assets.

Usage:
  python benchmarks/train_models.py --config default          # ~30-40 min on a 2-core CPU
  python benchmarks/train_models.py --config tiny --out /tmp/tiny
  python benchmarks/train_models.py --config default --resume  # after a stop: continues
                                                               # from the last checkpoint

Seeded: the same config, interpreter (its stdlib is the `code` corpus) and JAX version give
the same files. Then run `python benchmarks/measure_models.py --config <name>` for MODELS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from av_jax.models import assets_dir, load_config
from av_jax.models import pipeline


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="default", help="configs/models/<name>.toml")
  parser.add_argument("--out", default=None, help="output directory (default: av_jax/assets)")
  parser.add_argument("--only", default=None,
                      help="comma-separated drafter kinds to retrain, reusing the tokenizer "
                           "and target in --out (e.g. block,block_head)")
  parser.add_argument("--resume", action="store_true",
                      help="continue the run whose state is in --work-dir (after a stop)")
  parser.add_argument("--work-dir", default=None,
                      help="resumable training state (default: ~/.cache/av_jax/train/<config>, "
                           "or $AV_JAX_TRAIN_DIR/<config>)")
  parser.add_argument("--checkpoint-minutes", type=float, default=10.0,
                      help="minutes between training checkpoints (default 10)")
  args = parser.parse_args()
  if args.checkpoint_minutes <= 0:
    parser.error("--checkpoint-minutes: expected > 0")
  cfg = load_config(args.config)
  out = args.out or assets_dir()
  t0 = time.time()
  only = tuple(args.only.split(",")) if args.only else None
  summary = pipeline.train_all(cfg, out, progress=True, only=only, work_dir=args.work_dir,
                               resume=args.resume,
                               checkpoint_every_s=60.0 * args.checkpoint_minutes)
  wall = time.time() - t0
  print("\n=== summary ===")
  print(f"config {cfg.name} -> {out}   wall time {wall / 60:.1f} min on "
        f"{summary['cpu_count']} CPU cores ({platform.processor() or platform.machine()}, "
        f"backend {summary['jax_backend']})")
  print("held-out loss (nats/token): " + ", ".join(
      f"{k} {v:.3f}" for k, v in summary["heldout_loss"].items()))
  for part, n in summary["num_params"].items():
    print(f"  {part:<11} {n / 1e6:6.2f}M params  {summary['bytes'][part] / 1e6:6.2f} MB")
  print(f"total shipped size {summary['total_bytes'] / 1e6:.2f} MB; "
        f"confidence-head labels {summary['head_labels']}")
  print("timings (s): " + json.dumps({k: round(v, 1) for k, v in summary["timings"].items()}))


if __name__ == "__main__":
  main()
