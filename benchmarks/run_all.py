"""The studies suite (same as `av-jax bench`): `python benchmarks/run_all.py [--quick]`."""

import sys

from av_lab.studies.run import main

if __name__ == "__main__":
  sys.exit(main())
