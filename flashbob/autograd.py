"""The autograd chain ``Attention -> AttentionBackward -> BackwardOverBackward``.

Each Function only wires a backend's ``forward``, ``backward`` and ``bob`` together; the math
lives in the backends (:mod:`flashbob.blocked`, :mod:`flashbob.kernels`). Because the first
backward is itself a Function, ``torch.autograd.grad(out, inputs, create_graph=True)`` builds a
graph whose backward is the closed-form BoB, so second derivatives are exact. ``O``, ``stats`` and
``Δ`` enter the lower levels as constants: the BoB formulas already account for every path
through them. A third derivative raises a clear error instead of returning a wrong answer.

The optional boolean key-padding mask ``key_mask`` ``(batch, M)`` is a non-differentiable input
of every level. All three Functions use the ``setup_context`` style and define a ``vmap`` rule
that folds the vmapped dimension into the batch dimension, so ``torch.func.grad``, ``vjp`` and
``vmap`` (over any argument, e.g. per-sample gradients) compose with them. Forward-mode AD
(``torch.func.jvp``, ``torch.autograd.forward_ad``) is not implemented and raises a clear error.
"""

from __future__ import annotations

import torch
from einops import rearrange

FORWARD_MODE_ERROR = (
    "flashbob.attention does not support forward-mode AD (torch.func.jvp, torch.func.jacfwd, "
    "torch.autograd.forward_ad): only reverse mode is implemented (torch.autograd.grad, torch.func.grad, "
    "vjp, jacrev, vmap; double backward included). Use torch.func.jacrev / a double-vjp for Hessian-vector "
    "products, or flashbob.reference.attention for forward mode at small sizes."
)


def _fold(info, in_dims, args):
    """Move every vmapped dimension to the front, expand unbatched tensors, merge it with the batch dim."""
    folded = []
    for x, dim in zip(args, in_dims):
        if isinstance(x, torch.Tensor):
            x = x.expand(info.batch_size, *x.shape) if dim is None else x.movedim(dim, 0)
            x = rearrange(x, "v b ... -> (v b) ...")
        folded.append(x)
    return folded


def _unfold(info, outputs):
    unfolded = tuple(rearrange(x, "(v b) ... -> v b ...", v=info.batch_size) for x in outputs)
    return unfolded, (0,) * len(unfolded)


class Attention(torch.autograd.Function):
    """``(Q, K, V) -> (O, stats)``; ``stats`` (the backend's softmax row statistics: lse for the blocked
    backend, row max and log-sum for the kernels) is returned only so it can be saved."""

    @staticmethod
    def forward(q, k, v, key_mask, causal: bool, scale: float, backend):
        return backend.forward(q, k, v, causal=causal, scale=scale, key_mask=key_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, key_mask, ctx.causal, ctx.scale, ctx.backend = inputs
        o, stats = output
        ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(q, k, v, o, stats, key_mask)

    @staticmethod
    def backward(ctx, do, _stats_grad):
        q, k, v, o, stats, key_mask = ctx.saved_tensors
        dq, dk, dv, _delta = AttentionBackward.apply(
            q, k, v, do, o.detach(), stats, key_mask, ctx.causal, ctx.scale, ctx.backend
        )
        return dq, dk, dv, None, None, None, None

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(FORWARD_MODE_ERROR)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _unfold(info, Attention.apply(*_fold(info, in_dims, args)))


class AttentionBackward(torch.autograd.Function):
    """``(Q, K, V, dO) -> (dQ, dK, dV, Δ)`` with ``O`` and ``stats`` as constants."""

    @staticmethod
    def forward(q, k, v, do, o, stats, key_mask, causal: bool, scale: float, backend):
        return backend.backward(q, k, v, o, stats, do, causal=causal, scale=scale, key_mask=key_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, do, o, stats, key_mask, ctx.causal, ctx.scale, ctx.backend = inputs
        delta = output[3]
        ctx.mark_non_differentiable(delta)
        ctx.set_materialize_grads(False)  # absent cotangents stay None: BoB specialises on them
        ctx.save_for_backward(q, k, v, do, o, stats, delta, key_mask)

    @staticmethod
    def backward(ctx, dq_bar, dk_bar, dv_bar, _delta_grad):
        q, k, v, do, o, stats, delta, key_mask = ctx.saved_tensors
        q_bar, k_bar, v_bar, do_bar = BackwardOverBackward.apply(
            q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, key_mask, ctx.causal, ctx.scale, ctx.backend
        )
        return q_bar, k_bar, v_bar, do_bar, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(FORWARD_MODE_ERROR)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _unfold(info, AttentionBackward.apply(*_fold(info, in_dims, args)))


class BackwardOverBackward(torch.autograd.Function):
    """``(Q, K, V, dO; Ū, W̄, Z̄) -> (Q̄, K̄, V̄, dŌ)``, the closed-form BoB; not differentiable."""

    @staticmethod
    def forward(q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, key_mask, causal, scale, backend):
        return backend.bob(
            q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, causal=causal, scale=scale, key_mask=key_mask
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "flashbob.attention is differentiable twice, not three times: the backward-over-backward "
            "(BoB) has no derivative. Use flashbob.reference.attention for third-order derivatives "
            "at small sizes."
        )

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(FORWARD_MODE_ERROR)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _unfold(info, BackwardOverBackward.apply(*_fold(info, in_dims, args)))
