#!/usr/bin/env python3
"""Round-by-round fidelity of dartree's engine to the public reference decoding loops.

For each method, dartree's `SpeculativeDecoder` and the reference loop run on the same tiny
random checkpoint (a Qwen3 target + a drafter saved in the z-lab / Domino layout) and the same
prompts, greedy. Compared per round:

  rounds   the acceptance length of every round (τ, bonus token included)
  tokens   the committed tokens (first `--max-new` of them)
  trees    the verified draft tree (tokens + parents in node order), read from the target call
  Δh       max |h_dartree - h_ref| over the drafter's output states (slot alignment, features)

Reference loops (not vendored: point --refs at your own clones):

  REFS/dflash   github.com/z-lab/dflash           dflash.model.dflash_generate         -> dflash
  REFS/ddtree   github.com/liranringel/ddtree     ddtree.ddtree_generate               -> ddtree
  REFS/Domino   github.com/jianuo-huang/Domino    code/dflash.py DFlashDraftModel.spec_generate -> domino
  REFS/DARTree  github.com/magneto0124/DARTree    eval_dartree.dartree_generate        -> dartree, dartree-fixed

Glue applied here, never to the reference files:
  - transformers 5 `DynamicCache.crop(n)` refuses n > 0; the references call it with the absolute
    length to keep (transformers 4 semantics), so each reference module's `DynamicCache` name is
    bound to a subclass whose `crop(n >= 0)` keeps the first n positions;
  - `torch.cuda.synchronize()` timers (`_cuda_time`, `cuda_time`) are replaced by perf_counter on CPU;
  - `loguru` / `datasets` are stubbed when missing (logging and dataset loading only);
  - DARTree on CPU takes its own eager fallbacks (score/select without the CUDA graph, pruning by
    a sorted Python list). `--dartree-path cuda-emulated` instead replays the CUDA-graph body
    eagerly (the graph's torch code, run instead of captured) and takes the accelerator pruning
    branch (`torch.topk(sorted=False)`), i.e. what the reference does on a GPU.

Each reference runs with max_new_tokens + a margin, so its end-of-budget rule (loop bound,
truncated last verify) never shortens the rounds compared: rounds 1..R of both runs are the same
computation, R = dartree's round count.

Checkpoint knobs: --residual (< 1: a nearly-bigram target, rounds accept more), --vocab,
--tie-pairs (token pairs with equal LM-head rows: exact ties everywhere). Extra checks:
--edge-cases (a drafter reading the target's last layer), --tree-probes N (DARTree builders alone).

    python bench/fidelity.py --refs /tmp/fidelity/refs --residual 0.3 --edge-cases --tree-probes 100
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, Qwen3Config

import dartree
from dartree import SpeculativeDecoder, load_drafter, save_drafter
from dartree.testing import random_drafter

HIDDEN, LAYERS = 64, 4
VOCAB = 256  # --vocab
MASK = VOCAB - 1


# ------------------------------------------------------------------------------------- glue


class LegacyCropCache(DynamicCache):
    """DynamicCache whose crop(n >= 0) keeps the first n positions (transformers 4 semantics)."""

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            return super().crop(max_length)
        remove = self.get_seq_length() - max_length
        if remove > 0:
            super().crop(-remove)


def _perf_counter(*_args, **_kwargs) -> float:
    return time.perf_counter()


def _stub_missing(name: str, **attrs) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__fidelity_stub__ = True
        sys.modules[name] = module


class _NullLogger:
    def __getattr__(self, _name):
        return lambda *a, **k: None


def _dummy(*_a, **_k):
    raise RuntimeError("stubbed for the fidelity harness")


_stub_missing("loguru", logger=_NullLogger())
_stub_missing("datasets", load_dataset=_dummy, Dataset=object, Features=dict, Sequence=list, Value=str)


def import_isolated(root: Path, names: list[str]) -> dict[str, types.ModuleType]:
    """Import `names` with `root` first on sys.path, then forget every module loaded from `root`
    (the references reuse top-level names such as `dflash`, `model`, `utils`)."""
    root = root.resolve()
    sys.path.insert(0, str(root))
    try:
        modules = {name: importlib.import_module(name) for name in names}
    finally:
        sys.path.remove(str(root))
        for key, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None) or ""
            if path and Path(path).resolve().is_relative_to(root):
                _apply_glue(module)
                del sys.modules[key]
    return modules


def _apply_glue(module: types.ModuleType) -> None:
    if "DynamicCache" in module.__dict__:
        module.DynamicCache = LegacyCropCache
    for timer in ("_cuda_time", "cuda_time"):
        if timer in module.__dict__ and not torch.cuda.is_available():
            setattr(module, timer, _perf_counter)


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() reruns the captured body eagerly."""

    def replay(self):
        entry = self.owner.graphs[self.key]
        for out, new in zip(entry["outputs"], self.body()):
            out.copy_(new)


def _fake_graph_context(graph, *_args, **_kwargs):
    frame = sys._getframe(1).f_locals  # DARTreeScoreSelectGraph._capture
    graph.body, graph.owner, graph.key = frame["graph_body"], frame["self"], frame["key"]
    return contextlib.nullcontext()


@contextlib.contextmanager
def dartree_cuda_emulated(module):
    """Make DARTree's eval module take its CUDA paths on CPU (see the module docstring)."""
    saved = {name: getattr(module, name) for name in ("can_use_cuda_graphs", "is_accelerator_device")}
    saved_cuda = {name: getattr(torch.cuda, name) for name in ("CUDAGraph", "graph", "synchronize")}
    module.can_use_cuda_graphs = lambda device: True
    module.is_accelerator_device = lambda device: True
    torch.cuda.CUDAGraph, torch.cuda.graph = _FakeGraph, _fake_graph_context
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        for name, value in saved_cuda.items():
            setattr(torch.cuda, name, value)


# ------------------------------------------------------------------------------ checkpoint


def build_checkpoint(folder: Path, seed: int, block_size: int, residual: float,
                     tie_pairs: int = 0) -> dict[str, Path]:
    """A tiny Qwen3 target and its drafters, saved (target: save_pretrained; drafters: z-lab /
    Domino layout through dartree.save_drafter).

    Drafters: `dflash` (plain DFlash, no shift_label), `domino` (shift_label, P = 1, the Domino
    b16 layout), `domino-noshift` (no shift_label, P = 2), all random with enlarged weights, and
    `*-bigram` Domino drafters whose head predicts the target's next token from the last drafted
    token (see `_bigram_head`), so chains and trees accept several tokens per round.

    residual < 1 scales every o_proj / down_proj (target and drafters): the residual stream stays
    close to the token embedding, so the target is nearly a bigram model x -> f(x) and a drafter's
    slot reading the bonus token predicts the target's next token.

    tie_pairs > 0 copies LM-head row 2i into row 2i + 1 for i < tie_pairs: those token pairs get
    exactly equal logits everywhere (target and drafter), so every top-k meets exact ties.
    """
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    embed, lm_head = target.get_input_embeddings().weight, target.lm_head.weight
    with torch.no_grad():
        # a direction u shared by every embedding and invisible to the LM head: the bigram head's
        # GRU reads it to close its update gate (its GRU has no bias)
        u = torch.randn(HIDDEN)
        u /= u.norm()
        u_scale = float(embed.norm(dim=1).mean())
        embed.add_(u_scale * u)
        lm_head.sub_(torch.outer(lm_head @ u, u))
        lm_head.mul_(8.0)  # peaked logits: greedy paths vary
        lm_head[MASK].zero_()  # the mask token is never the target's argmax
        for i in range(tie_pairs):
            lm_head[2 * i + 1] = lm_head[2 * i]
        for name, param in target.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(residual)
    paths = {"target": folder / "target"}
    target.save_pretrained(paths["target"])

    variants = {
        "dflash": dict(domino=False),
        "domino": dict(domino=True),  # shift_label True, pure_draft_prefix_len 1 (Domino b16 layout)
        "domino-noshift": dict(domino=True, shift_label=False, pure_draft_prefix_len=2),
        "domino-bigram": dict(domino=True),
        "domino-noshift-bigram": dict(domino=True, shift_label=False, pure_draft_prefix_len=0),
        "dflash-lastlayer": dict(domino=False, num_layers=2, target_layer_ids=[1, LAYERS - 1]),
    }
    for name, kwargs in variants.items():
        kwargs = dict(kwargs)
        num_layers = kwargs.pop("num_layers", 1)
        drafter = random_drafter(target, num_layers=num_layers, block_size=block_size,
                                 seed=seed + 1, **kwargs)
        with torch.no_grad():  # larger weights than N(0, 0.02): corrections and GRU states matter
            for pname, param in drafter.named_parameters():
                if pname.startswith("head.embed_proj.0") or pname.startswith("head.prefix_gru"):
                    param.mul_(15.0)
                elif pname.startswith("head.embed_proj.2"):
                    param.mul_(10.0)
                elif pname.endswith(("q_proj.weight", "k_proj.weight", "fc.weight")):
                    param.mul_(10.0)
                elif pname.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(residual)
            if name.endswith("-bigram"):
                _bigram_head(drafter.head, u, u_scale, lm_head)
        paths[name] = folder / name
        save_drafter(drafter, paths[name])
    return paths


def _bigram_head(head, u: torch.Tensor, u_scale: float, lm_head: torch.Tensor) -> None:
    """Domino head weights with Δ(g) ≈ β · lm_head · e(last token): the correction predicts what
    the (nearly bigram) target says after the last drafted token.

    GRU: update gate shut by the shared embedding direction u (z ≈ σ(-10)), candidate
    n = tanh(c · e⊥(token)), no recurrence, so g ≈ c · e⊥(last token); correction:
    W_z = 0, W_s = a·I, W_2 = β · lm_head.
    """
    hidden, gru = head.hidden_size, head.gru_hidden_dim
    assert gru == hidden and head.emb_dim == hidden, "the bigram head needs G = r = H"
    eye = torch.eye(hidden)
    w_ih = torch.zeros(3 * gru, hidden)
    w_ih[gru:2 * gru] = -10.0 / u_scale * u[None, :]  # update gate: σ(-10) for every token
    w_ih[2 * gru:] = 10.0 * (eye - torch.outer(u, u))  # candidate: tanh(10 · e⊥)
    head.prefix_gru.weight_ih_l0.copy_(w_ih)
    head.prefix_gru.weight_hh_l0.zero_()
    w_1 = torch.zeros(hidden, 2 * hidden)
    w_1[:, hidden:] = 0.5 * eye
    head.embed_proj[0].weight.copy_(w_1)
    head.embed_proj[2].weight.copy_(100.0 * lm_head)


def make_prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        length = int(torch.randint(10, 24, (1,), generator=gen))
        prompts.append(torch.randint(0, MASK, (length,), generator=gen).tolist())
    return prompts


# ------------------------------------------------------------------------------- recording


@dataclass
class Run:
    tokens: list[int]
    rounds: list[int]
    trees: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (tokens, parents)
    hidden: list[torch.Tensor] = field(default_factory=list)  # drafter states per round [k, H]


def _tree_from_call(ids, positions, mask) -> tuple[list[int], list[int]]:
    """Tokens and parents of the tree in one verify call of the target (root first)."""
    ids, depth = ids[0].tolist(), (positions[0] - positions[0, 0]).tolist()
    size = len(ids)
    if mask is None:  # a chain
        return ids, list(range(-1, size - 1))
    visible = mask[0, 0, :, mask.shape[-1] - size:] == 0
    parents = [-1]
    for node in range(1, size):
        above = [j for j in range(node) if visible[node, j] and depth[j] == depth[node] - 1]
        parents.append(above[-1] if above else -2)
    return ids, parents


@contextlib.contextmanager
def record_reference(target, draft_model, shift_label: bool, run: Run):
    """Record every verify call of the target and every drafter output of a reference loop."""
    calls = []

    def pre(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append((ids.clone(), kwargs["position_ids"].clone(),
                      None if kwargs.get("attention_mask") is None else kwargs["attention_mask"].clone()))

    def post(_module, _args, output):
        out = output if isinstance(output, torch.Tensor) else output[0]
        run.hidden.append(out[0, 0 if shift_label else 1:].detach().clone())

    handles = [target.register_forward_pre_hook(pre, with_kwargs=True),
               draft_model.register_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        run.trees.extend(_tree_from_call(*call) for call in calls[1:])  # calls[0]: prefill


# ------------------------------------------------------------------------------- the runs


@dataclass
class Settings:
    block_size: int = 8
    budget: int = 32
    width: int = 6
    candidates: int = 32
    depth_bonus: float = -0.2


def run_dartree(target, ckpt, method, prompt, max_new, s: Settings) -> Run:
    drafter = load_drafter(ckpt, target)
    dec = SpeculativeDecoder(target, drafter, method=method, budget=s.budget, width=s.width,
                             candidates=s.candidates, depth_bonus=s.depth_bonus)
    run = Run(tokens=[], rounds=[])
    draft, propose = drafter.draft, dec._propose

    def recording_draft(features, bonus, position):
        h = draft(features, bonus, position)
        run.hidden.append(h.detach().clone())
        return h

    def recording_propose(*args, **kwargs):
        tree = propose(*args, **kwargs)
        run.trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    drafter.draft, dec._propose = recording_draft, recording_propose
    res = dec.generate(prompt, max_new_tokens=max_new)
    run.tokens, run.rounds = res.tokens, res.acceptance_lengths
    return run


class References:
    def __init__(self, refs: Path, target, paths: dict[str, Path], dartree_path: str):
        self.refs, self.target, self.paths, self.dartree_path = refs, target, paths, dartree_path
        self._drafters: dict[tuple[str, str], torch.nn.Module] = {}

    def _drafter(self, repo: str, cls, ckpt: str, **kwargs):
        key = (repo, ckpt)
        if key not in self._drafters:
            self._drafters[key] = cls.from_pretrained(self.paths[ckpt], dtype=torch.float32,
                                                      attn_implementation="sdpa", **kwargs).eval()
        return self._drafters[key]

    def run(self, method: str, ckpt: str, prompt: list[int], max_new: int, s: Settings) -> Run:
        ids = torch.tensor([prompt])
        run = Run(tokens=[], rounds=[])
        if method == "dflash":
            mod = import_isolated(self.refs / "dflash", ["dflash.model"])["dflash.model"]
            model = self._drafter("dflash", mod.DFlashDraftModel, ckpt)
            with record_reference(self.target, model, False, run):
                out = mod.dflash_generate(model, self.target, ids, max_new, None, 0.0,
                                          block_size=s.block_size, return_stats=True)
        elif method == "ddtree":
            mods = import_isolated(self.refs / "ddtree", ["ddtree", "dflash", "model"])
            model = self._drafter("ddtree", mods["model"].DFlashDraftModel, ckpt)
            with record_reference(self.target, model, False, run):
                out = mods["ddtree"].ddtree_generate(
                    model, self.target, ids, mask_token_id=model.mask_token_id,
                    max_new_tokens=max_new, block_size=s.block_size, stop_token_ids=None,
                    temperature=0.0, tree_budget=s.budget)
        elif method == "domino":
            mod = import_isolated(self.refs / "Domino" / "code", ["dflash"])["dflash"]
            model = self._drafter("Domino", mod.DFlashDraftModel, ckpt)
            shift = bool(model.config.dflash_config.get("shift_label", False))
            with record_reference(self.target, model, shift, run):
                out = model.spec_generate(ids, self.target, max_new_tokens=max_new, temperature=0.0,
                                          stop_token_ids=None, graph_runner=None, return_dict=True)
        else:
            out = self._run_dartree(method, ckpt, ids, max_new, s, run)
        run.tokens = out.output_ids[0, len(prompt):].tolist()
        run.rounds = list(out.acceptance_lengths)
        return run

    def _run_dartree(self, method, ckpt, ids, max_new, s: Settings, run: Run):
        mod = import_isolated(self.refs / "DARTree", ["eval_dartree"])["eval_dartree"]
        emulate = self.dartree_path == "cuda-emulated"
        with dartree_cuda_emulated(mod) if emulate else contextlib.nullcontext():
            config = mod.normalize_draft_config(AutoConfig.from_pretrained(self.paths[ckpt]))
            model = self._drafter(f"DARTree-{self.dartree_path}", mod.DFlashDraftModel, ckpt, config=config)
            scorer = mod.DominoCorrectionScorer(
                draft_model=model, target_model=self.target,
                hidden_dim=int(self.target.lm_head.weight.shape[1]),
                gru_hidden_dim=model.prefix_gru.hidden_size)
            variant = "fixed" if method == "dartree-fixed" else "pruned"
            shift = bool(model.config.dflash_config.get("shift_label", False))
            k_draft = s.block_size if shift else s.block_size - 1
            # as eval_dartree.main: --expansion-k = --candidate-vocab-size = candidates
            cvs = s.candidates
            expansion_k = min(s.candidates, cvs)
            widths = (mod.supertree_width_schedule(k_draft, expansion_k, s.width)
                      if variant == "pruned" else None)
            pairs = mod.planned_score_select_pairs(
                budget=sum(widths) if widths is not None else s.budget, depth_limit=k_draft,
                candidate_count=expansion_k, per_layer_widths=widths)
            graph = mod.DARTreeScoreSelectGraph(
                scorer, device=torch.device("cpu"), max_batch=max((b for b, _ in pairs), default=1),
                candidate_count=cvs, select_candidate_count=expansion_k,
                max_select=max((q for _, q in pairs), default=1), dtype=torch.float32,
                include_gru=True, warm_pairs=sorted(pairs))
            with record_reference(self.target, model, shift, run):
                return mod.dartree_generate(
                    draft_model=model, target=self.target, input_ids=ids, max_new_tokens=max_new,
                    block_size=s.block_size, tree_budget=s.budget, expansion_k=s.candidates,
                    depth_bonus=0.0 if variant == "fixed" else s.depth_bonus, variant=variant,
                    supertree_width=s.width, correction_scorer=scorer, candidate_vocab_size=cvs,
                    score_select_graph=graph, temperature=0.0, stop_token_ids=None,
                    verify_buffer_nodes=1 + s.budget)


# ------------------------------------------------------------------------------ comparison


@dataclass
class Row:
    method: str
    drafter: str
    prompts: int = 0
    rounds_compared: int = 0
    rounds_equal: int = 0
    tokens_compared: int = 0
    tokens_equal: int = 0
    trees_equal: int = 0
    tree_sets_equal: int = 0
    max_dh: float = 0.0
    first_diff: list[str] = field(default_factory=list)
    accept_gt1: int = 0
    max_tau: int = 0


def _paths(tree: tuple[list[int], list[int]]) -> set[tuple[int, ...]]:
    tokens, parents = tree
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, len(tokens)):
        paths.append(paths[parents[node]] + (tokens[node],) if parents[node] >= 0 else ("?",))
    return set(paths[1:]) | {("root", tokens[0])}


def compare(row: Row, ours: Run, ref: Run, max_new: int, prompt_id: int) -> None:
    """Round r counts as equal only while every earlier round of this prompt had the same τ
    (after a τ mismatch the two runs no longer start their rounds at the same position)."""
    row.prompts += 1
    rounds = len(ours.rounds)
    row.rounds_compared += rounds
    aligned = True  # every earlier round had the same τ
    reported = False
    for r in range(rounds):
        equal = aligned and r < len(ref.rounds) and ours.rounds[r] == ref.rounds[r]
        tree_equal = aligned and r < len(ref.trees) and ours.trees[r] == ref.trees[r]
        same_set = aligned and r < len(ref.trees) and _paths(ours.trees[r]) == _paths(ref.trees[r])
        row.rounds_equal += equal
        row.trees_equal += tree_equal
        row.tree_sets_equal += same_set
        row.accept_gt1 += ours.rounds[r] > 1
        row.max_tau = max(row.max_tau, ours.rounds[r])
        if aligned and r < len(ref.hidden):
            row.max_dh = max(row.max_dh, float((ours.hidden[r] - ref.hidden[r]).abs().max()))
        if aligned and not reported and not (equal and tree_equal):
            row.first_diff.append(f"prompt {prompt_id} round {r}: τ {ours.rounds[r]} vs "
                                  f"{ref.rounds[r] if r < len(ref.rounds) else None}, tree "
                                  f"{'=' if tree_equal else 'same paths, other order' if same_set else '≠'}")
            reported = True
        aligned = equal
    a, b = ours.tokens[:max_new], ref.tokens[:max_new]
    row.tokens_compared += len(a)
    row.tokens_equal += sum(x == y for x, y in zip(a, b))


def tree_probes(refs: Path, target, ckpt: Path, blocks: int, seed: int) -> list[str]:
    """Builder-level check: dartree.tree.build_dartree vs DARTree's build_dartree_supertree on
    random draft blocks, on the reference's CPU path and on its (emulated) CUDA path.

    Blocks: h ~ N(0, 1) [k, H], base logits = lm_head(h) * a random scale in [0.5, 3] (flat to
    peaked), a random root. Returns markdown table rows.
    """
    mod = import_isolated(refs / "DARTree", ["eval_dartree"])["eval_dartree"]
    config = mod.normalize_draft_config(AutoConfig.from_pretrained(ckpt))
    ref_model = mod.DFlashDraftModel.from_pretrained(ckpt, config=config, dtype=torch.float32).eval()
    scorer = mod.DominoCorrectionScorer(draft_model=ref_model, target_model=target,
                                        hidden_dim=HIDDEN, gru_hidden_dim=ref_model.prefix_gru.hidden_size)
    head = load_drafter(ckpt, target).head
    from dartree.tree import DraftBlock, build_dartree

    k = 8
    cases = [  # (label, P, candidates (= expansion_k = candidate_vocab_size), budget, width)
        ("P=1, E=C", 1, 16, 24, 6),
        ("P=2, E=C", 2, 16, 24, 6),
        ("P=1, E<C", 1, 32, 16, 6),
    ]
    rows = []
    gen = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(blocks):
        h = torch.randn(1, k, HIDDEN, generator=gen)
        scale = 0.5 + 2.5 * float(torch.rand(1, generator=gen))
        base = (target.lm_head(h) * scale).detach()
        root = int(torch.randint(0, MASK, (1,), generator=gen))
        data.append((h, base, root))
    for label, prefix, cands, budget, width in cases:
        for variant in ("pruned", "fixed"):
            counts = {}
            for path in ("cpu", "cuda-emulated"):
                equal = 0
                for h, base, root in data:
                    with (dartree_cuda_emulated(mod) if path == "cuda-emulated" else contextlib.nullcontext()), \
                            torch.inference_mode():
                        C = max(1, min(max(cands, min(cands, VOCAB)), VOCAB))
                        E = min(cands, C)
                        widths = mod.supertree_width_schedule(k, E, width) if variant == "pruned" else None
                        pairs = mod.planned_score_select_pairs(
                            budget=sum(widths) if widths else budget, depth_limit=k,
                            candidate_count=E, per_layer_widths=widths)
                        graph = mod.DARTreeScoreSelectGraph(
                            scorer, device=torch.device("cpu"), max_batch=max(b for b, _ in pairs),
                            candidate_count=cands, select_candidate_count=E,
                            max_select=max(q for _, q in pairs), dtype=torch.float32,
                            include_gru=True, warm_pairs=sorted(pairs))
                        vals, ids = torch.topk(base[0].float(), k=C, dim=-1)
                        weights = scorer.fc2_weight.index_select(0, ids.reshape(-1)).view(k, C, -1)
                        tokens, _, parents, *_ = mod.build_dartree_supertree(
                            root_token_id=torch.tensor(root), parallel_hiddens=h, base_logits=base,
                            budget=budget, expansion_k=cands, prefix_len=prefix, supertree_width=width,
                            depth_bonus=0.0 if variant == "fixed" else -0.2, correction_scorer=scorer,
                            z_parts=scorer.project_z(h), candidate_tables=(ids, vals, weights, None),
                            score_select_graph=graph, tree_buffers={}, pruned=variant == "pruned")
                        block = DraftBlock(root=root, base_logits=base[0], head=head,
                                           z=head.project(h[0]), prefix_len=prefix)
                        tree = build_dartree(block, width=width, candidates=cands, budget=budget,
                                             depth_bonus=0.0 if variant == "fixed" else -0.2,
                                             fixed=variant == "fixed")
                    equal += (tree.tokens[1:].tolist(), tree.parents.tolist()) == (tokens.tolist(), parents)
                counts[path] = equal
            rows.append(f"| {label} | {variant} | {blocks} | {counts['cpu']} | {counts['cuda-emulated']} |")
    return rows


CASES = [  # (dartree method, reference, drafter checkpoint)
    ("dflash", "dflash", "dflash"),
    ("ddtree", "ddtree", "dflash"),
] + [(method, method, drafter)
     for method in ("domino", "dartree", "dartree-fixed")
     for drafter in ("domino", "domino-noshift", "domino-bigram", "domino-noshift-bigram")]
EDGE_CASES = [  # a drafter reading the target's last layer (hidden_states[L] is the normed output)
    ("dflash", "dflash", "dflash-lastlayer"),
    ("ddtree", "ddtree", "dflash-lastlayer"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refs", type=Path, required=True, help="folder with dflash/ ddtree/ Domino/ DARTree/")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fidelity/ckpt"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--tie-pairs", type=int, default=0, help="token pairs with equal logits")
    parser.add_argument("--residual", type=float, default=1.0,
                        help="scale of every o_proj/down_proj; < 1 makes rounds accept more tokens")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--width", type=int, default=6)
    parser.add_argument("--candidates", type=int, default=32)
    parser.add_argument("--depth-bonus", type=float, default=-0.2)
    parser.add_argument("--dartree-path", choices=["cpu", "cuda-emulated"], default="cpu")
    parser.add_argument("--methods", default="all", help="comma list of dartree methods, or all")
    parser.add_argument("--edge-cases", action="store_true", help="also run the last-layer feature case")
    parser.add_argument("--reference-ops", action="store_true", help="dartree.ops on the PyTorch reference")
    parser.add_argument("--json", type=Path, help="write per-round details here")
    parser.add_argument("--tree-probes", type=int, default=0, metavar="N",
                        help="also compare the DARTree builders alone on N random blocks")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.reference_ops:
        dartree.ops.use_reference(True)

    global VOCAB, MASK
    VOCAB, MASK = args.vocab, args.vocab - 1
    s = Settings(args.block_size, args.budget, args.width, args.candidates, args.depth_bonus)
    paths = build_checkpoint(args.workdir, args.seed, args.block_size, args.residual, args.tie_pairs)
    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    refs = References(args.refs, target, paths, args.dartree_path)
    prompts = make_prompts(args.prompts, args.seed)
    margin = args.budget + args.block_size + 2
    wanted = None if args.methods == "all" else set(args.methods.split(","))
    cases = CASES + (EDGE_CASES if args.edge_cases else [])
    rows, details = [], []
    for method, ref_name, ckpt in cases:
        if wanted is not None and method not in wanted:
            continue
        row = Row(method, ckpt)
        for i, prompt in enumerate(prompts):
            ours = run_dartree(target, paths[ckpt], method, prompt, args.max_new, s)
            ref = refs.run(ref_name, ckpt, prompt, args.max_new + margin, s)
            compare(row, ours, ref, args.max_new, i)
            details.append(dict(method=method, drafter=ckpt, prompt=i, ours=ours.rounds,
                                ref=ref.rounds[:len(ours.rounds) + 1]))
        rows.append(row)
        print(f"{method:14s} {ckpt:16s} rounds {row.rounds_equal}/{row.rounds_compared} "
              f"trees {row.trees_equal}/{row.tree_sets_equal}/{row.rounds_compared} tokens {row.tokens_equal}/"
              f"{row.tokens_compared} τ>1 {row.accept_gt1} max τ {row.max_tau} max|Δh| {row.max_dh:.2e}",
              flush=True)
        for line in row.first_diff:
            print("    first difference:", line)

    print()
    print(f"settings: block {s.block_size}, budget {s.budget}, width {s.width}, candidates "
          f"{s.candidates}, depth_bonus {s.depth_bonus}, DARTree path {args.dartree_path}, "
          f"dartree ops {'reference' if args.reference_ops else 'compiled' if dartree.ops.HAS_EXTENSION else 'reference (no _C)'}")
    print("| method | drafter | prompts | rounds compared | rounds equal | tokens equal | trees equal "
          "(node order) | trees equal (path set) | rounds τ>1 | max τ | max abs Δh |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.method} | {r.drafter} | {r.prompts} | {r.rounds_compared} | {r.rounds_equal} | "
              f"{r.tokens_equal}/{r.tokens_compared} | {r.trees_equal} | {r.tree_sets_equal} | "
              f"{r.accept_gt1} | {r.max_tau} | {r.max_dh:.1e} |")
    if args.tree_probes:
        print()
        print("DARTree builder probes (trees equal to build_dartree_supertree, node for node):")
        print("| case | variant | blocks | reference CPU path | reference CUDA path (emulated) |")
        print("|---|---|---|---|---|")
        for line in tree_probes(args.refs, target, paths["domino"], args.tree_probes, args.seed):
            print(line)
    if args.json:
        args.json.write_text(json.dumps(dict(rows=[r.__dict__ for r in rows], details=details), indent=1))


if __name__ == "__main__":
    main()
