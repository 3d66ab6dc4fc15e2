"""Offline corpora: documents for each workload, built from what every machine already has.

Nothing is downloaded. `code` and `prose` read the standard library of the running
interpreter (so they are reproducible for a given Python version); `math` and `noisy` are
generated procedurally from a seed. Every document has a stable id; the train / held-out
split is a hash of that id (`split_of`), so a module's code and its docstrings always land
in the same split and no held-out text leaks into training.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
from typing import Iterator, NamedTuple

from pydoc_data import topics

# Stdlib directories that are mostly tests, vendored data or generated tables.
_SKIP_DIRS = ("test", "tests", "idlelib", "site-packages", "turtledemo", "lib2to3",
              "ensurepip", "__pycache__", "encodings", "pydoc_data", "unittest")


class Document(NamedTuple):
  """One document of a corpus."""
  doc_id: str  # stable identifier; also the split key
  text: str    # the document text


def split_of(doc_id: str, *, heldout_fraction: float) -> str:
  """Returns "heldout" or "train" from a stable hash of `doc_id` (not Python's `hash`)."""
  digest = hashlib.md5(doc_id.encode("utf-8")).digest()
  u = int.from_bytes(digest[:8], "little") / 2.0**64
  return "heldout" if u < heldout_fraction else "train"


def _stdlib_files() -> list[tuple[str, str]]:
  """(relative path, absolute path) of the stdlib `.py` files, sorted by relative path."""
  root = sysconfig.get_paths()["stdlib"]
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root)
    parts = [] if rel_dir == "." else rel_dir.split(os.sep)
    if any(p in _SKIP_DIRS or p.startswith("test") for p in parts):
      dirnames[:] = []
      continue
    dirnames.sort()
    for name in sorted(filenames):
      if name.endswith(".py") and not name.startswith("test_"):
        out.append(("/".join(parts + [name]), os.path.join(dirpath, name)))
  out.sort()
  return out


def _read(path: str) -> str | None:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (UnicodeDecodeError, OSError):
    return None


def code_documents() -> Iterator[Document]:
  """CPython standard-library sources of the running interpreter, one document per file."""
  for rel, path in _stdlib_files():
    text = _read(path)
    if text and len(text) >= 200:
      yield Document(rel, text)


def _docstrings(source: str) -> list[str]:
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  out = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=True)
      if doc and len(doc) >= 40:
        out.append(doc)
  return out


def prose_documents() -> Iterator[Document]:
  """English technical prose: the Python reference topics, then stdlib docstrings.

  Docstrings of one module form one document whose id is the module's path, the same id
  as its `code` document, so both fall in the same split.
  """
  for name in sorted(topics.topics):
    yield Document(f"topics/{name}", topics.topics[name])
  for rel, path in _stdlib_files():
    text = _read(path)
    docs = _docstrings(text) if text else []
    joined = "\n\n".join(docs)
    if len(joined) >= 200:
      yield Document(rel, joined)


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi",
          "Lena", "Mia", "Noor", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma", "Vik", "Yara")
_ITEMS = ("apples", "books", "pens", "coins", "marbles", "stickers", "cards", "shells",
          "stamps", "cookies", "bottles", "boxes")
_CONTAINERS = ("bags", "boxes", "crates", "jars", "baskets", "shelves")


def _math_problem(rng: random.Random) -> str:
  """One multi-step arithmetic word problem with a worked solution."""
  name, other = rng.sample(_NAMES, 2)
  item = rng.choice(_ITEMS)
  kind = rng.randrange(4)
  if kind == 0:
    a, b, c = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 30)
    total = a + b
    c = min(c, total)
    return (f"Problem: {name} has {a} {item}. {other} gives {name} {b} more {item}. "
            f"Then {name} gives away {c} {item}. How many {item} does {name} have now?\n"
            f"Solution: {a} + {b} = {total}. {total} - {c} = {total - c}.\n"
            f"Answer: {total - c}\n")
  if kind == 1:
    n, per, sold = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 20)
    cont = rng.choice(_CONTAINERS)
    total = n * per
    sold = min(sold, total)
    return (f"Problem: A shop has {n} {cont} with {per} {item} in each. "
            f"It sells {sold} {item}. How many {item} are left?\n"
            f"Solution: {n} * {per} = {total}. {total} - {sold} = {total - sold}.\n"
            f"Answer: {total - sold}\n")
  if kind == 2:
    k, per, extra = rng.randint(2, 9), rng.randint(2, 15), rng.randint(1, 25)
    total = k * per + extra
    return (f"Problem: {name} buys {k} packs of {item} with {per} {item} per pack "
            f"and finds {extra} more. How many {item} does {name} have?\n"
            f"Solution: {k} * {per} = {k * per}. {k * per} + {extra} = {total}.\n"
            f"Answer: {total}\n")
  groups, per = rng.randint(2, 9), rng.randint(2, 12)
  left = rng.randint(0, min(5, groups - 1))  # a remainder is smaller than the divisor
  total = groups * per + left
  return (f"Problem: {name} shares {total} {item} equally among {groups} friends. "
          f"How many {item} does each friend get, and how many are left over?\n"
          f"Solution: {total} / {groups} = {per} remainder {left}. "
          f"Each friend gets {per} and {left} are left over.\n"
          f"Answer: {per} each, {left} left\n")


def math_documents(*, num_docs: int, seed: int = 0) -> Iterator[Document]:
  """Procedural arithmetic word problems with worked solutions (low entropy)."""
  for i in range(num_docs):
    rng = random.Random(f"math/{seed}/{i}")
    yield Document(f"math/{i}", "\n".join(_math_problem(rng) for _ in range(16)))


_STATUS = ("ok", "ok", "ok", "retry", "fail", "timeout")
_REGIONS = ("eu-west", "us-east", "ap-south", "sa-east")


def _record(rng: random.Random) -> str:
  """One log record: random identifiers, numbers and hex fields, some copied (learnable)."""
  rid = "%012x" % rng.getrandbits(48)
  user = f"u{rng.randint(10000, 99999)}"
  ip = ".".join(str(rng.randint(0, 255)) for _ in range(4))
  amount = f"{rng.randint(0, 9999)}.{rng.randint(0, 99):02d}"
  digest = "%08x" % rng.getrandbits(32)
  status = rng.choice(_STATUS)
  region = rng.choice(_REGIONS)
  return (f"id={rid} user={user} ip={ip} region={region} amount={amount} "
          f"sha={digest} status={status} ref={rid[:6]}\n")


def noisy_documents(*, num_docs: int, seed: int = 0) -> Iterator[Document]:
  """High-entropy but learnable records (random ids, numbers, hex; fixed field layout)."""
  for i in range(num_docs):
    rng = random.Random(f"noisy/{seed}/{i}")
    yield Document(f"noisy/{i}", "".join(_record(rng) for _ in range(24)))
