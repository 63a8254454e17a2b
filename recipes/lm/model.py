"""Decoder-only transformer whose attention runs through :func:`flashbob.attention` (or, for comparison,
naive eager attention: ``attention="eager"``; or torch's fused SDPA on the passes differentiated once and
flashbob on those an optimizer differentiates twice: ``attention="sdpa"``, see
:class:`~recipes.common.transformer.AttentionSwitch`).

Pre-norm blocks (RMSNorm or LayerNorm), rotary position embeddings, grouped-query attention,
a GELU or SwiGLU MLP and optionally tied input/output embeddings. Every operation is
differentiable twice, so Hessian-vector and Gauss-Newton products of the loss are exact: this is
what lets the second-order optimizers of :mod:`optim` train it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import flashbob
import optim
from recipes.common.transformer import (
    AttentionFn,
    AttentionSwitch,
    RMSNorm,
    kv_heads,
    mlp_hidden,
    rotate,
    silu,
    sliding_window,
)


def make_norm(kind: str, dim: int) -> nn.Module:
    """``"rmsnorm"`` or ``"layernorm"``."""
    if kind == "rmsnorm":
        return RMSNorm(dim)
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {kind!r}")


class CausalSelfAttention(nn.Module):
    """Query/key/value projections, RoPE, causal attention (over the ``window`` latest keys if set, within each
    document if document ids are given), output projection."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope_base: float, attend: AttentionFn,
                 dropout: float, window: int | None = None):
        super().__init__()
        self.window = sliding_window(window, causal=True)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.rope_base, self.attend = rope_base, attend
        self.q = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.kv = nn.Linear(d_model, 2 * n_kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        q = rearrange(self.q(x), "b n (h d) -> b h n d", h=self.n_heads)
        k, v = rearrange(self.kv(x), "b n (two h d) -> two b h n d", two=2, h=self.n_kv_heads)
        q, k = rotate(q, self.rope_base), rotate(k, self.rope_base)
        masks = {name: value for name, value in (("window", self.window), ("document_ids", document_ids))
                 if value is not None}
        o = self.attend(q, k, v, causal=True, **masks)
        return self.dropout(self.out(rearrange(o, "b h n d -> b n (h d)")))


class MLP(nn.Module):
    """``gelu``: ``W2 gelu(W1 x)``; ``swiglu``: ``W2 (silu(Wg x) * Wu x)`` with 2/3 of the hidden width."""

    def __init__(self, d_model: int, kind: str, ratio: float, dropout: float):
        super().__init__()
        hidden = mlp_hidden(d_model, kind, ratio)
        self.kind = kind
        self.up = nn.Linear(d_model, hidden * (2 if kind == "swiglu" else 1), bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.kind == "swiglu":
            gate, h = h.chunk(2, dim=-1)
            h = silu(gate) * h
        else:
            h = F.gelu(h)
        return self.dropout(self.down(h))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model, n_heads, n_kv_heads, norm, mlp, mlp_ratio, rope_base, attend, dropout, window=None):
        super().__init__()
        self.norm1, self.norm2 = make_norm(norm, d_model), make_norm(norm, d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, n_kv_heads, rope_base, attend, dropout, window)
        self.mlp = MLP(d_model, mlp, mlp_ratio, dropout)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), document_ids)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm, linear head to next-token logits.

    ``attention`` names the attention (:func:`~recipes.common.transformer.attention_function`); every
    block calls :attr:`attention`, an :class:`~recipes.common.transformer.AttentionSwitch`, so
    ``with model.attention.for_curvature():`` makes the model twice differentiable for a pass. ``window``: each
    query sees itself and the ``window - 1`` tokens before it (None: every earlier token). With
    ``checkpoint_activations`` every block runs through ``optim.checkpoint``, which keeps its attention outputs for
    the recomputation if ``save_attention`` (:class:`flashbob.KeptAttention`).
    """

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        norm: str = "rmsnorm",
        mlp: str = "swiglu",
        mlp_ratio: float = 4.0,
        rope_base: float = 10000.0,
        tie_embeddings: bool = True,
        dropout: float = 0.0,
        checkpoint_activations: bool = False,
        save_attention: bool = True,
        attention: str = "auto",
        window: int | None = None,
    ):
        super().__init__()
        n_kv_heads = kv_heads(d_model, n_heads, n_kv_heads)
        self.checkpoint_activations, self.save_attention = checkpoint_activations, save_attention
        self.attention = attend = AttentionSwitch(attention)
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, n_kv_heads, norm, mlp, mlp_ratio, rope_base, attend, dropout, window)
            for _ in range(n_layers)
        )
        self.norm = make_norm(norm, d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        for block in self.blocks:  # residual branches scaled down with depth (GPT-2)
            for proj in (block.attn.out, block.mlp.down):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layers))
        if tie_embeddings:
            self.head.weight = self.embed.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` for the next token after each of ``tokens`` ``(batch, seq)``; with
        ``document_ids`` ``(batch, seq)`` (packed documents), a token attends only within its document."""
        x = self.embed(tokens)
        extra = () if document_ids is None else (document_ids,)
        for block in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                kept = flashbob.KeptAttention() if self.save_attention else None
                x = optim.checkpoint(block, x, *extra, kept=kept, context=self.attention.current())
            else:
                x = block(x, *extra)
        return self.head(self.norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats, computed in at least float32 (float64 logits stay float64)."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1), targets.flatten())
