"""The installed library stays small enough to read: no module of `av_jax` over 600 lines
and no function or method over 80 lines (from its `def` to its last line, decorators
excluded). Read from the source with `ast`; a few ms. A negative control checks that the
measure sees a long function nested in a class."""

import ast
import os

import av_jax

ROOT = os.path.dirname(av_jax.__file__)
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources() -> dict[str, str]:
  out = {}
  for folder, _, files in os.walk(ROOT):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
          out[os.path.relpath(path, os.path.dirname(ROOT))] = f.read()
  return out


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
  """(qualified name, lines) of every function longer than `limit` lines."""
  out = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      name = prefix
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = f"{prefix}{child.name}"
        if not isinstance(child, ast.ClassDef):
          lines = child.end_lineno - child.lineno + 1
          if lines > limit:
            out.append((name, lines))
        name += "."
      visit(child, name)

  visit(ast.parse(source), "")
  return out


def test_no_library_module_is_over_600_lines():
  long = {path: src.count("\n") for path, src in _sources().items()
          if src.count("\n") > MAX_MODULE_LINES}
  assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


def test_no_library_function_is_over_80_lines():
  long = {path: found for path, src in _sources().items()
          if (found := _long_functions(src, MAX_FUNCTION_LINES))}
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_measure_finds_a_long_method_and_passes_a_short_one():
  body = "\n".join(f"    x{i} = {i}" for i in range(81))
  source = f"class A:\n  def long(self):\n{body}\n  def short(self):\n    return 1\n"
  assert _long_functions(source, MAX_FUNCTION_LINES) == [("A.long", 82)]
  assert _long_functions(source, 82) == []
