"""The CUDA kernel headers (csrc/include/dartree/*.cuh) run unchanged on the CPU under the fiber
emulator (tests/cuda_emu), launched by the CUDA launchers' own launch code, with the data-race
detector on, against dartree.reference on the awkward shapes of the CUDA tests, outputs poisoned first.
Needs only g++: this is how CI, which has no GPU, executes the CUDA kernels' logic.
Here: candidate_topk, expand_level, prune_tree, verify_tree, build_dartree, kv_commit. Elsewhere:
tree attention (tests/test_tree_attention.py::test_cuda_kernels_in_emulator); exact_linear and
packed_linear (exact.cuh's exact_linear_kernel: tests/test_cuda_emulator_exact.py). Not yet run:
exact.cuh's exact_tree_attention_kernel, sample_keyed.cuh."""

import re
import subprocess

import pytest
import torch

import cuda_emulator as emu
from dartree import reference
from dartree.tree import dartree_schedule
from test_kv_commit import random_path
from test_ops_tree import (BUILD_CASES, LEVEL_SHAPES, PRUNE_CASES, TOPK_SHAPES, build_inputs,
                           level_inputs, poison, random_scored_tree, random_verify_case, tol)

pytestmark = emu.needs_gxx


def cpu_poison(*shape, dtype):
    return poison(*shape, dtype=dtype, device="cpu")


# ---------------------------------------------------------------------------------------------
# the race detector itself (tests/cuda_emu/race_emu.cpp)

ADDRESS = r"0x[0-9a-f]+"  # __shared__ variables move with ASLR
PLANTED = ["shared_write_read", "warp_write_read", "read_then_write", "atomic_counter",
           "global_write_read", "adjacent_halves"]


def run_planted(name):
    return subprocess.run([emu.driver("race_emu"), name], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("kernel", PLANTED)
def test_race_detector_flags_a_planted_race(kernel):
    result = run_planted("racy_" + kernel)
    assert result.returncode != 0 and "DATA RACE on" in result.stderr, result.stderr
    # both threads, and the code of both accesses
    assert result.stderr.count("by block (0,0,0) thread (") == 2, result.stderr
    assert result.stderr.count("race_emu.cpp:") == 2, result.stderr
    again = run_planted("racy_" + kernel).stderr
    assert re.sub(ADDRESS, "", again) == re.sub(ADDRESS, "", result.stderr)  # deterministic


@pytest.mark.parametrize("kernel", PLANTED)
def test_race_detector_passes_the_race_free_variant(kernel):
    result = run_planted("clean_" + kernel)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_race_report_names_the_memory_and_threads():
    err = run_planted("racy_global_write_read").stderr
    assert "DATA RACE on out + 0 bytes" in err
    assert "thread (0,0,0) [warp 0 lane 0]" in err and "thread (40,0,0) [warp 1 lane 8]" in err


# ---------------------------------------------------------------------------------------------
# candidate_topk


def tree_op(op, **tensors):
    return emu.run("tree_ops_emu", op, tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, count", TOPK_SHAPES)
def test_candidate_topk(dtype, rows, vocab, count):
    gen = torch.Generator().manual_seed(vocab * 31 + count)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    inputs = [torch.randn(rows, vocab, generator=gen) * 4]
    if dtype in (torch.float32, torch.float64):  # 32- and 64-bit radix keys (16-bit use 32)
        inputs.append(torch.randint(-6, 6, (rows, vocab), generator=gen).float())  # ties everywhere
    for logits in inputs:
        logits = logits.to(dtype)
        want_values, want_ids, want_lse = reference.candidate_topk(logits, count)
        got = tree_op("candidate_topk", logits=logits, values=cpu_poison(rows, count, dtype=acc),
                      ids=cpu_poison(rows, count, dtype=torch.int64), lse=cpu_poison(rows, dtype=acc))
        assert torch.equal(got["ids"], want_ids)
        assert torch.equal(got["values"], want_values)
        torch.testing.assert_close(got["lse"], want_lse, **tol(dtype))


# ---------------------------------------------------------------------------------------------
# expand_level (mid, select, GRU kernels)


def run_level(args, select):
    dtype = args["parent_scores"].dtype
    gru = args["input_table"] is not None
    width = args["parent_states"].shape[1]
    return tree_op("expand_level", **args, parent_pos=cpu_poison(select, dtype=torch.int64),
                   tokens=cpu_poison(select, dtype=torch.int64), scores=cpu_poison(select, dtype=dtype),
                   states=cpu_poison(*((select, width) if gru else (0,)), dtype=dtype))


# float64 with every kernel of a level; float32 with each variant (the emulator is slow: CI time)
LEVEL_VARIANTS = [(torch.float64, True, True, True), (torch.float32, True, True, True),
                  (torch.float32, False, True, True), (torch.float32, True, False, False)]


@pytest.mark.parametrize("shape", LEVEL_SHAPES)
@pytest.mark.parametrize("dtype, corrected, bias, gru", LEVEL_VARIANTS)
def test_expand_level(dtype, shape, corrected, bias, gru):
    count, width, expand, select, rank, gru_width, vocab = shape
    args = level_inputs(sum(shape), count, width, expand, rank, gru_width, vocab, dtype, "cpu",
                        corrected=corrected, bias=bias)
    if not gru:
        args.update(input_table=None, w_hh=None, b_hh=None)
    got = run_level(args, select)
    want = reference.expand_level(num_select=select, **args)
    assert torch.equal(got["parent_pos"], want[0]) and torch.equal(got["tokens"], want[1])
    torch.testing.assert_close(got["scores"], want[2], **tol(dtype))
    if gru:
        torch.testing.assert_close(got["states"], want[3], **tol(dtype))


@pytest.mark.parametrize("table_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_expand_level_table_dtypes(table_dtype):
    args = level_inputs(3, 6, 20, 10, 8, 24, 90, torch.float32, "cpu", table_dtype=table_dtype)
    got, want = run_level(args, 9), reference.expand_level(num_select=9, **args)
    assert torch.equal(got["parent_pos"], want[0]) and torch.equal(got["tokens"], want[1])
    torch.testing.assert_close(got["states"], want[3], **tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# prune_tree + layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size, budget, shape", PRUNE_CASES)
def test_prune_tree(dtype, size, budget, shape):
    bonus = -0.2 if dtype == torch.float32 else -1.0
    parents, depths, scores = random_scored_tree(size + budget, size, dtype, shape)
    n = 1 + min(budget, size - 1)
    got = tree_op("prune_tree", parents=parents, depths=depths, scores=scores, depth_bonus=bonus,
                  kept=cpu_poison(n, dtype=torch.int64), new_parents=cpu_poison(n, dtype=torch.int64),
                  new_depths=cpu_poison(n, dtype=torch.int64),
                  ancestors=cpu_poison(n, -(-n // 32), dtype=torch.int32),
                  first_child=cpu_poison(n, dtype=torch.int64), next_sibling=cpu_poison(n, dtype=torch.int64),
                  status=cpu_poison(1, dtype=torch.int32))
    want_kept, want_parents = reference.prune_tree(parents, depths, scores, budget, bonus)
    assert torch.equal(got["kept"], want_kept) and torch.equal(got["new_parents"], want_parents)
    assert torch.equal(got["new_depths"], depths[want_kept])
    want_ancestors, want_first, want_next = reference.tree_layout(want_parents)
    assert torch.equal(got["ancestors"], want_ancestors)
    assert torch.equal(got["first_child"], want_first) and torch.equal(got["next_sibling"], want_next)
    assert got["status"].tolist() == [0]


def test_prune_tree_rejects_a_non_tree():
    got = tree_op("prune_tree", parents=torch.tensor([-1, 0, 7]), depths=torch.tensor([0, 1, 2]),
                  scores=torch.zeros(3), depth_bonus=0.0, kept=cpu_poison(2, dtype=torch.int64),
                  new_parents=cpu_poison(2, dtype=torch.int64), new_depths=cpu_poison(2, dtype=torch.int64),
                  ancestors=cpu_poison(2, 1, dtype=torch.int32), first_child=cpu_poison(2, dtype=torch.int64),
                  next_sibling=cpu_poison(2, dtype=torch.int64), status=cpu_poison(1, dtype=torch.int32))
    assert got["status"].tolist() == [2] and got["kept"].tolist() == [0, 1]
    assert got["new_parents"].tolist() == [-1, -1]


# ---------------------------------------------------------------------------------------------
# verify_tree


@pytest.mark.parametrize("size, shape", [(1, "random"), (2, "chain"), (65, "random"), (65, "chain"),
                                         (65, "star"), (300, "random")])
@pytest.mark.parametrize("links", [False, True])
def test_verify_tree(size, shape, links):
    for seed in range(3):
        parents, tokens, target = random_verify_case(seed, size, shape, vocab=2 + seed)
        if shape == "chain" and seed % 2:
            target = torch.roll(tokens, -1)  # every node accepted
        first, following = reference.tree_layout(parents)[1:] if links else (None, None)
        got = tree_op("verify_tree", parents=parents, tokens=tokens, target_tokens=target,
                      first_child=first, next_sibling=following,
                      accepted=cpu_poison(size, dtype=torch.int64),
                      num_accepted=cpu_poison(dtype=torch.int64), bonus=cpu_poison(dtype=torch.int64))
        path, want_bonus = reference.verify_tree(parents, tokens, target)
        length = path.shape[0]
        assert int(got["num_accepted"]) == length
        assert torch.equal(got["accepted"][:length], path) and bool((got["accepted"][length:] == -1).all())
        assert int(got["bonus"]) == int(want_bonus)


def test_verify_tree_flags_a_malformed_tree():
    got = tree_op("verify_tree", parents=torch.tensor([-1, 0, 5]), tokens=torch.zeros(3, dtype=torch.long),
                  target_tokens=torch.zeros(3, dtype=torch.long), accepted=cpu_poison(3, dtype=torch.int64),
                  num_accepted=cpu_poison(dtype=torch.int64), bonus=cpu_poison(dtype=torch.int64))
    assert got["accepted"].tolist() == [-1, -1, -1] and int(got["num_accepted"]) == 0
    assert int(got["bonus"]) == -1


# ---------------------------------------------------------------------------------------------
# build_dartree: every level's kernels and the prune, launched by dartree/build_dartree.cuh (the code
# csrc/cuda/build_dartree.cu runs)


def run_build(args, expand, plan, prefix_len, budget, bonus):
    dtype = args["cand_values"].dtype
    size = 1 + min(budget, sum(plan))
    return tree_op("build_dartree", **args, num_expand=expand, plan=plan, prefix_len=prefix_len,
                   depth_bonus=bonus, tokens=cpu_poison(size, dtype=torch.int64),
                   parents=cpu_poison(size, dtype=torch.int64), depths=cpu_poison(size, dtype=torch.int64),
                   scores=cpu_poison(size, dtype=dtype), status=cpu_poison(1, dtype=torch.int32))


def check_build(args, expand, plan, prefix_len, budget, bonus, dtype):
    got = run_build(args, expand, plan, prefix_len, budget, bonus)
    want = reference.build_dartree(*args.values(), expand, plan, prefix_len, budget, bonus)
    for name, expected in zip(("tokens", "parents", "depths"), want[:3]):
        assert torch.equal(got[name], expected), name
    torch.testing.assert_close(got["scores"], want[3], **tol(dtype))
    assert got["status"].tolist() == [0]


@pytest.mark.parametrize("head, prefix_len", [(True, 1), (False, 0)])
def test_build_dartree_level0_uncorrected(head, prefix_len):
    """Level 0 without the correction (prefix_len >= 1, or no z): thread 0 writes the root's score,
    which warp 0 reads as parent_scores[0]; the detector flagged it before the barrier was there."""
    args = build_inputs(7, 5, 40, 7, 5, 6, torch.float32, "cpu", head=head)
    check_build(args, 7, dartree_schedule(5, 7, 3, 9, False), prefix_len, 9, -0.3, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_build_dartree_level0_corrected(dtype):
    args = build_inputs(8, 5, 40, 7, 5, 6, dtype, "cpu", head=True, table=True)
    check_build(args, 7, dartree_schedule(5, 7, 3, 9, False), 0, 9, -0.3, dtype)


BUILD_VARIANTS = [(torch.float64, True, True, False), (torch.float32, True, False, True),
                  (torch.float32, False, False, False)]


@pytest.mark.parametrize("case", BUILD_CASES)
@pytest.mark.parametrize("dtype, head, bias, table", BUILD_VARIANTS)
def test_build_dartree(dtype, case, head, bias, table):
    slots, vocab, count, expand, width, budget, prefix_len, fixed, rank, gru = case
    plan = dartree_schedule(slots, expand, width, budget, fixed)
    args = build_inputs(sum(case[:6]), slots, vocab, count, rank, gru, dtype, "cpu", head, bias, table)
    check_build(args, expand, plan, prefix_len, budget, -0.3, dtype)
    if head and table:  # the root state computed in the build: GRU(input_table[root], 0)
        args["root_state"] = None
        check_build(args, expand, plan, prefix_len, budget, -0.3, dtype)


# ---------------------------------------------------------------------------------------------
# kv_commit (csrc/include/dartree/kv_commit.cuh; 16-, 4- and 1-byte words as kv_commit.cu picks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 2, 1, 3, 40, 16), (1, 2, 1, 1, 9, 7), (3, 2, 1, 2, 70, 128),
                                   (1, 1, 1, 5, 12, 3)])
def test_kv_commit(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape) * 7 + len(str(dtype)))
    seq = shape[-2]
    for prefix, tree_len, length in [(0, 1, 1), (3, 5, 5), (seq - 6, 6, 3), (1, seq - 1, 4)]:
        kv = torch.randn(shape, generator=g).to(dtype)
        accepted = random_path(tree_len, min(length, tree_len), g)
        expected = kv.clone()
        reference.kv_commit(expected, prefix, accepted)
        got = emu.run("kv_commit_emu", "kv_commit", dict(kv=kv, accepted=accepted, prefix_len=prefix))
        assert torch.equal(got["kv"], expected), (prefix, accepted.tolist())
