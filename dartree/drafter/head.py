"""The Domino causal-correction head: a GRU over the drafted prefix and a rank-r logit
correction added to the drafter's base logits (research/ALGORITHMS.md §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DominoHead(nn.Module):
    """Domino causal correction: a GRU over the drafted prefix + a rank-r logit correction.

    Weights keep the checkpoint names: ``prefix_gru`` (a 1-layer nn.GRU, W_ih [3G, H],
    W_hh [3G, G], optional biases) and ``embed_proj`` = Linear(H+G -> r) · SiLU · Linear(r -> V)
    with W_1 = [W_z | W_s]. ``input_table`` [V, 3G] = E·W_ihᵀ (+ b_ih) is a non-persistent buffer
    built from the target embedding by :meth:`build_input_table`; rebuild it after changing
    W_ih. Training code should run ``prefix_gru`` on embeddings instead of :meth:`gru_step`,
    which reads the table and so carries no gradient to W_ih.
    """

    def __init__(self, hidden_size: int, vocab_size: int, emb_dim: int, gru_hidden_dim: int, *,
                 gru_bias: bool = False, w1_bias: bool = False, w2_bias: bool = False):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.emb_dim, self.gru_hidden_dim = emb_dim, gru_hidden_dim
        self.prefix_gru = nn.GRU(hidden_size, gru_hidden_dim, num_layers=1, batch_first=True,
                                 bias=gru_bias)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=w1_bias),
            nn.SiLU(),
            nn.Linear(emb_dim, vocab_size, bias=w2_bias),
        )
        self.register_buffer("input_table", None, persistent=False)

    # Named views of the weights, for tree builders and kernels.
    @property
    def W_ih(self) -> torch.Tensor:
        return self.prefix_gru.weight_ih_l0

    @property
    def W_hh(self) -> torch.Tensor:
        return self.prefix_gru.weight_hh_l0

    @property
    def b_ih(self) -> torch.Tensor | None:
        return self.prefix_gru.bias_ih_l0 if self.prefix_gru.bias else None

    @property
    def b_hh(self) -> torch.Tensor | None:
        return self.prefix_gru.bias_hh_l0 if self.prefix_gru.bias else None

    @property
    def W_z(self) -> torch.Tensor:
        """[r, H]: the first H columns of W_1 (applied to the drafter state h)."""
        return self.embed_proj[0].weight[:, :self.hidden_size]

    @property
    def W_s(self) -> torch.Tensor:
        """[r, G]: the last G columns of W_1 (applied to the GRU state g)."""
        return self.embed_proj[0].weight[:, self.hidden_size:]

    @property
    def b_1(self) -> torch.Tensor | None:
        return self.embed_proj[0].bias

    @property
    def W_2(self) -> torch.Tensor:
        """[V, r]."""
        return self.embed_proj[2].weight

    @property
    def b_2(self) -> torch.Tensor | None:
        return self.embed_proj[2].bias

    @torch.no_grad()
    def build_input_table(self, embedding: torch.Tensor) -> None:
        """input_table [V, 3G] = embedding [V, H] · W_ihᵀ (+ b_ih), in the head's dtype."""
        if embedding.shape != (self.vocab_size, self.hidden_size):
            raise ValueError(f"embedding must be [{self.vocab_size}, {self.hidden_size}], "
                             f"got {list(embedding.shape)}")
        weight = self.W_ih
        self.input_table = F.linear(embedding.to(device=weight.device, dtype=weight.dtype),
                                    weight, self.b_ih)

    def gru_step(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """One GRU cell step (PyTorch r, z, n gate order) for n paths at once.

        tokens LongTensor [n] (the token each path just appended), g [n, G] -> g' [n, G].
        """
        if self.input_table is None:
            raise RuntimeError("DominoHead.input_table is not built; call build_input_table()")
        gi = self.input_table[tokens]
        gh = F.linear(g, self.W_hh, self.b_hh)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        reset = torch.sigmoid(i_r + h_r)
        update = torch.sigmoid(i_z + h_z)
        candidate = torch.tanh(i_n + reset * h_n)
        return candidate + update * (g - candidate)

    def root_state(self, bonus: int | torch.Tensor) -> torch.Tensor:
        """[1, G]: the GRU state after the root/bonus token, from g_0 = 0."""
        tokens = torch.as_tensor(bonus, dtype=torch.long, device=self.W_hh.device).reshape(1)
        zeros = self.W_hh.new_zeros(1, self.gru_hidden_dim)
        return self.gru_step(tokens, zeros)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [k, H] drafter states -> z [k, r] = W_z h (+ b_1), shared by every path at a slot."""
        return F.linear(h.to(self.W_hh.dtype), self.W_z, self.b_1)

    def correction(self, z: torch.Tensor, g: torch.Tensor,
                   cand: torch.Tensor | None = None) -> torch.Tensor:
        """Δ = W_2[cand] · SiLU(z + W_s g) (+ b_2[cand]).

        z [r] or [n, r]; g [n, G]; cand LongTensor [C] or None (all V) -> [n, C or V].
        """
        act = F.silu(z + F.linear(g, self.W_s))
        if cand is None:
            return F.linear(act, self.W_2, self.b_2)
        return F.linear(act, self.W_2[cand], None if self.b_2 is None else self.b_2[cand])
