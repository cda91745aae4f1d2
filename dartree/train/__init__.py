"""Training a DFlash drafter with a Domino head for any target (research/ALGORITHMS.md §1-2).

The target is frozen; the drafter reuses its input embedding and LM head and reads the outputs
of ``target_layer_ids`` (transformers' ``hidden_states[l + 1]``) as context features.

Objective (DFlash): for each training sequence of L tokens, pick A random anchor positions a;
each anchor opens a block ``[x_a, MASK x (B-1)]`` at positions a .. a+B-1 whose queries see the
target features of positions ``< a`` plus their own block (bidirectional inside the block). The
drafter's k used slots predict ``x_{a+1} .. x_{a+k}`` (slot m predicts position a+1+m; with
``shift_label`` k = B and slot 0 is the first block row, otherwise k = B-1 and the first row is
not read out), and their cross-entropy is weighted ``exp(-m / gamma)``. All blocks of a batch
go through the drafter's own forward at once (:meth:`dartree.drafter.Drafter.forward`).

Domino head, trained jointly with teacher forcing: a GRU runs over the true tokens
``x_a .. x_{a+k-1}`` (the state at slot m has read the root and m true tokens, as at inference)
and corrects slots m >= P: ``l'_m = l_m + W_2 SiLU(W_z h_m + W_s g_m)``. The loss is
``(1 - lam) CE(l') + lam CE(l)`` with lam falling linearly from 1 to 0 over the first
``curriculum`` fraction of the steps (slots m < P have no correction: l' = l there).

Soft labels (``soft_weight`` w, a FeatureCache built with ``topk``): each CE above becomes
``(1 - w) CE + w KL(p || q)``, p the target's distribution at the label's position restricted to
its top-K tokens (renormalised), q the drafter's: what ranking a tree's alternatives needs.

Self-distillation (``self_distill``) replaces each training window by a prompt from the corpus
followed by the target's own greedy continuation, and anchors only inside the continuation.

    options     TrainOptions: the drafter's shape and the training settings
    corpus      text files, folders and JSONL -> one token stream; its random windows
    features    the target's side: features, soft labels, greedy continuations, FeatureCache
                (in memory, or memory-mapped in a folder and resumable)
    feature_shards  a data set featurised shard by shard (build_shards), read as one
                (FeatureShards)
    magpie      prompts the target writes itself through its chat template (Magpie)
    batches     each step's tokens, anchors (and cached features)
    objective   block labels, logits, weighted CE and KL, accept lengths
    loop        new_drafter, train_drafter (optimizer, curriculum, checkpoints)
    evaluate    held-out objective terms with fixed anchors, acceptance per slot
    cli         ``dartree train-drafter``

Example::

    from dartree.train import TrainOptions, load_corpus, train_drafter
    ids = load_corpus(["src/"], tokenizer)
    drafter, info = train_drafter(target, ids, TrainOptions(steps=2000), output="my-drafter")

The command line is ``dartree train-drafter`` (:func:`add_train_parser`).
"""

from .batches import Batch, CachedBatches, WindowBatches
from .cli import add_train_parser, run_train_command
from .corpus import TEXT_SUFFIXES, TokenStream, corpus_texts, load_corpus
from .evaluate import evaluate, evaluate_cached
from .feature_shards import FeatureShards, build_shards
from .features import FeatureCache, greedy_continue, soft_labels, target_features
from .loop import CHECKPOINT_FILE, new_drafter, train_drafter
from .objective import IGNORE, block_labels, block_logits, loss_terms
from .options import TrainOptions, default_gamma

__all__ = ["Batch", "CHECKPOINT_FILE", "CachedBatches", "FeatureCache", "FeatureShards", "IGNORE", "TEXT_SUFFIXES",
           "TokenStream", "TrainOptions", "WindowBatches", "add_train_parser", "block_labels",
           "block_logits", "build_shards", "corpus_texts", "default_gamma", "evaluate", "evaluate_cached",
           "greedy_continue", "load_corpus", "loss_terms", "new_drafter", "run_train_command",
           "soft_labels", "target_features", "train_drafter"]
