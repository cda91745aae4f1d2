"""Cases of the draft-tree ops (candidate_topk, expand_level, prune_tree, verify_tree and the whole
DARTree build of one round), for bench/op_bench.py to check and time.

    cases(device)         -> [dict(name, kernel, reference, bytes[, compare])]  realistic shapes;
                             kernel and reference are zero-argument callables; bytes = what the
                             kernel must read + write (None where it is not memory-bound)
    round_stages(device)  -> [dict(name, kernel, reference)]  each tree-build stage of one round at
                             the DARTree default config (`ROUND`); reference: the stage on the
                             reference ops (None for a stage without a dartree kernel)
"""

from __future__ import annotations

import torch

from dartree import ops, reference
from dartree.tree import DraftBlock, build_dartree, dartree_schedule, dartree_sizes

# the DARTree default round (DESIGN.md): block 16, W=12, C=64, N=64, beta=-0.2
SLOTS, WIDTH, CANDIDATES, BUDGET, BONUS = 16, 12, 64, 64, -0.2
# the round of `round_stages`: a Domino head of hidden 256, GRU 256, rank 64 over 8192 tokens
ROUND = ("DARTree tree build per round (16 levels, W=12, C=64, N=64, G=256, r=64, V=8192, "
         "float32)")


def default_round(device, vocab=8192, hidden=256, gru=256, rank=64, seed=0):
    """A DraftBlock with a random Domino head at the given sizes (float32)."""
    from dartree.drafter import DominoHead

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = DominoHead(hidden, vocab, emb_dim=rank, gru_hidden_dim=gru).to(device)
    head.build_input_table(torch.randn(vocab, hidden, generator=gen).to(device) * 0.05)
    head.requires_grad_(False)
    logits = (torch.randn(SLOTS, vocab, generator=gen) * 3).to(device)
    z = head.project(torch.randn(SLOTS, hidden, generator=gen).to(device))
    return DraftBlock(torch.tensor([5], device=device), logits, head, z, 1)


def _supertree(device, levels=16, width=12, seed=0):
    """A DARTree-shaped candidate tree: `levels` levels of `width` nodes, scores decreasing."""
    gen = torch.Generator().manual_seed(seed)
    parents, depths, scores = [-1], [0], [0.0]
    start, count = 0, 1
    for depth in range(1, levels + 1):
        for _ in range(width):
            parent = start + int(torch.randint(count, (1,), generator=gen))
            parents.append(parent)
            depths.append(depth)
            scores.append(scores[parent] - float(torch.rand(1, generator=gen)) * 1.5)
        start, count = len(parents) - width, width
    return (torch.tensor(parents, device=device), torch.tensor(depths, device=device),
            torch.tensor(scores, device=device))


def cases(device) -> list[dict]:
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    out = []

    # candidate top-k over a 152k vocabulary (Qwen-sized), k = 16 slots, C = 64
    logits = (torch.randn(SLOTS, 152064, generator=gen) * 3).to(device)
    out.append(dict(name="candidate_topk k=16 V=152064 C=64 f32",
                    kernel=lambda: ops.candidate_topk(logits, CANDIDATES),
                    reference=lambda: reference.candidate_topk(logits, CANDIDATES),
                    bytes=logits.numel() * 4 + SLOTS * CANDIDATES * 12 + SLOTS * 4))
    logits16 = logits.to(torch.bfloat16)
    out.append(dict(name="candidate_topk k=16 V=152064 C=64 bf16",
                    kernel=lambda: ops.candidate_topk(logits16, CANDIDATES),
                    reference=lambda: reference.candidate_topk(logits16, CANDIDATES),
                    bytes=logits16.numel() * 2 + SLOTS * CANDIDATES * 12 + SLOTS * 4))

    # one corrected level with its GRU step: W = 12 parents, C = E = 64, G = 1024, r = 256
    f, C, G, r, vocab = WIDTH, CANDIDATES, 1024, 256, 8192

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    level = dict(parent_scores=-torch.rand(f, generator=gen).to(device) * 3,
                 parent_states=rand(f, G, scale=0.5), z=rand(r), w_s=rand(r, G, scale=0.03),
                 cand_w2=rand(C, r, scale=0.1), cand_b2=rand(C), cand_base=rand(C).sort(descending=True).values,
                 cand_ids=torch.randperm(vocab, generator=gen)[:C].to(device), num_expand=C,
                 num_select=WIDTH, input_table=rand(vocab, 3 * G, scale=0.5),
                 w_hh=rand(3 * G, G, scale=0.03), b_hh=rand(3 * G))
    level_bytes = 4 * (r * G + C * r + 3 * G * G + 3 * G * WIDTH + f * G + WIDTH * G)
    out.append(dict(name="expand_level f=12 C=64 G=1024 r=256 f32",
                    kernel=lambda: ops.expand_level(**level),
                    reference=lambda: reference.expand_level(**level), bytes=level_bytes))

    # pruning: N = 64 of a 193-node supertree (16 levels x 12 + root)
    parents, depths, scores = _supertree(device)
    out.append(dict(name="prune_tree M=193 N=65",
                    kernel=lambda: ops.prune_tree(parents, depths, scores, BUDGET, BONUS),
                    reference=lambda: reference.prune_tree(parents, depths, scores, BUDGET, BONUS),
                    bytes=parents.numel() * 24 + 65 * 16))

    def reference_layout():
        kept, new_parents = reference.prune_tree(parents, depths, scores, BUDGET, BONUS)
        return kept, new_parents, reference.tree_layout(new_parents)

    def compare_layout():
        layout = ops.prune_tree_layout(parents, depths, scores, BUDGET, BONUS, check=False)
        kernel = (layout.kept, layout.parents, (layout.ancestors, layout.first_child, layout.next_sibling))
        return kernel, reference_layout()

    out.append(dict(name="prune_tree + verify layout M=193 N=65",
                    kernel=lambda: ops.prune_tree_layout(parents, depths, scores, BUDGET, BONUS, check=False),
                    reference=reference_layout, compare=compare_layout,
                    bytes=parents.numel() * 24 + 65 * (40 + 12)))

    # the verify walk on a pruned 65-node tree
    kept, tree_parents = reference.prune_tree(parents, depths, scores, BUDGET, BONUS)
    tokens = torch.randint(4, (kept.numel(),), generator=gen).to(device)
    target = torch.randint(4, (kept.numel(),), generator=gen).to(device)

    def compare_verify():  # the padded kernel output: the path, then -1 up to T
        accepted, count, bonus = ops.verify_tree_padded(tree_parents, tokens, target)
        assert bool((accepted[int(count):] == -1).all()), "verify_tree: padding is not -1"
        return (accepted[:int(count)], bonus), reference.verify_tree(tree_parents, tokens, target)

    out.append(dict(name="verify_tree T=65",
                    kernel=lambda: ops.verify_tree_padded(tree_parents, tokens, target),
                    reference=lambda: reference.verify_tree(tree_parents, tokens, target),
                    compare=compare_verify, bytes=65 * 8 * 4 + 16))

    # the whole DARTree build of one round (the 2 ms target on CPU)
    block = default_round(device)
    kwargs = dict(width=WIDTH, candidates=CANDIDATES, budget=BUDGET, depth_bonus=BONUS)

    def build_reference():
        with ops.reference_ops():
            return build_dartree(block, **kwargs)

    out.append(dict(name="build_dartree round V=8192 G=256 r=64",
                    kernel=lambda: build_dartree(block, **kwargs), reference=build_reference,
                    bytes=None))
    return out


def _on_reference_ops(fn):
    def run():
        with ops.reference_ops():
            return fn()
    return run


def round_stages(device) -> list[dict]:
    """Each tree-build stage of one round at the default config (`ROUND`), the per-level ops and the
    pruning alone beside the fused build."""
    device = torch.device(device)
    block = default_round(device)
    head = block.head
    slots, vocab = block.base_logits.shape
    num_cand, num_expand = dartree_sizes(vocab, CANDIDATES, CANDIDATES, BUDGET)
    plan = dartree_schedule(slots, num_expand, WIDTH, BUDGET, fixed=False)
    root = block._root_tensor()
    values, ids, _ = ops.candidate_topk(block.base_logits, num_cand, with_lse=False)
    root_state = head.root_state(root)
    w2, z = head.W_2[ids], block.z  # the per-level op takes gathered rows; the build reads W_2
    # as tree.build_dartree calls it: the root state (GRU(table[b], 0)) is computed in the op
    tree_args = (values, ids, root, None, z, head.W_s, head.W_2, None, head.input_table,
                 head.W_hh, None, num_expand, plan, block.prefix_len, BUDGET, BONUS)
    supertree = reference.build_dartree(*tree_args[:14], 10 ** 9, BONUS)  # the unpruned tree

    def levels_one_by_one():
        state, frontier_scores = root_state, torch.zeros(1, device=device)
        for depth, count in enumerate(plan):
            correction = (z[depth], head.W_s, w2[depth], None) if depth >= block.prefix_len else (None,) * 4
            gru = (head.input_table, head.W_hh, None) if depth + 1 < len(plan) else (None,) * 3
            level = ops.expand_level(frontier_scores, state, *correction, values[depth], ids[depth],
                                     num_expand, count, *gru)
            _, _, frontier_scores, state = level
        return level

    kwargs = dict(width=WIDTH, candidates=CANDIDATES, budget=BUDGET, depth_bonus=BONUS)
    stages = [
        ("candidate_topk (16 x 8192 -> 64, no lse)",
         lambda: ops.candidate_topk(block.base_logits, num_cand, with_lse=False)),
        ("build_dartree op: root GRU, 16 levels, prune", lambda: ops.build_dartree(*tree_args)),
        ("  vs 16 expand_level calls (every level, no bound)", levels_one_by_one),
        ("  vs prune_tree op alone (193 -> 65 nodes)",
         lambda: ops.prune_tree(supertree[1], supertree[2], supertree[3], BUDGET, BONUS)),
        ("tree.build_dartree, the whole round", lambda: build_dartree(block, **kwargs)),
    ]
    out = [dict(name=name, kernel=fn, reference=_on_reference_ops(fn)) for name, fn in stages]
    # not dartree kernels: the Domino head's root state in torch ops, and the whole round on the
    # reference ops (the reference of the stage above)
    out.append(dict(name="(not in the round) head.root_state in torch ops",
                    kernel=lambda: head.root_state(root), reference=None))
    out.append(dict(name="tree.build_dartree with the reference ops",
                    kernel=_on_reference_ops(lambda: build_dartree(block, **kwargs)), reference=None))
    return out
