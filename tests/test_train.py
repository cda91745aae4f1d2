"""Training a drafter: the batched training forward (Drafter.forward) is the inference function,
the loss falls, saved drafters reload unchanged, checkpoints resume, and bad options are refused
by name."""

import argparse
import json

import pytest
import torch

from dartree.drafter import load_drafter
from dartree.train import (TokenStream, TrainOptions, add_train_parser, block_logits,
                           corpus_texts, load_corpus, new_drafter, target_features,
                           train_drafter)
from helpers import tiny_target

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, layers=4)


def _stream(length=4000, seed=0):
    """A learnable stream: a random 'phrase' of 23 tokens repeated, with 10% noise."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(2, VOCAB, (23,), generator=gen)
    ids = phrase.repeat(length // 23 + 1)[:length].clone()
    noise = torch.rand(length, generator=gen) < 0.1
    ids[noise] = torch.randint(2, VOCAB, (int(noise.sum()),), generator=gen)
    return ids


def _options(**kw):
    base = dict(num_layers=1, block_size=8, target_layer_ids=[1, 3], emb_dim=16,
                gru_hidden_dim=32, steps=4, batch_size=2, seq_len=48, anchors=4, lr=3e-3,
                warmup=0.0, seed=0)
    base.update(kw)
    return TrainOptions(**base)


def _perturbed(drafter, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    drafter.refresh_input_table()
    return drafter.eval()


@pytest.mark.parametrize("shift_label", [True, False])
def test_drafter_forward_matches_draft(target, shift_label):
    opts = _options(num_layers=2, shift_label=shift_label, domino=shift_label,
                    prefix_len=1 if shift_label else 0)
    drafter = _perturbed(new_drafter(target, opts))
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[1, 5, 20], [3, 7, 31]])
    features = target_features(target, tokens, drafter.target_layer_ids)
    with torch.no_grad():
        h = drafter(features, tokens.gather(1, anchors), anchors)
    assert h.shape == (2, 3, drafter.num_slots, 64)
    for r in range(2):
        for i in range(3):
            a = int(anchors[r, i])
            drafter.reset(max_len=64)
            expected = drafter.draft(features[r, :a], int(tokens[r, a]), s=a)
            torch.testing.assert_close(h[r, i], expected, rtol=1e-4, atol=1e-5)


def test_block_logits_match_head_chain(target):
    """Teacher-forced corrected logits == the head's own step-by-step chain on true tokens."""
    drafter = _perturbed(new_drafter(target, _options()))
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([[4, 17]])
    features = target_features(target, tokens, drafter.target_layer_ids)
    with torch.no_grad():
        h = drafter(features, tokens.gather(1, anchors), anchors)
        base, corrected = block_logits(drafter, h, tokens, anchors)
        head = drafter.head
        for i, a in enumerate(anchors[0].tolist()):
            z = head.project(h[0, i])
            g = head.root_state(int(tokens[0, a]))
            for m in range(drafter.num_slots):
                row = drafter.base_logits(h[0, i, m:m + 1])[0]
                torch.testing.assert_close(base[0, i, m], row, rtol=1e-4, atol=1e-5)
                if m >= drafter.prefix_len:
                    row = row + head.correction(z[m], g, None)[0]
                torch.testing.assert_close(corrected[0, i, m], row, rtol=1e-4, atol=1e-5)
                g = head.gru_step(tokens[0, a + 1 + m].view(1), g)


def test_loss_falls_and_target_untouched(target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    flags = [p.requires_grad for p in target.parameters()]
    _, info = train_drafter(target, _stream(), _options(steps=40), progress=False)
    losses = info["losses"]
    assert len(losses) == 40 and info["step"] == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert flags == [p.requires_grad for p in target.parameters()]


def test_init_starts_from_a_saved_drafter(target, tmp_path):
    first, _ = train_drafter(target, _stream(), _options(steps=6), output=tmp_path / "a",
                             progress=False)
    # a learning rate of 1e-12: one step leaves the weights where the init put them
    tuned, _ = train_drafter(target, _stream(seed=1), _options(steps=1, lr=1e-12),
                             init=tmp_path / "a", progress=False)
    fresh = new_drafter(target, _options())
    moved = 0
    for (name, a), b, c in zip(first.state_dict().items(), tuned.state_dict().values(),
                               fresh.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9, msg=name)
        moved += not torch.equal(a, c)
    assert moved > 0  # training moved the first drafter away from the random init
    train_drafter(target, _stream(), _options(num_layers=2, steps=2), output=tmp_path / "two",
                  progress=False)
    with pytest.raises(ValueError, match="num_layers differ"):  # a drafter is never cut
        train_drafter(target, _stream(), _options(), init=tmp_path / "two", progress=False)
    with pytest.raises(ValueError, match="block_size differ"):
        train_drafter(target, _stream(), _options(block_size=4), init=tmp_path / "a",
                      progress=False)


def test_init_grows_a_drafter_by_identity_layers(target, tmp_path):
    """A 1-layer drafter loaded into a 3-layer one: its weights are the first layer's, the new
    layers pass the residual stream through (the same hidden states), and training moves them."""
    from dartree.train.loop import _load_init

    one, _ = train_drafter(target, _stream(), _options(steps=6), output=tmp_path / "one",
                           progress=False)
    grown = new_drafter(target, _options(num_layers=3))
    _load_init(grown, tmp_path / "one", target)
    for name, value in one.state_dict().items():
        torch.testing.assert_close(grown.state_dict()[name], value, rtol=0, atol=0, msg=name)
    ids = _stream(200, seed=4)[None]
    from dartree.train.features import target_features
    features = target_features(target, ids, [1, 3])
    anchors = torch.tensor([[5, 40, 77, 150]])
    with torch.no_grad():
        torch.testing.assert_close(grown(features, ids.gather(1, anchors), anchors),
                                   one(features, ids.gather(1, anchors), anchors))
    trained, _ = train_drafter(target, _stream(), _options(num_layers=3, steps=3),
                               init=tmp_path / "one", progress=False)
    assert trained.layers[2].mlp.down_proj.weight.abs().sum() > 0


@pytest.mark.parametrize("domino", [True, False])
def test_save_load_same_outputs(target, tmp_path, domino):
    opts = _options(domino=domino, prefix_len=1 if domino else 0, steps=3)
    drafter, _ = train_drafter(target, _stream(), opts, output=tmp_path / "d", progress=False)
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.config == drafter.config
    features = target_features(target, torch.randint(0, VOCAB, (1, 30)), drafter.target_layer_ids)[0]
    outs = []
    for d in (drafter, loaded):
        d.reset(max_len=64)
        h = d.draft(features, 7, s=30)
        out = [h, d.base_logits(h)]
        if domino:
            g = d.head.root_state(7)
            out += [d.head.correction(d.head.project(h)[3], g), d.head.gru_step(torch.tensor([5]), g)]
        outs.append(out)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Interrupting(TokenStream):
    def __init__(self, ids, after):
        super().__init__(ids)
        self.calls, self.after = 0, after

    def sample(self, batch, length, generator):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt
        return super().sample(batch, length, generator)


@pytest.mark.parametrize("distill", [False, True])
def test_resume_continues_identically(target, tmp_path, distill):
    extra = dict(self_distill=True, distill_new_tokens=24, distill_batches=3) if distill else {}
    straight, _ = train_drafter(target, _stream(), _options(steps=6, **extra), progress=False)
    opts = _options(steps=6, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, **extra)
    with pytest.raises(KeyboardInterrupt):  # interrupted while drawing the data of step 4
        train_drafter(target, _Interrupting(_stream(), after=1 if distill else 3), opts,
                      progress=False)
    state = torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)
    assert state["step"] == 2
    resumed, info = train_drafter(target, _stream(), opts, progress=False)
    assert info["step"] == 6 and len(info["losses"]) == 6
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    # a checkpoint made with other options is refused, not silently mixed in
    with pytest.raises(ValueError, match="other options.*lr"):
        train_drafter(target, _stream(), _options(steps=6, lr=1e-3,
                                                  checkpoint_dir=str(tmp_path / "ckpt")),
                      progress=False)


def test_self_distill_trains_on_target_continuations(target):
    opts = _options(steps=2, self_distill=True, seq_len=40, distill_new_tokens=20)
    _, info = train_drafter(target, _stream(), opts, progress=False)
    assert info["step"] == 2 and all(torch.isfinite(torch.tensor(info["losses"])))


@pytest.mark.parametrize("change, message", [
    (dict(steps=0), "steps must be an int >= 1"),
    (dict(batch_size=-1), "batch_size must be"),
    (dict(block_size=1), "block_size must be >= 2"),
    (dict(seq_len=8), "seq_len must be >= 10"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(prefix_len=9), r"prefix_len must be in \[0, 8\]"),
    (dict(target_layer_ids=[]), "target_layer_ids must not be empty"),
    (dict(target_layer_ids=[1, 7]), r"target_layer_ids \[7\] are out of range"),
    (dict(mask_token_id=VOCAB), r"mask_token_id must be in \[0, 256\)"),
    (dict(curriculum=1.5), r"curriculum must be in \[0, 1\]"),
    (dict(emb_dim=0), "emb_dim must be"),
    (dict(self_distill=True, distill_new_tokens=4), "distill_new_tokens must be in"),
    (dict(distill_batches=0), "distill_batches must be an int >= 1"),
])
def test_bad_options(target, change, message):
    with pytest.raises(ValueError, match=message):
        train_drafter(target, _stream(), _options(**change), progress=False)


def test_bad_data(target):
    with pytest.raises(ValueError, match="fewer than one window"):
        train_drafter(target, _stream(length=20), _options(), progress=False)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        train_drafter(target, torch.full((100,), VOCAB), _options(), progress=False)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        train_drafter(target, torch.zeros(2, 100, dtype=torch.long), _options(), progress=False)
    with pytest.raises(TypeError, match="transformers causal LM"):
        train_drafter(object(), _stream(), _options(), progress=False)


def test_corpus_files_dirs_jsonl(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "src" / "skip.bin").write_text("no")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "t"}) + "\n\n" +
                                      json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    assert list(corpus_texts([tmp_path / "src", tmp_path / "d.jsonl"])) == ["x = 1\n", "t", "pc"]
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: a JSONL row needs"):
        list(corpus_texts([tmp_path / "bad.jsonl"]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(corpus_texts([tmp_path / "missing"]))


def _tiny_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   mask_token="<|mask|>")
    fast.save_pretrained(folder)
    return fast


def test_cli_train_drafter(tmp_path):
    tokenizer = _tiny_tokenizer(tmp_path / "target")
    target = tiny_target(vocab=len(tokenizer), layers=4)
    target.save_pretrained(tmp_path / "target")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 40)
    assert len(load_corpus([corpus], tokenizer)) > 100
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "train-drafter", "--target", str(tmp_path / "target"), "--corpus", str(corpus),
        "--output", str(tmp_path / "out"), "--block-size", "4", "--target-layer-ids", "1,3",
        "--emb-dim", "8", "--gru-hidden-dim", "8", "--steps", "2", "--batch-size", "2",
        "--seq-len", "32", "--anchors", "2", "--device", "cpu"])
    assert args.run(args) == 0
    drafter = load_drafter(tmp_path / "out", target)
    assert drafter.mask_token_id == tokenizer.mask_token_id
    assert drafter.target_layer_ids == [1, 3] and drafter.block_size == 4
    assert (tmp_path / "out" / "checkpoint" / "train_state.pt").is_file()
    assert drafter.draft_vocab is None
    # --draft-vocab N: the N tokens most frequent in the corpus, EOS among them, saved with it
    args = parser.parse_args([
        "train-drafter", "--target", str(tmp_path / "target"), "--corpus", str(corpus),
        "--output", str(tmp_path / "vocab"), "--block-size", "4", "--target-layer-ids", "1,3",
        "--emb-dim", "8", "--gru-hidden-dim", "8", "--steps", "2", "--batch-size", "2",
        "--seq-len", "32", "--anchors", "2", "--device", "cpu", "--draft-vocab", "6"])
    assert args.run(args) == 0
    ids = load_corpus([corpus], tokenizer)
    counts = torch.bincount(ids, minlength=len(tokenizer))
    vocab = load_drafter(tmp_path / "vocab", target).draft_vocab
    assert vocab.numel() == 6 and tokenizer.eos_token_id in vocab.tolist()
    others = [t for t in vocab.tolist() if t != tokenizer.eos_token_id]
    assert min(counts[others]) >= counts.sort(descending=True).values[len(others) - 1]
    bad = parser.parse_args(["train-drafter", "--target", str(tmp_path / "target"), "--corpus",
                             str(corpus), "--output", str(tmp_path / "o2"), "--draft-vocab", "-1"])
    with pytest.raises(ValueError, match="--draft-vocab must be >= 0"):
        bad.run(bad)
    bad = parser.parse_args(["train-drafter", "--target", str(tmp_path / "nope"), "--corpus",
                             str(corpus), "--output", str(tmp_path / "o2")])
    with pytest.raises(ValueError, match="is not a folder"):
        bad.run(bad)
    bad = parser.parse_args(["train-drafter", "--target", str(tmp_path / "target"), "--corpus",
                             str(tmp_path / "missing.txt"), "--output", str(tmp_path / "o2")])
    with pytest.raises(ValueError, match="--corpus path.*missing.txt"):
        bad.run(bad)
    bad = parser.parse_args(["train-drafter", "--target", str(tmp_path / "target"), "--corpus",
                             str(corpus), "--output", str(tmp_path / "o2"), "--block-size", "1"])
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        bad.run(bad)


def _cache(target, lengths=(30, 41, 25, 48), seed=3):
    """A FeatureCache of random sequences whose answers start a third of the way in."""
    from dartree.train import FeatureCache

    gen = torch.Generator().manual_seed(seed)
    seqs = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), n // 3) for n in lengths]
    return FeatureCache.build(target, seqs, [1, 3], progress=False)


def test_feature_cache_rows_match_target_features(target):
    """Cached rows hold the target's features (bf16) and anchors inside the answers; labels past
    a sequence's end are ignored, so the cached loss equals the loss with features computed
    from the tokens, up to the bf16 storage."""
    from dartree.train import IGNORE, CachedBatches, block_labels, loss_terms

    cache = _cache(target)
    opts = _options(seq_len=48, anchors=5)
    batches = CachedBatches(cache, opts, torch.Generator().manual_seed(0), torch.device("cpu"))
    tokens, anchors, feats, lengths, soft = batches.rows([0, 1, 2, 3],
                                                         torch.Generator().manual_seed(1))
    assert soft is None  # the cache has no soft labels
    assert lengths.tolist() == [30, 41, 25, 48]
    for r in range(4):
        n = int(lengths[r])
        assert torch.equal(tokens[r, :n], cache.sequence(r)[0])
        expect = target_features(target, tokens[r:r + 1, :n], [1, 3])[0].to(torch.bfloat16)
        # padded batches round a little differently from one row alone (GEMM rows depend on M)
        torch.testing.assert_close(feats[r, :n].float(), expect.float(), atol=1e-2, rtol=1e-2)
        assert bool((anchors[r] >= max(1, int(cache.starts[r]))).all()) and bool((anchors[r] <= n - 2).all())
    labels = block_labels(tokens, anchors, 8, lengths)
    past_end = anchors[:, :, None] + 1 + torch.arange(8) >= lengths[:, None, None]
    assert bool((labels[past_end] == IGNORE).all()) and bool((labels[~past_end] >= 0).all())
    drafter = _perturbed(new_drafter(target, opts))
    cached = loss_terms(drafter, target, tokens, anchors, 7.0, feats.float(), lengths)
    fresh = loss_terms(drafter, target, tokens, anchors, 7.0, None, lengths)
    for key in cached:
        assert abs(cached[key].item() - fresh[key].item()) < 0.05, key


def test_cached_anchors_cover_answer_tokens_uniformly(target):
    """Sequences are drawn in proportion to their answer tokens: each answer token is a block
    root about equally often, whatever its answer's length; no root on a prompt token."""
    from dartree.train import CachedBatches

    cache = _cache(target, lengths=(20, 48, 30))
    opts = _options(seq_len=48, anchors=1, batch_size=64)
    batches = CachedBatches(cache, opts, torch.Generator().manual_seed(0), torch.device("cpu"))
    spans = [batches.span(i) for i in range(len(cache))]
    assert all(low == max(1, int(cache.starts[i])) for i, (low, _) in enumerate(spans))
    row_of_length = {20: 0, 48: 1, 30: 2}  # the sequences have distinct lengths
    counts = torch.zeros(len(cache))
    for _ in range(60):
        batch = batches.next()
        anchors, lengths = batch.anchors, batch.lengths
        assert anchors.shape == (64, 1)
        for a, n in zip(anchors[:, 0].tolist(), lengths.tolist()):
            i = row_of_length[n]
            assert spans[i][0] <= a <= spans[i][1]  # a root on an answer token
            counts[i] += 1
    per_token = counts / torch.tensor([float(high - low + 1) for low, high in spans])
    assert float(per_token.max() / per_token.min()) < 1.15  # uniform (drawn per sequence: ~2.4x)


def test_train_on_feature_cache_loss_falls_and_resumes(target, tmp_path):
    cache = _cache(target, lengths=(40, 44, 48, 36, 47, 42))
    path = tmp_path / "cache.pt"
    cache.save(path)
    from dartree.train import FeatureCache, evaluate_cached

    loaded = FeatureCache.load(path)
    assert torch.equal(loaded.features, cache.features) and loaded.layer_ids == [1, 3]
    opts = _options(steps=30, seq_len=48, target_layer_ids=[1, 3], lr=1e-2)
    drafter, info = train_drafter(target, loaded, opts, progress=False)
    assert sum(info["losses"][-5:]) < sum(info["losses"][:5])
    held = evaluate_cached(drafter, target, cache, opts)
    assert set(held) >= {"ce_base", "ce_corrected", "accept_base", "accept_corrected"}
    with pytest.raises(ValueError, match="target_layer_ids"):
        train_drafter(target, loaded, _options(target_layer_ids=[0, 2]), progress=False)


def test_training_captures_the_features_inference_reads(target):
    """The last layer's feature is taken after the final norm in training as in inference
    (transformers' hidden_states[l + 1]; tests/test_target.py checks the inference side)."""
    last = target.config.num_hidden_layers - 1
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    layers = [0, last, last - 1]
    expected = torch.cat([hidden[i + 1] for i in layers], dim=-1)
    assert torch.equal(target_features(target, ids, layers), expected)  # before: last pre-norm
