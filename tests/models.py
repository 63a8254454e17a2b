"""Small float64 models for tests: an MLP and a tiny transformer language model with pluggable attention."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from einops import rearrange
from torch import Tensor, nn

import flashbob

AttentionFn = Callable[..., Tensor]  # (q, k, v, *, causal) -> o, all (batch, heads, seq, head_dim)


class MLP(nn.Sequential):
    """Linear layers of widths ``sizes`` with ``tanh`` between them (smooth, so every Hessian block is nonzero).

    Args:
        sizes: Input width, hidden widths, output width.
        dtype: Parameter dtype.
    """

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype = torch.float64) -> None:
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out, dtype=dtype), nn.Tanh()]
        super().__init__(*layers[:-1])


class SelfAttention(nn.Module):
    """Multi-head self-attention with grouped-query key/value heads, calling ``attention`` for the softmax part.

    Args:
        d_model: Model width; must be divisible by ``heads``.
        heads: Query heads.
        kv_heads: Key/value heads; must divide ``heads``.
        causal: Causal masking.
        attention: SDPA-shaped attention function, e.g. :func:`flashbob.attention`.
        dtype: Parameter dtype.
    """

    def __init__(
        self, d_model: int, heads: int, kv_heads: int, causal: bool, attention: AttentionFn, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.causal, self.attention = heads, kv_heads, causal, attention
        head_dim = d_model // heads
        self.query = nn.Linear(d_model, heads * head_dim, bias=False, dtype=dtype)
        self.key_value = nn.Linear(d_model, 2 * kv_heads * head_dim, bias=False, dtype=dtype)
        self.out = nn.Linear(heads * head_dim, d_model, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        """``(batch, seq, d_model) -> (batch, seq, d_model)``."""
        q = rearrange(self.query(x), "b t (h d) -> b h t d", h=self.heads)
        k, v = rearrange(self.key_value(x), "b t (two h d) -> two b h t d", two=2, h=self.kv_heads)
        o = self.attention(q, k, v, causal=self.causal)
        return self.out(rearrange(o, "b h t d -> b t (h d)"))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` with a 4x GELU MLP."""

    def __init__(
        self, d_model: int, heads: int, kv_heads: int, causal: bool, attention: AttentionFn, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, dtype=dtype)
        self.attn = SelfAttention(d_model, heads, kv_heads, causal, attention, dtype)
        self.mlp_norm = nn.LayerNorm(d_model, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model, bias=False, dtype=dtype),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model, bias=False, dtype=dtype),
        )

    def forward(self, x: Tensor) -> Tensor:
        """``(batch, seq, d_model) -> (batch, seq, d_model)``."""
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """Decoder-only language model: token and learned position embeddings, ``layers`` blocks, norm, unembedding.

    Args:
        vocab: Vocabulary size.
        d_model: Model width; ``d_model // heads`` is the head dimension.
        heads: Query heads per block.
        kv_heads: Key/value heads per block (``kv_heads < heads`` is grouped-query attention).
        layers: Number of blocks.
        causal: Causal attention (a language model) or bidirectional.
        attention: SDPA-shaped attention function ``(q, k, v, *, causal) -> o``.
        max_len: Longest sequence (number of position embeddings).
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        vocab: int,
        d_model: int,
        heads: int,
        kv_heads: int,
        layers: int,
        causal: bool = True,
        attention: AttentionFn = flashbob.attention,
        max_len: int = 16,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, dtype=dtype)
        self.position = nn.Embedding(max_len, d_model, dtype=dtype)
        self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads, causal, attention, dtype) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model, dtype=dtype)
        self.unembed = nn.Linear(d_model, vocab, bias=False, dtype=dtype)

    def forward(self, tokens: Tensor) -> Tensor:
        """Token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``."""
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.norm(x))
