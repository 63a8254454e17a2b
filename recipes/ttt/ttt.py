r"""Test-time training: per-sequence fast weights adapted on the context, scored on the continuation.

A sequence is split into a context (its first ``C`` next-token predictions) and a continuation
(the rest). The inner loop copies the *fast* weights :math:`W` (some projection matrices of the
last blocks) once per sequence and takes ``steps`` gradient steps on that sequence's
self-supervised next-token loss over the context,

.. math:: W_{t+1} = W_t - \eta \odot \nabla_W \mathcal{L}_\text{context}(W_t),

with a learnable step size :math:`\eta = e^{\log\eta}` per fast matrix. The outer loss is the
next-token loss of the continuation under the adapted weights, given the whole sequence (so the
model still attends to its context). Its gradient with respect to every base weight and
:math:`\log\eta` differentiates through the inner updates, i.e. through
:math:`\nabla_W \mathcal{L}_\text{context}`; whenever a fast weight sits before an attention (e.g. a
query/key/value projection), that is a derivative of the attention's backward, which flashbob
computes with its closed-form backward-over-backward.

All sequences adapt in one batched pass: a fast matrix ``(in, out)`` is expanded to
``(batch, in, out)`` and the summed per-sequence loss is differentiated with respect to the copies,
which gives each copy exactly its own sequence's gradient.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from recipes.common.transformer import Transformer, compute_dtype

WEIGHTS = {"mlp": ("mlp.up", "mlp.down"), "attn": ("attn.qkv", "attn.out"),
           "block": ("attn.qkv", "attn.out", "mlp.up", "mlp.down")}


def fast_weight_names(model: Transformer, layers: int, weights: str) -> list[str]:
    """Names of the adapted matrices: ``weights`` (``mlp``, ``attn`` or ``block``) of the last ``layers`` blocks."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    n = len(model.blocks)
    if not 0 < layers <= n:
        raise ValueError(f"layers must be in [1, {n}], got {layers}")
    return [f"blocks.{i}.{suffix}" for i in range(n - layers, n) for suffix in WEIGHTS[weights]]


class TTTModel(nn.Module):
    """A causal :class:`Transformer` language model, the names of its fast weights, and their log step sizes."""

    def __init__(self, lm: Transformer, fast_names: list[str], inner_lr: float, learn_lr: bool = True):
        super().__init__()
        self.lm, self.fast_names = lm, list(fast_names)
        self.log_lr = nn.Parameter(torch.full((len(fast_names),), math.log(inner_lr)), requires_grad=learn_lr)

    def inner_lrs(self) -> torch.Tensor:
        return self.log_lr.exp()


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over sequences of each sequence's mean next-token cross-entropy, in at least float32."""
    total = F.cross_entropy(logits.to(compute_dtype(logits)).flatten(0, 1), targets.flatten(), reduction="sum")
    return total / targets.shape[1]


def adapt(model: TTTModel, context_x: torch.Tensor, context_y: torch.Tensor, steps: int, first_order: bool = False,
          autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
          ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Per-sequence fast weights ``{name: (batch, in, out)}`` after ``steps`` inner steps on the context,
    and the mean context loss before each step (and after the last).

    With ``first_order`` the inner gradients are detached (no second derivatives; the base weights
    and step sizes still get first-order meta-gradients)."""
    params = dict(model.lm.named_parameters())
    batch = context_x.shape[0]
    lrs = model.inner_lrs()
    losses = []
    with torch.enable_grad():
        fast = {n: params[n].expand(batch, *params[n].shape) for n in model.fast_names}
        for _ in range(steps):
            with autocast():
                logits = functional_call(model.lm, fast, (context_x,), strict=False)
            loss = sequence_loss(logits, context_y)
            losses.append(loss.item() / batch)
            grads = torch.autograd.grad(loss, list(fast.values()), create_graph=not first_order)
            fast = {n: w - lr * (g.detach() if first_order else g) for (n, w), g, lr in zip(fast.items(), grads, lrs)}
    return fast, losses


def continuation_loss(model: TTTModel, fast: dict[str, torch.Tensor] | None, x: torch.Tensor, y: torch.Tensor,
                      context: int, autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                      ) -> torch.Tensor:
    """Mean next-token loss of targets ``y[:, context:]`` given all of ``x``, with fast weights ``fast``
    (``None``: the base weights, i.e. no test-time training)."""
    with autocast():
        logits = model.lm(x) if fast is None else functional_call(model.lm, fast, (x,), strict=False)
    return sequence_loss(logits[:, context:], y[:, context:]) / x.shape[0]


def outer_loss(model: TTTModel, x: torch.Tensor, y: torch.Tensor, context: int, steps: int, first_order: bool = False,
               autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
               ) -> tuple[torch.Tensor, list[float]]:
    """The continuation loss after test-time training on ``x[:, :context]`` (and the inner losses)."""
    if steps == 0:
        return continuation_loss(model, None, x, y, context, autocast), []
    fast, inner = adapt(model, x[:, :context], y[:, :context], steps, first_order, autocast)
    with autocast():
        logits = functional_call(model.lm, fast, (x,), strict=False)
    inner.append(sequence_loss(logits[:, :context].detach(), y[:, :context]).item() / x.shape[0])
    return sequence_loss(logits[:, context:], y[:, context:]) / x.shape[0], inner
