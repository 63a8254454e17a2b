"""The autograd chain ``Attention -> AttentionBackward -> BackwardOverBackward``.

Each Function only wires a backend's ``forward``, ``backward`` and ``bob`` together; the math
lives in the backends (:mod:`flashbob.blocked`, :mod:`flashbob.kernels`). Because the first
backward is itself a Function, ``torch.autograd.grad(out, inputs, create_graph=True)`` builds a
graph whose backward is the closed-form BoB, so second derivatives are exact. ``O``, ``lse`` and
``Δ`` enter the lower levels as constants: the BoB formulas already account for every path
through them. A third derivative raises a clear error instead of returning a wrong answer.
"""

from __future__ import annotations


import torch


class Attention(torch.autograd.Function):
    """``(Q, K, V) -> (O, lse)``; ``lse`` is returned only so it can be saved."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float, backend):
        return backend.forward(q, k, v, causal=causal, scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.causal, ctx.scale, ctx.backend = inputs
        o, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, o, lse)

    @staticmethod
    def backward(ctx, do, _lse_grad):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, _delta = AttentionBackward.apply(
            q, k, v, do, o.detach(), lse, ctx.causal, ctx.scale, ctx.backend
        )
        return dq, dk, dv, None, None, None


class AttentionBackward(torch.autograd.Function):
    """``(Q, K, V, dO) -> (dQ, dK, dV, Δ)`` with ``O`` and ``lse`` as constants."""

    @staticmethod
    def forward(q, k, v, do, o, lse, causal: bool, scale: float, backend):
        return backend.backward(q, k, v, o, lse, do, causal=causal, scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, do, o, lse, ctx.causal, ctx.scale, ctx.backend = inputs
        delta = output[3]
        ctx.mark_non_differentiable(delta)
        ctx.set_materialize_grads(False)  # absent cotangents stay None: BoB specialises on them
        ctx.save_for_backward(q, k, v, do, o, lse, delta)

    @staticmethod
    def backward(ctx, dq_bar, dk_bar, dv_bar, _delta_grad):
        q, k, v, do, o, lse, delta = ctx.saved_tensors
        q_bar, k_bar, v_bar, do_bar = BackwardOverBackward.apply(
            q, k, v, do, o, lse, delta, dq_bar, dk_bar, dv_bar, ctx.causal, ctx.scale, ctx.backend
        )
        return q_bar, k_bar, v_bar, do_bar, None, None, None, None, None


class BackwardOverBackward(torch.autograd.Function):
    """``(Q, K, V, dO; Ū, W̄, Z̄) -> (Q̄, K̄, V̄, dŌ)``, the closed-form BoB; not differentiable."""

    @staticmethod
    def forward(q, k, v, do, o, lse, delta, dq_bar, dk_bar, dv_bar, causal, scale, backend):
        return backend.bob(q, k, v, do, o, lse, delta, dq_bar, dk_bar, dv_bar, causal=causal, scale=scale)

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
