"""Runs a Markdown file's ```python blocks verbatim, in order, in one namespace.

Usage: python ci/run_doc_blocks.py docs/integration.md

Each block is executed as it is written (no edits), sharing globals with the blocks
before it, as a reader pasting them one after another into one interpreter would. A
failing block stops the run with its traceback and its line number in the file. The
last line is `<name>: N passed, 0 failed` (N blocks).
"""

import re
import sys
import traceback


def python_blocks(text: str) -> list[tuple[int, str]]:
  """`(first line number, source)` of every ```python fenced block."""
  blocks = []
  for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.M | re.S):
    blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
  return blocks


def main(path: str) -> int:
  with open(path) as f:
    blocks = python_blocks(f.read())
  if not blocks:
    print(f"{path}: no ```python blocks found", file=sys.stderr)
    return 1
  namespace = {"__name__": "__main__"}
  for number, (line, source) in enumerate(blocks, 1):
    print(f"--- {path}:{line} (block {number} of {len(blocks)})", flush=True)
    try:
      exec(compile(source, f"{path}:block{number}", "exec"), namespace)
    except Exception:  # report which block failed, then fail the run
      traceback.print_exc()
      print(f"integration: {number - 1} passed, 1 failed ({path}:{line})")
      return 1
  print(f"integration: {len(blocks)} passed, 0 failed")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
