"""The import graph of `av_jax` has no cycle (module-level imports, read from the source;
a few ms). A function-local import is allowed only with a comment saying why."""

import ast
import os
import re

import av_jax

ROOT = os.path.dirname(av_jax.__file__)


def _modules() -> dict[str, str]:
  out = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(ROOT))
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        out[module] = os.path.join(folder, name)
  return out


def _edges(modules: dict[str, str]) -> dict[str, set[str]]:
  """module -> the av_jax modules its top-level statements import."""
  edges = {}
  for module, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    targets = set()
    for node in tree.body:  # module level only: function-local imports run later
      if isinstance(node, ast.Import):
        targets |= {a.name for a in node.names if a.name.startswith("av_jax")}
      elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("av_jax"):
        for alias in node.names:
          sub = f"{node.module}.{alias.name}"
          targets.add(sub if sub in modules else node.module)
    edges[module] = {t for t in targets if t in modules and t != module}
  return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(edges[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(edges):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_no_import_cycle():
  edges = _edges(_modules())
  assert len(edges) > 30 and edges["av_jax.engine.core"] >= {"av_jax.decision", "av_jax.arms"}
  assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_function_local_imports_say_why():
  bare = []
  for module, path in _modules().items():
    with open(path, encoding="utf-8") as f:
      lines = f.read().split("\n")
    tree = ast.parse("\n".join(lines))
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for inner in ast.walk(node):
          if isinstance(inner, (ast.Import, ast.ImportFrom)):
            line = lines[inner.lineno - 1]
            if not re.search(r"#\s*deferred", line):
              bare.append(f"{module}:{inner.lineno}: {line.strip()}")
  assert bare == []


def test_the_library_never_imports_the_lab():
  """`import av_jax` (and every library module, at any depth) loads no `av_lab` module:
  the lab (comparisons, studies, replay, demos, the CLI) sits beside the library, which a
  serving stack imports alone. Checked in a fresh interpreter, and in the source: no
  library module names `av_lab` in an import statement (function-local ones included)."""
  import subprocess
  import sys
  modules = sorted(_modules())
  code = ("import importlib, sys\n"
          f"for m in {modules!r}:\n"
          "  importlib.import_module(m)\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'av_lab'))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(ROOT))
  assert out.stdout.strip() == "[]", out.stdout
  for module, path in _modules().items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n.split(".")[0] == "av_lab" for n in names), (module, names)
