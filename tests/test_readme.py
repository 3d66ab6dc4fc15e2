"""README's "The API in a dozen lines" runs as written, and its step does what the comments say."""

import os
import re

import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _api_block() -> str:
  with open(README, encoding="utf-8") as f:
    text = f.read()
  section = text.split("## The API in a dozen lines", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
  assert len(blocks) == 1, "expected one python block in the API section"
  return blocks[0]


def test_readme_api_block_runs():
  namespace = {}
  exec(compile(_api_block(), "README.md", "exec"), namespace)  # noqa: S102 (our own file)
  B, K = namespace["B"], namespace["K"]
  state, tokens, num_emitted = (namespace[k] for k in ("state", "tokens", "num_emitted"))
  assert tokens.shape == (B, K + 1)
  num_emitted = np.asarray(num_emitted)
  assert np.all((1 <= num_emitted) & (num_emitted <= K + 1))
  emitted = np.asarray(tokens)[np.arange(K + 1)[None] < num_emitted[:, None]]
  assert np.all((0 <= emitted) & (emitted < namespace["V"]))
  # The labels reached the estimator: one update, with labelled drafts counted.
  assert int(state.estimator.step) == 1 and float(state.estimator.counts.sum()) >= 1
  # The plan drafted a prefix of each request, and the policy's memory kept those features.
  known = np.asarray(state.planner.memory.known)
  depth = np.asarray(state.planner.plan.depth)
  assert known.any()
  np.testing.assert_array_equal(known, np.arange(K)[None] < depth[:, None])
