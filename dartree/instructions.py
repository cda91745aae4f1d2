"""Offline instruction prompts for self-distilling a drafter on a chat model.

Nothing here is downloaded: prompts are made from what every Python installation has.

  code_prompts()     documented functions of the CPython standard library (test folders excluded,
                     as they hold the `stdlib` bench set), asked for in two ways: the signature +
                     docstring to complete (HumanEval's form), or a one-line request built from
                     the docstring's first sentence
  general_prompts()  requests built from fixed templates (explain, compare, list, write, plan,
                     arithmetic word problems, ...) over a fixed list of topics

`holdout_filter` drops any prompt that equals or contains an evaluation prompt (HumanEval, all of
MT-Bench), so no evaluation prompt is in the training data.
"""

from __future__ import annotations

import ast
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


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def holdout_filter(prompts: list[str], evaluation: list[str]) -> tuple[list[str], int]:
    """(prompts that neither equal nor contain nor are contained in an evaluation prompt, number
    dropped); comparison on lower-cased, whitespace-normalised text."""
    held = [_words(p) for p in evaluation if p.strip()]
    kept, dropped = [], 0
    for prompt in prompts:
        text = _words(prompt)
        if any(text == h or h in text or (len(text) > 40 and text in h) for h in held):
            dropped += 1
        else:
            kept.append(prompt)
    return kept, dropped


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
