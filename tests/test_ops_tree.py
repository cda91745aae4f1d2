"""The draft-tree ops (candidate_topk, expand_level, build_dartree, prune_tree, verify_tree) against
dartree.reference on fresh random inputs, with outputs poisoned before every call; bad inputs;
opcheck; torch.compile. CUDA cases skip without a GPU."""

import pytest
import torch

from dartree import ops, reference
from dartree.tree import DraftBlock, build_dartree, build_dartree_reference, dartree_schedule

POISON_INT = -7777


def poison(*shape, dtype, device):
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, POISON_INT, dtype=dtype, device=device)


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# candidate_topk


def run_topk(logits, count, with_lse=True):
    rows, dtype, device = logits.shape[0], compute_dtype(logits.dtype), logits.device
    values = poison(rows, count, dtype=dtype, device=device)
    ids = poison(rows, count, dtype=torch.int64, device=device)
    lse = poison(rows if with_lse else 0, dtype=dtype, device=device)
    torch.ops.dartree.candidate_topk(logits, values, ids, lse)
    return values, ids, lse


TOPK_SHAPES = [(1, 1, 1), (3, 37, 11), (1, 5, 5), (16, 1000, 64), (4, 8193, 64), (2, 20000, 100),
               (5, 4099, 1), (2, 3000, 1024)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, count", TOPK_SHAPES)
def test_candidate_topk_matches_reference(native, device, dtype, rows, vocab, count):
    gen = torch.Generator().manual_seed(vocab * 31 + count)
    for logits in (torch.randn(rows, vocab, generator=gen) * 4,
                   torch.randint(-6, 6, (rows, vocab), generator=gen).float()):  # ties everywhere
        logits = logits.to(dtype).to(device)
        values, ids, lse = run_topk(logits, count)
        want_values, want_ids, want_lse = reference.candidate_topk(logits, count)
        assert torch.equal(ids, want_ids)
        assert torch.equal(values, want_values)  # copies of the inputs: exact
        torch.testing.assert_close(lse, want_lse, **tol(dtype))
        _, skipped_ids, empty = run_topk(logits, count, with_lse=False)
        assert torch.equal(skipped_ids, want_ids) and empty.numel() == 0


def test_candidate_topk_infinities(native, device):
    logits = torch.randn(4, 3000)
    logits[0, ::7] = float("inf")
    logits[1] = -float("inf")
    logits[2, 5] = -float("inf")
    logits[3, 2900:] = float("inf")
    logits = logits.to(device)
    values, ids, lse = run_topk(logits, 50)
    want_values, want_ids, want_lse = reference.candidate_topk(logits, 50)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    torch.testing.assert_close(lse, want_lse)


def test_candidate_topk_wrapper(native, device):
    logits = torch.randn(3, 500, device=device)
    values, ids, lse = ops.candidate_topk(logits, 20)
    want = reference.candidate_topk(logits, 20)
    assert torch.equal(ids, want[1]) and torch.equal(values, want[0])
    torch.testing.assert_close(lse, want[2])
    assert ops.candidate_topk(logits, 20, with_lse=False)[2] is None
    strided = torch.randn(500, 3, device=device).T  # the wrapper makes it contiguous
    assert torch.equal(ops.candidate_topk(strided, 7)[1], reference.candidate_topk(strided, 7)[1])


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.randn(2, 10), 11), "num_candidates must be in \\[1, 10\\]"),
    (lambda: (torch.randn(2, 10), 0), "num_candidates must be in"),
    (lambda: (torch.randn(10), 3), "\\[k, V\\]"),
    (lambda: (torch.randint(0, 5, (2, 10)), 3), "float"),
])
def test_candidate_topk_bad_input(native, make, match):
    logits, count = make()
    with pytest.raises(ValueError, match=match):
        ops.candidate_topk(logits, count)


def test_candidate_topk_raw_op_checks(native):
    logits = torch.randn(3, 40)
    good = dict(values=torch.empty(3, 5), ids=torch.empty(3, 5, dtype=torch.long), lse=torch.empty(3))
    cases = [
        (dict(logits=torch.randn(40, 3).T), "contiguous"),
        (dict(values=torch.empty(3, 5, dtype=torch.float64)), "values must be torch.float32|Float"),
        (dict(values=torch.empty(2, 5)), "values must have shape \\[3, 5\\]"),
        (dict(ids=torch.empty(3, 5, dtype=torch.int32)), "ids must be"),
        (dict(lse=torch.empty(4)), "lse must have shape \\[3\\]"),
        (dict(values=torch.empty(3, 10, 2)[:, :5, 0]), "values must be contiguous"),
    ]
    for bad, match in cases:
        args = dict(logits=logits, **good)
        args.update(bad)
        with pytest.raises(ValueError, match=match):
            torch.ops.dartree.candidate_topk(args["logits"], args["values"], args["ids"], args["lse"])


# ---------------------------------------------------------------------------------------------
# expand_level


def level_inputs(seed, count, width, expand, rank, gru, vocab, dtype, device, corrected=True,
                 bias=True, table_dtype=None):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)

    ids = torch.randperm(vocab, generator=gen)[:width].to(device)
    base = torch.sort(rand(width, scale=2.0), descending=True).values
    table = rand(vocab, 3 * gru, scale=0.5)
    if table_dtype is not None:
        table = table.to(table_dtype)
    return dict(
        parent_scores=-torch.rand(count, generator=gen, dtype=torch.float64).to(dtype).to(device) * 3,
        parent_states=rand(count, gru, scale=0.5),
        z=rand(rank) if corrected else None,
        w_s=rand(rank, gru, scale=0.3) if corrected else None,
        cand_w2=rand(width, rank, scale=0.3) if corrected else None,
        cand_b2=rand(width) if corrected and bias else None,
        cand_base=base, cand_ids=ids, num_expand=expand,
        input_table=table, w_hh=rand(3 * gru, gru, scale=0.2), b_hh=rand(3 * gru) if bias else None)


def run_level(args, num_select):
    """The raw op with poisoned outputs."""
    scores = args["parent_scores"]
    device, dtype = scores.device, scores.dtype
    gru = args["parent_states"].shape[1] if args["input_table"] is not None else 0
    parent_pos = poison(num_select, dtype=torch.int64, device=device)
    tokens = poison(num_select, dtype=torch.int64, device=device)
    out_scores = poison(num_select, dtype=dtype, device=device)
    states = poison(*((num_select, gru) if args["input_table"] is not None else (0,)), dtype=dtype,
                    device=device)
    torch.ops.dartree.expand_level(
        scores, args["parent_states"], args["z"], args["w_s"], args["cand_w2"], args["cand_b2"],
        args["cand_base"], args["cand_ids"], args["num_expand"], args["input_table"], args["w_hh"],
        args["b_hh"], parent_pos, tokens, out_scores, states)
    return parent_pos, tokens, out_scores, (states if args["input_table"] is not None else None)


def reference_level(args, num_select):
    return reference.expand_level(num_select=num_select, **args)


LEVEL_SHAPES = [
    # f, C, E, Q, r, G, V
    (1, 1, 1, 1, 1, 1, 3),  # everything 1
    (12, 64, 64, 12, 64, 256, 500),  # the DARTree default level
    (5, 13, 9, 17, 6, 10, 50),  # W x C not a power of two, Q > f
    (3, 7, 7, 21, 5, 9, 30),  # select every pair
    (16, 37, 20, 1, 33, 70, 100),
    (2, 256, 3, 6, 17, 33, 300),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", LEVEL_SHAPES)
@pytest.mark.parametrize("corrected, bias, gru", [(True, True, True), (True, False, True),
                                                  (False, True, True), (True, True, False),
                                                  (False, False, False)])
def test_expand_level_matches_reference(native, device, dtype, shape, corrected, bias, gru):
    count, width, expand, select, rank, gru_width, vocab = shape
    args = level_inputs(sum(shape), count, width, expand, rank, gru_width, vocab, dtype, device,
                        corrected=corrected, bias=bias)
    if not gru:
        args.update(input_table=None, w_hh=None, b_hh=None)
    got = run_level(args, select)
    want = reference_level(args, select)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], **tol(dtype))
    if gru:
        torch.testing.assert_close(got[3], want[3], **tol(dtype))
    else:
        assert got[3] is None and want[3] is None


@pytest.mark.parametrize("table_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_expand_level_reads_the_table_in_its_own_dtype(native, device, table_dtype):
    args = level_inputs(3, 6, 20, 10, 8, 24, 90, torch.float32, device, table_dtype=table_dtype)
    got, want = run_level(args, 9), reference_level(args, 9)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[3], want[3], **tol(torch.float32))


def test_expand_level_ties_prefer_lower_parent_then_candidate(native, device):
    args = dict(parent_scores=torch.zeros(3, device=device), parent_states=None, z=None, w_s=None,
                cand_w2=None, cand_b2=None, cand_base=torch.zeros(4, device=device),
                cand_ids=torch.tensor([7, 8, 9, 6], device=device), num_expand=4, input_table=None,
                w_hh=None, b_hh=None)
    parent_pos, tokens, _, _ = run_level(args, 6)
    assert parent_pos.tolist() == [0, 0, 0, 0, 1, 1]
    assert tokens.tolist() == [7, 8, 9, 6, 7, 8]


def test_expand_level_wrapper(native, device):
    args = level_inputs(5, 4, 12, 12, 6, 10, 40, torch.float64, device)
    args["w_s"] = torch.cat([args["w_s"], args["w_s"]], dim=1)[:, :10]  # a strided column slice
    got = ops.expand_level(num_select=7, **args)
    want = reference_level(args, 7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def bad_level_cases():
    def base(**changes):
        args = level_inputs(1, 3, 8, 5, 4, 6, 20, torch.float32, "cpu")
        args.update(changes)
        return args
    return [
        (base(parent_scores=torch.zeros(0)), 4, "frontier is empty"),
        (base(), 16, "num_select must be in \\[1, 15\\]"),
        (base(num_expand=9), 4, "num_expand must be in \\[1, 8\\]"),
        (base(parent_states=torch.zeros(3, 7)), 4, "w_s must have shape|input_table must be"),
        (base(cand_ids=torch.arange(8, dtype=torch.int32)), 4, "cand_ids must be"),
        (base(cand_ids=torch.tensor([0, 1, 2, 3, 99, 5, 6, 7])), 4, "outside the input_table vocabulary"),
        (base(cand_ids=torch.tensor([0, 1, -2, 3, 4, 5, 6, 7])), 4, "outside the input_table vocabulary"),
        (base(w_hh=None), 4, "needs w_hh"),
        (base(z=torch.zeros(5)), 4, "w_s must have shape \\[5, 6\\]"),
        (base(cand_base=torch.zeros(8, dtype=torch.float64)), 4, "cand_base must be"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_expand_level_bad_input(native, case):
    args, select, match = bad_level_cases()[case]
    with pytest.raises(ValueError, match=match):
        run_level(args, select)


@pytest.mark.parametrize("bad_id", [99, -2])
def test_expand_level_bad_token_ids_raise_on_every_device(native, device, bad_id):
    """A GRU token outside input_table raises on CUDA as on the CPU (not NaN states)."""
    args = level_inputs(1, 3, 8, 5, 4, 6, 20, torch.float32, device)
    args["cand_ids"] = torch.tensor([0, 1, 2, 3, bad_id, 5, 6, 7], device=device)
    with pytest.raises(ValueError, match=f"candidate id {bad_id} is outside the input_table "
                                         "vocabulary \\[0, 20\\)"):
        run_level(args, 4)


def test_expand_level_raw_op_layout_checks(native):
    args = level_inputs(1, 3, 8, 5, 4, 6, 20, torch.float32, "cpu")
    args["parent_states"] = torch.randn(6, 3).T  # non-contiguous
    with pytest.raises(ValueError, match="parent_states must be contiguous"):
        run_level(args, 4)
    args = level_inputs(1, 3, 8, 5, 4, 6, 20, torch.float32, "cpu")
    args["w_hh"] = torch.randn(6, 18).T  # columns strided
    with pytest.raises(ValueError, match="unit stride"):
        run_level(args, 4)
    args = level_inputs(1, 3, 8, 5, 4, 6, 20, torch.float32, "cpu")
    args["input_table"] = None  # states output must then be empty
    with pytest.raises(ValueError, match="states must be empty"):
        torch.ops.dartree.expand_level(
            args["parent_scores"], args["parent_states"], args["z"], args["w_s"], args["cand_w2"],
            args["cand_b2"], args["cand_base"], args["cand_ids"], 5, None, None, None,
            torch.empty(4, dtype=torch.long), torch.empty(4, dtype=torch.long), torch.empty(4),
            torch.empty(4, 6))


# ---------------------------------------------------------------------------------------------
# prune_tree and the verify layout


def random_scored_tree(seed, size, dtype=torch.float32, shape="random"):
    gen = torch.Generator().manual_seed(seed)
    parents, depths, scores = [-1], [0], [0.0]
    for node in range(1, size):
        if shape == "chain":
            parent = node - 1
        elif shape == "star":
            parent = 0
        else:
            parent = int(torch.randint(node, (1,), generator=gen))
        parents.append(parent)
        depths.append(depths[parent] + 1)
        scores.append(scores[parent] - float(torch.rand(1, generator=gen)) * 2)
    return torch.tensor(parents), torch.tensor(depths), torch.tensor(scores, dtype=dtype)


def run_prune(parents, depths, scores, size, bonus):
    device = parents.device
    out = [poison(size, dtype=torch.int64, device=device) for _ in range(3)]
    ancestors = poison(size, -(-size // 32), dtype=torch.int32, device=device)
    links = [poison(size, dtype=torch.int64, device=device) for _ in range(2)]
    status = poison(1, dtype=torch.int32, device=device)
    torch.ops.dartree.prune_tree(parents, depths, scores, bonus, *out, ancestors, *links, status)
    return (*out, ancestors, *links, status)


PRUNE_CASES = [(1, 1, "random"), (2, 1, "random"), (40, 7, "random"), (40, 39, "random"),
               (192, 64, "random"), (100, 33, "chain"), (100, 33, "star"), (70, 69, "star"),
               (300, 200, "random")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size, budget, shape", PRUNE_CASES)
@pytest.mark.parametrize("bonus", [0.0, -0.2, -1.0])
def test_prune_tree_matches_reference(native, device, dtype, size, budget, shape, bonus):
    parents, depths, scores = (t.to(device) for t in random_scored_tree(size + budget, size, dtype, shape))
    count = 1 + min(budget, size - 1)
    kept, new_parents, new_depths, ancestors, first_child, next_sibling, status = run_prune(
        parents, depths, scores, count, bonus)
    want_kept, want_parents = reference.prune_tree(parents, depths, scores, budget, bonus)
    assert torch.equal(kept, want_kept) and torch.equal(new_parents, want_parents)
    assert torch.equal(new_depths, depths[want_kept])
    want_ancestors, want_first, want_next = reference.tree_layout(want_parents)
    assert torch.equal(ancestors, want_ancestors)
    assert torch.equal(first_child, want_first) and torch.equal(next_sibling, want_next)
    assert status.tolist() == [0]
    layout = ops.prune_tree_layout(parents, depths, scores, budget, bonus)
    assert torch.equal(layout.kept, want_kept) and torch.equal(layout.ancestors, want_ancestors)
    assert [t.tolist() for t in ops.prune_tree(parents, depths, scores, budget, bonus)] == \
        [want_kept.tolist(), want_parents.tolist()]


def test_prune_tree_ties_keep_lower_index(native, device):
    parents = torch.tensor([-1, 0, 0, 0, 1], device=device)
    depths = torch.tensor([0, 1, 1, 1, 2], device=device)
    kept, new_parents = ops.prune_tree(parents, depths, torch.tensor([0.0, -1, -1, -1, -1], device=device),
                                       2, 0.0)
    assert kept.tolist() == [0, 1, 2] and new_parents.tolist() == [-1, 0, 0]


def test_ancestor_mask_unpacks_to_the_tree_mask(native):
    from dartree.tree import DraftTree

    parents, depths, scores = random_scored_tree(5, 70)
    layout = ops.prune_tree_layout(parents, depths, scores, 50, -0.1)
    tree = DraftTree(layout.kept, layout.parents, layout.depths, scores[layout.kept])
    words = layout.ancestors.long() & 0xFFFFFFFF
    bits = (words[:, :, None] >> torch.arange(32)) & 1
    mask = bits.reshape(words.shape[0], -1)[:, :tree.num_nodes].bool()
    assert torch.equal(mask, tree.ancestor_mask())


@pytest.mark.parametrize("make, count, match", [
    (lambda: random_scored_tree(0, 5), 6, "N = 1 \\+ budget must be in \\[1, 5\\]"),
    (lambda: (torch.tensor([-1, 0, 3, 1]), torch.tensor([0, 1, 2, 2]), torch.zeros(4)), 3,
     "parents\\[2\\] = 3 is out of range"),
    (lambda: (torch.tensor([-1, 0, -1, 1]), torch.tensor([0, 1, 2, 2]), torch.zeros(4)), 3,
     "parents\\[2\\] = -1 is out of range"),
    (lambda: (torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]), torch.zeros(3)), 2,
     "parents\\[0\\] must be -1"),
    (lambda: (torch.tensor([-1, 0, 0, 0, 1]), torch.tensor([0, 1, 1, 1, 2]),
              torch.tensor([0.0, -3, -1, -1, -0.5])), 2, "parent was pruned"),
    (lambda: (torch.tensor([-1, 0]), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int64)), 2,
     "scores must be float32 or float64"),
    (lambda: (torch.tensor([-1, 0]), torch.tensor([0, 1, 2]), torch.zeros(2)), 2,
     "depths must have shape \\[2\\]"),
    (lambda: (torch.tensor([-1, 0], dtype=torch.int32), torch.tensor([0, 1]), torch.zeros(2)), 2,
     "parents must be"),
    (lambda: (torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), torch.zeros(0)), 1,
     "M >= 1"),
])
def test_prune_tree_bad_input(native, make, count, match):
    parents, depths, scores = make()
    with pytest.raises(ValueError, match=match):
        run_prune(parents, depths, scores, count, 0.0)


def test_prune_tree_wrapper_rejects_bad_budget(native):
    with pytest.raises(ValueError, match="budget must be >= 1"):
        ops.prune_tree(*random_scored_tree(0, 5), 0, 0.0)


# ---------------------------------------------------------------------------------------------
# verify_tree


def run_verify(parents, tokens, target, first_child=None, next_sibling=None):
    size, device = parents.shape[0], parents.device
    accepted = poison(size, dtype=torch.int64, device=device)
    count = poison(dtype=torch.int64, device=device)
    bonus = poison(dtype=torch.int64, device=device)
    torch.ops.dartree.verify_tree(parents, tokens, target, first_child, next_sibling, accepted, count, bonus)
    return accepted, count, bonus


def random_verify_case(seed, size, shape="random", vocab=4):
    parents, _, _ = random_scored_tree(seed, size, shape=shape)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(vocab, (size,), generator=gen)
    target = torch.randint(vocab, (size,), generator=gen)
    return parents, tokens, target


@pytest.mark.parametrize("size, shape", [(1, "random"), (2, "chain"), (65, "random"), (65, "chain"),
                                         (65, "star"), (300, "random")])
@pytest.mark.parametrize("links", [False, True])
def test_verify_tree_matches_reference(native, device, size, shape, links):
    for seed in range(5):
        parents, tokens, target = (t.to(device) for t in random_verify_case(seed, size, shape,
                                                                               vocab=2 + seed))
        if shape == "chain" and seed % 2:
            target = torch.roll(tokens, -1)  # every node accepted
        extra = reference.tree_layout(parents)[1:] if links else (None, None)
        accepted, count, bonus = run_verify(parents, tokens, target, *extra)
        path, want_bonus = reference.verify_tree(parents, tokens, target)
        length = path.shape[0]
        assert int(count) == length
        assert torch.equal(accepted[:length], path) and bool((accepted[length:] == -1).all())
        assert int(bonus) == int(want_bonus)
        got_path, got_bonus = ops.verify_tree(parents, tokens, target, *extra)
        assert torch.equal(got_path, path) and int(got_bonus) == int(want_bonus)


def test_verify_tree_prefers_the_lowest_index_child(native, device):
    parents = torch.tensor([-1, 0, 0, 1, 2], device=device)
    tokens = torch.tensor([9, 5, 5, 6, 6], device=device)
    accepted, count, bonus = run_verify(parents, tokens, torch.tensor([5, 6, 6, 1, 2], device=device))
    assert accepted.tolist() == [0, 1, 3, -1, -1] and int(count) == 3 and int(bonus) == 1


@pytest.mark.parametrize("parents, match", [
    ([0, 0, 1], "parents\\[0\\] == -1"),
    ([-1, 1, 1], "out of range"),
    ([-1, 0, 5], "out of range"),
    ([-1, 0, -3], "out of range"),
])
def test_verify_tree_rejects_bad_parents(native, parents, match):
    parents = torch.tensor(parents)
    with pytest.raises(ValueError, match=match):
        run_verify(parents, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="parents"):
        ops.verify_tree(parents, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def test_verify_tree_rejects_bad_links_and_shapes(native):
    parents = torch.tensor([-1, 0, 0])
    zeros = torch.zeros(3, dtype=torch.long)
    no_match = torch.tensor([0, 5, 5])  # the walk follows every link of the root
    with pytest.raises(ValueError, match="first_child / next_sibling"):
        run_verify(parents, no_match, zeros, torch.tensor([2, -1, -1]), torch.tensor([-1, -1, 1]))
    with pytest.raises(ValueError, match="first_child / next_sibling"):  # checked even if not walked
        run_verify(parents, zeros, zeros, torch.tensor([1, -1, -1]), torch.tensor([-1, 2, 7]))
    with pytest.raises(ValueError, match="first_child / next_sibling"):
        run_verify(parents, zeros, zeros, torch.tensor([0, -1, -1]), torch.tensor([-1, -1, -1]))
    with pytest.raises(ValueError, match="given together"):
        run_verify(parents, zeros, zeros, torch.tensor([1, -1, -1]), None)
    with pytest.raises(ValueError, match="target_tokens must have shape \\[3\\]"):
        run_verify(parents, zeros, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must be"):
        run_verify(parents, zeros.int(), zeros)
    with pytest.raises(ValueError, match="non-empty"):
        run_verify(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                   torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        run_verify(parents, torch.zeros(3, 2, dtype=torch.long)[:, 0], zeros)


# ---------------------------------------------------------------------------------------------
# build_dartree (the whole build in one op) against the reference composition of the level ops


def build_inputs(seed, slots, vocab, count, rank, gru, dtype, device, head=True, bias=True, table=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)

    logits = rand(slots, vocab, scale=2.0)
    values, ids, _ = reference.candidate_topk(logits, count)
    values, ids = values.contiguous(), ids.contiguous()
    args = dict(cand_values=values, cand_ids=ids, root=torch.tensor([3], device=device),
                root_state=None, z=None, w_s=None, w_2=None, b_2=None, input_table=None,
                w_hh=None, b_hh=None)
    if head:
        w_2, b_2 = rand(vocab, rank, scale=0.5), rand(vocab) if bias else None
        args.update(root_state=rand(gru, scale=0.5), z=rand(slots, rank), w_s=rand(rank, gru, scale=0.3),
                    w_2=w_2 if table else w_2[ids],
                    b_2=None if b_2 is None else b_2 if table else b_2[ids],
                    input_table=rand(vocab, 3 * gru, scale=0.5), w_hh=rand(3 * gru, gru, scale=0.2),
                    b_hh=rand(3 * gru) if bias else None)
    return args


def run_build(args, num_expand, plan, prefix_len, budget, bonus):
    dtype, device = args["cand_values"].dtype, args["cand_values"].device
    size = 1 + min(budget, sum(plan))
    outs = [poison(size, dtype=torch.int64, device=device) for _ in range(3)]
    scores = poison(size, dtype=dtype, device=device)
    status = poison(1, dtype=torch.int32, device=device)
    torch.ops.dartree.build_dartree(*args.values(), num_expand, plan, prefix_len, bonus, *outs, scores,
                                    status)
    return (*outs, scores, status)


BUILD_CASES = [
    # slots, vocab, C, E, width, budget, prefix_len, fixed, rank, gru
    (16, 300, 64, 64, 12, 64, 1, False, 16, 24),  # the default shape, small head
    (5, 40, 7, 7, 3, 9, 1, False, 5, 6),  # W x C = 21
    (4, 30, 10, 10, 4, 100, 0, False, 5, 6),  # no pruning
    (4, 30, 10, 10, 4, 1, 1, False, 3, 4),  # budget 1
    (5, 50, 20, 5, 6, 30, 2, False, 4, 5),  # E < C
    (6, 40, 7, 7, 3, 11, 0, True, 4, 4),  # fixed quotas
    (3, 8, 8, 8, 3, 64, 1, True, 3, 3),
    (1, 20, 5, 5, 3, 4, 0, False, 3, 3),  # one level: no GRU step
    (5, 40, 9, 9, 4, 15, 9, False, 3, 3),  # no corrected level
    (16, 500, 32, 32, 8, 20, 1, False, 8, 12),  # deep and narrow budget: bound pruning stops early
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", BUILD_CASES)
@pytest.mark.parametrize("head, bias, table", [(True, True, False), (True, False, False),
                                               (True, True, True), (False, False, False)])
def test_build_dartree_matches_reference(native, device, dtype, case, head, bias, table):
    slots, vocab, count, expand, width, budget, prefix_len, fixed, rank, gru = case
    plan = dartree_schedule(slots, expand, width, budget, fixed)
    args = build_inputs(sum(case[:6]), slots, vocab, count, rank, gru, dtype, device, head, bias, table)
    got = run_build(args, expand, plan, prefix_len, budget, -0.3)
    want = reference.build_dartree(*args.values(), expand, plan, prefix_len, budget, -0.3)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[3], want[3], **tol(dtype))
    assert got[4].tolist() == [0]
    wrapped = ops.build_dartree(*args.values(), expand, plan, prefix_len, budget, -0.3)
    assert torch.equal(wrapped[1], want[1])
    if head:  # the root state computed in the op: GRU(input_table[root], 0)
        args["root_state"] = None
        got = run_build(args, expand, plan, prefix_len, budget, -0.3)
        want = reference.build_dartree(*args.values(), expand, plan, prefix_len, budget, -0.3)
        for a, b in zip(got[:3], want[:3]):
            assert torch.equal(a, b)
        torch.testing.assert_close(got[3], want[3], **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("budget", [1, 5, 17, 40])
def test_build_dartree_bound_pruning_with_ties(native, device, dtype, budget):
    """Integer logits and a zero correction make many pairs tie exactly: the bounded build
    (skipped GRU steps, -inf children, early stop) still keeps the reference's nodes in order."""
    args = build_inputs(budget, 10, 60, 12, 4, 6, dtype, device, head=True)
    args["cand_values"] = args["cand_values"].round()
    args["w_2"], args["b_2"] = args["w_2"] * 0, args["b_2"] * 0
    plan = dartree_schedule(10, 12, 6, budget, False)
    got = run_build(args, 12, plan, 3, budget, -0.5)
    want = reference.build_dartree(*args.values(), 12, plan, 3, budget, -0.5)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[3], want[3], **tol(dtype))


def test_build_dartree_bad_input(native):
    args = build_inputs(0, 4, 30, 10, 3, 4, torch.float32, "cpu", table=True)
    cases = [
        (dict(plan=[4, 4, 4, 4, 4]), "plan must have between 1 and k = 4 levels"),
        (dict(plan=[11, 4]), "plan\\[0\\] = 11 must be in \\[1, 10\\]"),
        (dict(plan=[2, 0]), "plan\\[1\\] = 0"),
        (dict(num_expand=11), "num_expand must be in \\[1, 10\\]"),
        (dict(prefix_len=-1), "prefix_len must be >= 0"),
        (dict(size=7), "N = tokens.size\\(0\\) must be 1 \\+ min\\(budget, 5\\)"),
        (dict(size=1), "N = tokens.size\\(0\\)"),
        (dict(root_state=None, input_table=None), "root_state \\[G\\] is needed"),
        (dict(root_state=None, w_hh=None), "root_state \\[G\\] is needed"),
        (dict(root_state=None, root=torch.tensor([30])), "root token 30 is outside"),
        (dict(cand_ids=args["cand_ids"].clone().index_fill_(1, torch.tensor([0]), 30)),
         "outside the W_2 vocabulary"),
        (dict(cand_ids=args["cand_ids"].clone().index_fill_(1, torch.tensor([9]), -1)),
         "outside the W_2 vocabulary"),
        (dict(w_2=args["w_2"][:, :2]), "w_2 must have shape \\[30, 3\\]"),
        (dict(b_2=torch.zeros(29)), "b_2 must have shape \\[30\\]"),
        (dict(z=args["z"][:3]), "z must be \\[k, r\\]"),
        (dict(w_hh=args["w_hh"].double()), "w_hh must be"),
        # level 1 corrected without the GRU that makes its parents' states
        (dict(input_table=None, w_hh=None, b_hh=None), "z corrects levels 1 to 1 .* give input_table"),
        (dict(input_table=None, w_hh=None, b_hh=None, prefix_len=1), "z corrects levels 1 to 1"),
    ]
    for change, match in cases:
        kw = dict(args)
        options = dict(num_expand=10, plan=[2, 3], prefix_len=0, size=6)
        for key, value in change.items():
            (options if key in options else kw)[key] = value
        outs = [torch.empty(options["size"], dtype=torch.long) for _ in range(3)]
        with pytest.raises(ValueError, match=match):
            torch.ops.dartree.build_dartree(*kw.values(), options["num_expand"], options["plan"],
                                            options["prefix_len"], -0.2, *outs,
                                            torch.empty(options["size"]),
                                            torch.empty(1, dtype=torch.int32))


@pytest.mark.parametrize("plan, prefix_len", [([4], 0), ([2, 3], 2), ([2, 3, 2], 5)])
def test_build_dartree_z_without_the_gru(native, device, plan, prefix_len):
    """z without input_table is fine while only level 0 is corrected (from root_state)."""
    args = build_inputs(1, 4, 30, 10, 3, 4, torch.float32, device, table=True)
    args.update(input_table=None, w_hh=None, b_hh=None)
    got = run_build(args, 10, plan, prefix_len, 6, -0.3)
    want = reference.build_dartree(*args.values(), 10, plan, prefix_len, 6, -0.3)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[3], want[3], **tol(torch.float32))


@pytest.mark.parametrize("fixed", [False, True])
def test_build_dartree_through_the_builder(native, device, fixed):
    """tree.build_dartree (one fused op) equals the literal per-node reference builder."""
    from test_tree import make_block

    block = make_block(11, 8, 120, prefix_len=1)
    if device.type == "cuda":
        pytest.skip("covered by tests/test_tree.py::test_builders_on_cuda_match_cpu")
    kwargs = dict(width=6, candidates=24, budget=20, depth_bonus=-0.25, fixed=fixed)
    fast, literal = build_dartree(block, **kwargs), build_dartree_reference(block, **kwargs)
    assert torch.equal(fast.tokens, literal.tokens) and torch.equal(fast.parents, literal.parents)
    torch.testing.assert_close(fast.scores, literal.scores, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# opcheck and torch.compile


def op_samples():
    logits = torch.randn(3, 50)
    yield torch.ops.dartree.candidate_topk.default, (logits, torch.empty(3, 5),
                                                     torch.empty(3, 5, dtype=torch.long), torch.empty(3))
    args = level_inputs(2, 3, 8, 5, 4, 6, 20, torch.float32, "cpu")
    yield torch.ops.dartree.expand_level.default, (
        *[args[k] for k in ("parent_scores", "parent_states", "z", "w_s", "cand_w2", "cand_b2",
                            "cand_base", "cand_ids", "num_expand", "input_table", "w_hh", "b_hh")],
        torch.empty(4, dtype=torch.long), torch.empty(4, dtype=torch.long), torch.empty(4),
        torch.empty(4, 6))
    parents, depths, scores = random_scored_tree(0, 30)
    yield torch.ops.dartree.prune_tree.default, (
        parents, depths, scores, -0.2, *[torch.empty(9, dtype=torch.long) for _ in range(3)],
        torch.empty(9, 1, dtype=torch.int32), torch.empty(9, dtype=torch.long),
        torch.empty(9, dtype=torch.long), torch.empty(1, dtype=torch.int32))
    parents, tokens, target = random_verify_case(0, 20)
    yield torch.ops.dartree.verify_tree.default, (
        parents, tokens, target, None, None, torch.empty(20, dtype=torch.long),
        torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long))
    build = build_inputs(0, 4, 30, 10, 3, 4, torch.float32, "cpu")
    yield torch.ops.dartree.build_dartree.default, (
        *build.values(), 10, [3, 3, 3, 3], 1, -0.2, *[torch.empty(7, dtype=torch.long) for _ in range(3)],
        torch.empty(7), torch.empty(1, dtype=torch.int32))


@pytest.mark.parametrize("index", range(5))
def test_opcheck(native, index):
    op, args = list(op_samples())[index]
    torch.library.opcheck(op, args)


def test_compile_fullgraph(native):
    logits = torch.randn(4, 300)
    parents, depths, scores = random_scored_tree(1, 40)
    vparents, vtokens, vtarget = random_verify_case(2, 30)

    @torch.compile(fullgraph=True)
    def pipeline(logits, parents, depths, scores, vparents, vtokens, vtarget):
        values = torch.empty(4, 8)
        ids = torch.empty(4, 8, dtype=torch.long)
        lse = torch.empty(4)
        torch.ops.dartree.candidate_topk(logits, values, ids, lse)
        kept = torch.empty(11, dtype=torch.long)
        new_parents = torch.empty(11, dtype=torch.long)
        new_depths = torch.empty(11, dtype=torch.long)
        ancestors = torch.empty(11, 1, dtype=torch.int32)
        first_child = torch.empty(11, dtype=torch.long)
        next_sibling = torch.empty(11, dtype=torch.long)
        status = torch.empty(1, dtype=torch.int32)
        torch.ops.dartree.prune_tree(parents, depths, scores, -0.2, kept, new_parents, new_depths,
                                     ancestors, first_child, next_sibling, status)
        accepted = torch.empty(30, dtype=torch.long)
        count = torch.empty((), dtype=torch.long)
        bonus = torch.empty((), dtype=torch.long)
        torch.ops.dartree.verify_tree(vparents, vtokens, vtarget, None, None, accepted, count, bonus)
        return values * 1, ids + 0, lse * 1, kept + 0, new_parents + 0, accepted + 0, bonus + 0

    values, ids, lse, kept, new_parents, accepted, bonus = pipeline(
        logits, parents, depths, scores, vparents, vtokens, vtarget)
    want = reference.candidate_topk(logits, 8)
    assert torch.equal(ids, want[1]) and torch.equal(values, want[0])
    want_kept, want_parents = reference.prune_tree(parents, depths, scores, 10, -0.2)
    assert torch.equal(kept, want_kept) and torch.equal(new_parents, want_parents)
    path, want_bonus = reference.verify_tree(vparents, vtokens, vtarget)
    assert torch.equal(accepted[:path.shape[0]], path) and int(bonus) == int(want_bonus)


def test_compile_fullgraph_level_and_build(native):
    args = level_inputs(4, 5, 12, 12, 6, 10, 40, torch.float32, "cpu")
    build = build_inputs(3, 4, 30, 10, 3, 4, torch.float32, "cpu")

    @torch.compile(fullgraph=True)
    def step(a, b):
        pos = torch.empty(6, dtype=torch.long)
        tokens = torch.empty(6, dtype=torch.long)
        scores = torch.empty(6)
        states = torch.empty(6, 10)
        torch.ops.dartree.expand_level(a["parent_scores"], a["parent_states"], a["z"], a["w_s"],
                                       a["cand_w2"], a["cand_b2"], a["cand_base"], a["cand_ids"], 12,
                                       a["input_table"], a["w_hh"], a["b_hh"], pos, tokens, scores,
                                       states)
        outs = [torch.empty(6, dtype=torch.long) for _ in range(3)]
        tree_scores = torch.empty(6)
        status = torch.empty(1, dtype=torch.int32)
        torch.ops.dartree.build_dartree(b["cand_values"], b["cand_ids"], b["root"], b["root_state"],
                                        b["z"], b["w_s"], b["w_2"], b["b_2"], b["input_table"],
                                        b["w_hh"], b["b_hh"], 10, [3, 3, 3], 1, -0.2, *outs,
                                        tree_scores, status)
        return pos + 0, states * 1, outs[1] + 0, tree_scores * 1

    pos, states, parents, tree_scores = step(args, build)
    want = reference_level(args, 6)
    assert torch.equal(pos, want[0])
    torch.testing.assert_close(states, want[3], **tol(torch.float32))
    want_build = reference.build_dartree(*build.values(), 10, [3, 3, 3], 1, 5, -0.2)
    assert torch.equal(parents, want_build[1])
    torch.testing.assert_close(tree_scores, want_build[3], **tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# CUDA only: device mismatches and the no-sync error reporting


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_cuda_device_mismatch_and_flags(native):
    logits = torch.randn(2, 50, device="cuda")
    with pytest.raises(ValueError, match="is on cpu"):
        torch.ops.dartree.candidate_topk(logits, torch.empty(2, 5), torch.empty(2, 5, dtype=torch.long,
                                                                                  device="cuda"),
                                         torch.empty(2, device="cuda"))
    # a malformed tree: flags, not exceptions, and no host sync inside the op
    parents = torch.tensor([-1, 0, 5], device="cuda")
    accepted, count, bonus = run_verify(parents, torch.zeros(3, dtype=torch.long, device="cuda"),
                                        torch.zeros(3, dtype=torch.long, device="cuda"))
    assert int(count) == 0 and accepted.tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="parents"):
        ops.verify_tree(parents, torch.zeros(3, dtype=torch.long, device="cuda"),
                        torch.zeros(3, dtype=torch.long, device="cuda"))
    out = run_prune(torch.tensor([-1, 0, 0, 0, 1], device="cuda"), torch.tensor([0, 1, 1, 1, 2], device="cuda"),
                    torch.tensor([0.0, -3, -1, -1, -0.5], device="cuda"), 2, 0.0)
    assert out[-1].tolist() == [1]
    with pytest.raises(ValueError, match="parent was pruned"):
        ops.prune_tree(torch.tensor([-1, 0, 0, 0, 1], device="cuda"),
                       torch.tensor([0, 1, 1, 1, 2], device="cuda"),
                       torch.tensor([0.0, -3, -1, -1, -0.5], device="cuda"), 1, 0.0)
    out = run_prune(torch.tensor([-1, 0, 7], device="cuda"), torch.tensor([0, 1, 2], device="cuda"),
                    torch.zeros(3, device="cuda"), 2, 0.0)
    assert out[-1].tolist() == [2]
