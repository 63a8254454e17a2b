"""A small pre-norm transformer whose attention is :func:`flashbob.attention`, naive eager attention or any
attention function; the model of the MAML and TTT recipes, the benchmarks and the tests. Also the attention
settings the recipes share, and :class:`AttentionSwitch`, which runs torch's fused attention on the passes
differentiated once and flashbob's on those an optimizer differentiates twice.

Every projection is a plain matrix applied as ``x @ W``, so a weight may be replaced (through
:func:`torch.func.functional_call` or torchopt's meta-optimizers) by a tensor with a leading batch
dimension, ``(batch, in, out)``: each sequence of the batch then runs with its own copy. This is how
test-time training gives every sequence its own fast weights in one batched forward pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Callable

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import flashbob
from flashbob import reference

#: ``(q, k, v, *, causal, window=None, document_ids=None) -> o``, each ``(batch, heads, seq, head_dim)``; ``k`` and
#: ``v`` may have fewer heads (GQA); ``window`` and ``document_ids`` as in :func:`flashbob.attention`
AttentionFn = Callable[..., torch.Tensor]
BACKENDS = ("auto", "triton", "blocked")
ATTENTION = (*BACKENDS, "eager")  # twice differentiable: what curvature products, MAML and TTT need
FIRST_ORDER_ATTENTION = ("sdpa",)  # differentiable once


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window=None,
         document_ids=None) -> torch.Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention` (torch's fused kernels), with GQA when ``k`` has
    fewer heads than ``q``; a window or documents as a dense boolean mask. Its backward cannot be differentiated
    again."""
    gqa = k.shape[1] != q.shape[1]
    if window is None and document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    mask = flashbob.masks.dense(q.shape[2], k.shape[2], causal=causal, window=window, document_ids=document_ids,
                                device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window=None,
          document_ids=None) -> torch.Tensor:
    """:func:`flashbob.reference.attention` (materialised scores, PyTorch autograd); a window or documents as a
    dense boolean mask."""
    if window is None and document_ids is None:
        return reference.attention(q, k, v, causal=causal)
    mask = flashbob.masks.dense(q.shape[2], k.shape[2], causal=causal, window=window, document_ids=document_ids,
                                device=q.device)
    return reference.attention(q, k, v, attn_mask=mask)


def attention_function(name: str) -> AttentionFn:
    """The attention a model's ``attention`` setting names: ``auto``, ``triton`` or ``blocked``:
    :func:`flashbob.attention` on that backend (twice differentiable, no ``N x N`` tensor; ``auto``:
    Triton on CUDA, blocked PyTorch elsewhere); ``eager``: :func:`flashbob.reference.attention`
    (naive, materialises the scores, PyTorch autograd: the reference); ``sdpa``: torch's
    :func:`sdpa` (fast, differentiable once). ``flashbob.attention`` is
    looked up at each call, so patching it (as the benchmarks do) reaches every model built here."""
    if name == "eager":
        return eager
    if name == "sdpa":
        return sdpa
    if name not in BACKENDS:
        raise ValueError(f"attention must be one of {', '.join((*ATTENTION, *FIRST_ORDER_ATTENTION))}, got {name!r}")

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, **masks) -> torch.Tensor:
        return flashbob.attention(q, k, v, causal=causal, backend=name, **masks)

    return attend


class AttentionSwitch:
    """A model's attention: ``attention`` on every pass, except inside :meth:`for_curvature` and on inputs that
    carry forward-mode tangents, where it is a twice-differentiable one with forward-mode rules: the same if
    ``attention`` already is, else flashbob's (``auto``).

    With ``attention="sdpa"`` a recipe runs the passes that are differentiated once (first-order steps,
    the steps of a second-order optimizer that take no curvature, evaluation) on torch's fused attention
    and only the passes an optimizer differentiates twice, or pushes tangents through (forward-mode
    curvature products: torch's fused SDPA has no forward-mode rule), on flashbob. Call it as an attention
    function.

    Attributes:
        first_order: The attention outside :meth:`for_curvature`.
        twice: The attention inside it.
    """

    def __init__(self, attention: str) -> None:
        self.first_order = attention_function(attention)
        self.twice = self.first_order if attention in ATTENTION else attention_function("auto")
        self._curvature = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, **masks) -> torch.Tensor:
        tangents = any(fwAD.unpack_dual(t).tangent is not None for t in (q, k, v))
        attend = self.twice if self._curvature or tangents else self.first_order
        return attend(q, k, v, causal=causal, **masks)

    def current(self) -> Callable[[], AbstractContextManager]:
        """A factory of context managers that re-enter the present mode: for a recomputation that runs outside the
        :meth:`for_curvature` block its first run ran in (``optim.checkpoint(..., context=switch.current())``)."""
        return functools.partial(self.for_curvature, self._curvature)

    @contextmanager
    def for_curvature(self, on: bool = True) -> Iterator[None]:
        """Within the block, attend with :attr:`twice` if ``on`` (else :attr:`first_order`); restored after."""
        previous, self._curvature = self._curvature, on
        try:
            yield
        finally:
            self._curvature = previous


def kv_heads(d_model: int, n_heads: int, n_kv_heads: int | None) -> int:
    """The key/value heads (``None``: ``n_heads``), after checking that ``d_model`` is ``n_heads`` times an
    even head dimension (rotary embeddings turn channel pairs) and that they divide ``n_heads``."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if d_model % n_heads or (d_model // n_heads) % 2:
        raise ValueError(f"d_model ({d_model}) must be n_heads ({n_heads}) times an even head dimension")
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({n_kv_heads})")
    return n_kv_heads


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype otherwise (float64 stays float64)."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def constant(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """``value``, a constant of a computation on ``like``: as it is, or, when ``like`` carries a forward-mode
    tangent, as a dual tensor (of ``like``'s dtype and device if ``value`` is a number) with a zero tangent.

    The numbers are the same either way. It only spares host time: PyTorch's forward AD gives an operand without
    a tangent an implicit zero tangent (a ZeroTensor), and each operation on one runs a Python meta function
    (torch 2.13, CPU: 0.2-0.6 ms per multiplication or addition, against 0.01 ms with a real zero tangent). In
    the GPT's RoPE and RMSNorm that was 82 operations per forward pass with tangents.
    """
    if fwAD.unpack_dual(like).tangent is None:
        return value
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=like.dtype, device=like.device)
    return fwAD.make_dual(value, torch.zeros_like(value))


class RMSNorm(nn.Module):
    r""":math:`y = x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \cdot w`, statistics in at least float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x))
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + constant(self.eps, xf))).to(x.dtype) * self.weight


class _SiLU(torch.autograd.Function):
    r""":math:`\mathrm{silu}(x) = x\, \sigma(x)` with :math:`\mathrm{silu}'(x) = \sigma(x)\,(1 + x\,(1 - \sigma(x)))`
    written from elementary operations in its backward and its forward-mode rule.

    ``F.silu``'s backward (``aten::silu_backward``) has no forward-mode derivative in torch 2.13, so a Hessian
    product by forward-over-reverse (``optim.hvp(..., mode="forward")``, ``torch.autograd.forward_ad`` through
    a gradient) fails on a SwiGLU MLP. Here the backward's operations carry tangents; the forward saves only
    ``x`` and runs the fused ``F.silu``; the derivative is computed in at least float32 (as ``silu_backward``
    does) and rounded to the input dtype."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def derivative(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x))
        s = torch.sigmoid(xf)
        return (s * (1 + xf * (1 - s))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * _SiLU.derivative(x)

    @staticmethod
    def jvp(ctx, x_dot: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return x_dot * _SiLU.derivative(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)``; on inputs that carry forward-mode tangents, :class:`_SiLU`, whose backward has a forward-mode
    derivative too (first-order passes keep the fused ``F.silu`` and its fused backward)."""
    return _SiLU.apply(x) if fwAD.unpack_dual(x).tangent is not None else F.silu(x)


def rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    r"""Rotary position embedding of ``x`` ``(batch, heads, seq, head_dim)``: channel pair
    :math:`(x_i, x_{i + d/2})` at position :math:`t` turns by :math:`t\, \mathrm{base}^{-2i/d}`
    (angles in at least float32; float64 inputs stay float64, so exactness tests are exact)."""
    n, d = x.shape[-2], x.shape[-1]
    dtype = compute_dtype(x)
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=dtype) / d)
    angles = torch.outer(torch.arange(n, device=x.device, dtype=dtype), inv_freq)
    cos, sin = constant(angles.cos(), x), constant(angles.sin(), x)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def sliding_window(window: int | None, causal: bool) -> tuple[int, int] | None:
    """flashbob's ``window`` for a model whose queries see the ``window`` nearest keys up to themselves (causal:
    itself and the ``window - 1`` before it), or keys at a distance below ``window`` (not causal); None: all."""
    if window is None:
        return None
    if window < 1:
        raise ValueError(f"window must be a positive number of keys (or None), got {window}")
    return (window - 1, 0) if causal else (window - 1, window - 1)


def matrix(fan_in: int, fan_out: int, gain: float = 1.0) -> nn.Parameter:
    """A ``(fan_in, fan_out)`` weight drawn from :math:`\\mathcal{N}(0, \\mathrm{gain}^2 / \\mathrm{fan\\_in})`."""
    return nn.Parameter(torch.randn(fan_in, fan_out) * gain / math.sqrt(fan_in))


class SelfAttention(nn.Module):
    """Fused query/key/value projection (``n_kv_heads`` key/value heads: grouped-query attention when
    fewer than ``n_heads``), rotary positions, attention, output projection."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, causal: bool, rope_base: float,
                 attend: AttentionFn, out_gain: float, window: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.causal, self.rope_base, self.attend = (n_heads, n_kv_heads, causal,
                                                                                  rope_base, attend)
        self.window = sliding_window(window, causal)
        head_dim = d_model // n_heads
        self.widths = (n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim)
        self.qkv = matrix(d_model, sum(self.widths))
        self.out = matrix(d_model, d_model, out_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ self.qkv).split(self.widths, dim=-1)
        q = rearrange(q, "b n (h d) -> b h n d", h=self.n_heads)
        k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.n_kv_heads) for t in (k, v))
        q, k = rotate(q, self.rope_base), rotate(k, self.rope_base)
        o = self.attend(q, k, v, causal=self.causal, **({} if self.window is None else {"window": self.window}))
        return rearrange(o, "b h n d -> b n (h d)") @ self.out


def mlp_hidden(d_model: int, kind: str, ratio: float) -> int:
    """The MLP's hidden width: ``ratio * d_model``, 2/3 of it for ``swiglu`` (as many weights as ``gelu``), rounded.

    Raises:
        ValueError: ``kind`` is neither, or the width rounds to 0 (an MLP that would always output 0).
    """
    if kind not in ("gelu", "swiglu"):
        raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {kind!r}")
    hidden = round(ratio * d_model * (2 / 3 if kind == "swiglu" else 1))
    if hidden < 1:
        raise ValueError(f"mlp_ratio {ratio} gives the {kind} MLP of d_model {d_model} a hidden width of {hidden}: "
                         "it would always output 0; use a larger mlp_ratio")
    return hidden


class MLP(nn.Module):
    """``gelu(x W_up) W_down``."""

    def __init__(self, d_model: int, hidden: int, out_gain: float):
        super().__init__()
        self.up = matrix(d_model, hidden)
        self.down = matrix(hidden, d_model, out_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.up) @ self.down


class Block(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, mlp_ratio: float, causal: bool, rope_base: float,
                 attend: AttentionFn, out_gain: float, window: int | None = None):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, n_kv_heads, causal, rope_base, attend, out_gain, window)
        self.mlp = MLP(d_model, mlp_hidden(d_model, "gelu", mlp_ratio), out_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and a linear head.

    ``readout="tokens"``: logits ``(batch, seq, n_outputs)`` at every position (a language model when
    ``causal``); ``readout="mean"``: logits ``(batch, n_outputs)`` of the mean-pooled sequence (a
    sequence classifier). ``attention`` is a name of :data:`ATTENTION` (see :func:`attention_function`)
    or an attention function ``(q, k, v, *, causal, window=None) -> o`` itself; ``n_kv_heads`` (default
    ``n_heads``) must divide ``n_heads``; ``window`` (:func:`sliding_window`) limits each query to its nearest keys.
    """

    def __init__(self, *, vocab_size: int, n_outputs: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: int | None = None, mlp_ratio: float = 4.0, causal: bool = True, readout: str = "tokens",
                 rope_base: float = 10000.0, attention: str | AttentionFn = "auto", window: int | None = None):
        super().__init__()
        n_kv_heads = kv_heads(d_model, n_heads, n_kv_heads)
        if readout not in ("tokens", "mean"):
            raise ValueError(f"readout must be 'tokens' or 'mean', got {readout!r}")
        attend = attention_function(attention) if isinstance(attention, str) else attention
        self.readout = readout
        self.embed = nn.Parameter(torch.randn(vocab_size, d_model))
        out_gain = 1 / math.sqrt(2 * n_layers)  # residual branches scaled down with depth
        self.blocks = nn.ModuleList(Block(d_model, n_heads, n_kv_heads, mlp_ratio, causal, rope_base, attend,
                                          out_gain, window) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = matrix(d_model, n_outputs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.readout == "mean":
            x = x.mean(dim=1)
        return x @ self.head
