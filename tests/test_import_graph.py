"""The import graph of `av_jax` has no cycle (module-level imports, read from the source;
a few ms). A function-local import is allowed only with a comment saying why. The
engine takes from the drafters' package only the `Drafter` protocol's types."""

import ast
import inspect
import os
import re

import av_jax
from av_jax.models import drafters

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


# The modules the engine's step is split into; `core` assembles the step from them.
STEP_PARTS = ("state.py", "drafting.py", "verify.py")


def test_no_import_cycle():
  edges = _edges(_modules())
  assert len(edges) > 30 and edges["av_jax.engine.core"] >= {"av_jax.decision", "av_jax.arms"}
  assert _cycle(edges) is None, " -> ".join(_cycle(edges))
  parts = {f"av_jax.engine.{name[:-3]}" for name in STEP_PARTS}
  assert edges["av_jax.engine.core"] >= parts
  for part in parts:  # the parts sit below `core`: none imports it
    assert "av_jax.engine.core" not in edges[part], part


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


# What the engine may take from the drafters' package: the protocol's types (and the
# constructor of av_jax's drafters). Everything else a drafter does, the engine asks of
# it through `Drafter`'s verbs.
ENGINE_DRAFTER_NAMES = {"Drafter", "DrafterState", "DraftOutput", "make_drafter"}


def _in_drafters(module: str | None) -> bool:
  """`module` is the drafters' package or one of its modules."""
  return module == drafters.__name__ or (module or "").startswith(drafters.__name__ + ".")


def _drafter_names_used(tree: ast.AST) -> set[str]:
  """The names a module takes from `av_jax.models.drafters`: imported from it or one of
  its modules (or from `av_jax.models`, which re-exports its names), or read as
  attributes of either package."""
  internals = {name for name, value in vars(drafters).items()  # what it defines
               if not name.startswith("__") and not inspect.ismodule(value)
               and _in_drafters(getattr(value, "__module__", drafters.__name__))}
  bound, used = set(), set()  # the dotted names that denote either package

  def models_as(name):
    bound.update({name, name + ".drafters"})

  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and _in_drafters(node.module):
      used |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module == "av_jax.models":
      for a in node.names:
        if a.name == "drafters":
          bound.add(a.asname or a.name)
        elif a.name in internals:
          used.add(a.name)
    elif isinstance(node, ast.ImportFrom) and node.module == "av_jax":
      for a in node.names:
        if a.name == "models":
          models_as(a.asname or a.name)
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name == "av_jax.models.drafters":
          bound.add(a.asname or a.name)
        elif _in_drafters(a.name):  # a module of the package: every use of it is caught
          used.add(a.name)
        elif a.name in ("av_jax", "av_jax.models"):
          models_as(a.asname or "av_jax.models")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute))
        and ast.unparse(node.value) in bound and node.attr in internals):
      used.add(node.attr)
  return used


def test_the_engine_speaks_to_drafters_through_their_protocol():
  """`av_jax/engine/*.py` take from `av_jax.models.drafters` only the protocol's types
  (ENGINE_DRAFTER_NAMES), never a drafter's internals (its row and cache helpers), and
  never name `KVCache`: what a drafter's (or a target's) cache is, is the model's
  business; the engine moves rows through `Drafter`'s verbs and `Target.slot_axis`."""
  engine = os.path.join(ROOT, "engine")
  seen = {}
  for name in sorted(os.listdir(engine)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(engine, name), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    used = _drafter_names_used(tree)
    assert used <= ENGINE_DRAFTER_NAMES, (name, sorted(used - ENGINE_DRAFTER_NAMES))
    seen[name] = used
    kv = [n.lineno for n in ast.walk(tree)
          if (isinstance(n, ast.Attribute) and n.attr == "KVCache")
          or (isinstance(n, ast.Name) and n.id == "KVCache")
          or (isinstance(n, ast.alias) and n.name == "KVCache")]
    assert kv == [], (name, kv)
  # The check reads every engine module's imports, the step's parts beside `core` included.
  assert set(STEP_PARTS) | {"core.py"} <= set(seen)
  assert "Drafter" in seen["core.py"] and "Drafter" in seen["state.py"]


def test_the_drafter_name_check_catches_an_internal():
  """Negative control: each way of reaching a drafter internal is caught."""
  for source in ("from av_jax.models.drafters import Drafter, settle",
                 "from av_jax.models import drafters\ndrafters.take_slots(s, i)",
                 "from av_jax import models\nmodels.drafters.widen(s, 4)",
                 "from av_jax.models import catch_up",
                 "import av_jax.models.drafters as d\nd.read_window(c)",
                 "from av_jax.models.drafters.state import take_slots",
                 "from av_jax.models.drafters.protocol import Drafter, _state_axes",
                 "from av_jax.models.drafters import state",
                 "import av_jax.models.drafters.backlog"):
    assert _drafter_names_used(ast.parse(source)) - ENGINE_DRAFTER_NAMES, source
