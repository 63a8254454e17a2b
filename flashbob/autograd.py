"""The autograd chain ``Attention -> AttentionBackward -> BackwardOverBackward`` and its forward-mode rules.

Each Function only wires a backend's passes together; the math lives in the backends
(:mod:`flashbob.blocked`, :mod:`flashbob.kernels`). Because the first backward is itself a
Function, ``torch.autograd.grad(out, inputs, create_graph=True)`` builds a graph whose backward is
the closed-form BoB, so second derivatives are exact. ``O`` and ``stats`` enter the first backward as
inputs whose gradients the BoB does not return: its formulas already account for every path through them
(and through ``Δ``).

Forward mode: ``Attention``'s ``jvp`` rule gives the tangents of ``O`` and of the statistics (the
backend's ``forward_jvp``) and ``AttentionBackward``'s gives the tangents of ``dQ, dK, dV``
(``backward_jvp``), reusing those two where forward mode also went through the forward (forward-over-reverse:
the row scalars ``ṙ`` and ``Δ̇`` then need no sweep of their own) and recomputing them where not. So ``torch.func.jvp``, ``jacfwd``,
``torch.autograd.forward_ad`` and forward-over-reverse second derivatives (``torch.func.hessian`` =
``jacfwd(jacrev(f))``, ``jvp`` of ``grad``) work. The tangents are computed by two more Functions,
``AttentionTangent`` and ``AttentionBackwardTangent``, so that under ``jacfwd``/``vmap`` (which
hand the ``jvp`` rules batched tangents) their ``vmap`` rules fold the batch before any kernel runs.

What is not differentiable raises a clear error instead of returning a wrong answer: the BoB
and the backward's tangents (third derivatives), and the forward's tangent differentiated again
(reverse-over-forward such as ``jacrev(jacfwd(f))``, forward-over-forward such as ``jacfwd(jacfwd(f))``).

The forward passes (``Attention``, ``AttentionTangent``) run through :func:`flashbob.kept.through`, so that a
checkpointed block's recomputation can reuse their outputs from its first run.

The masks (:mod:`flashbob.masks`) are non-differentiable inputs of every level: the boolean key-padding mask
``key_mask`` ``(batch, M)``, the document ids ``q_ids`` ``(batch, N)``, ``k_ids`` ``(batch, M)`` and a block
mask's tiles ``tile_state``, ``tile_bits`` as tensors (batched with the inputs under vmap), ``causal`` and
``window`` as options. All Functions use the ``setup_context`` style and define a ``vmap`` rule that folds
the vmapped dimension into the batch dimension, so ``torch.func.grad``, ``vjp``, ``jacrev``,
``jacfwd`` and ``vmap`` (over any argument, e.g. per-sample gradients) compose with them.
"""

from __future__ import annotations

import functools
import inspect

import torch
from einops import rearrange

from flashbob import _compat, kept
from flashbob.inputs import MAX_GRID_Y

SECOND_ORDER_ROUTES = (
    "Second derivatives are available as reverse-over-reverse (torch.autograd.grad with create_graph=True, "
    "torch.autograd.functional.vhp, torch.func.jacrev(torch.func.jacrev(f))) and as forward-over-reverse "
    "(torch.func.hessian, torch.func.jvp of torch.func.grad)."
)
THIRD_ORDER_ERROR = (
    "flashbob.attention is differentiable twice, not three times: something differentiated its backward's "
    "backward (the closed-form backward-over-backward, or the tangent of the backward), which has no derivative. "
    "A third derivative does this, and so does torch.autograd.functional.hvp, which reaches a second derivative "
    "by differentiating the backward's backward (its double-vjp trick): for Hessian-vector products use "
    "torch.autograd.functional.vhp (the same product, as a Hessian is symmetric), optim.hvp, or torch.func.jvp "
    "of torch.func.grad. For third-order derivatives use flashbob.reference.attention at small sizes."
)
TANGENT_ERROR = (
    "flashbob.attention's forward-mode tangent cannot be differentiated again (reverse-over-forward, e.g. "
    "torch.func.jacrev(torch.func.jacfwd(f)) or a backward through a jvp; forward-over-forward, e.g. "
    "torch.func.jacfwd(torch.func.jacfwd(f))). " + SECOND_ORDER_ROUTES + " Third derivatives are not supported: "
    "use flashbob.reference.attention for them at small sizes."
)


def _vmapped(function, batch_size: int, in_dims, args):
    """``function`` over a vmapped dimension of ``batch_size``: that dimension is moved to the front of every tensor
    (unbatched ones are expanded) and merged with the batch dimension, in chunks whose batch * heads fit the
    Triton kernels' grid (``jacfwd`` and ``hessian`` vmap over thousands of tangents), and split off the outputs
    again. Returns the outputs (a tensor or a tuple of them) with the vmapped dimension first."""
    moved = [(x.expand(batch_size, *x.shape) if dim is None else x.movedim(dim, 0)) if isinstance(x, torch.Tensor)
             else x for x, dim in zip(args, in_dims)]
    tensors = [x for x in moved if isinstance(x, torch.Tensor)]
    batch = tensors[0].shape[1]
    programs = max((x.shape[1] * x.shape[2] for x in tensors if x.dim() == 5), default=1)
    step = max(1, MAX_GRID_Y // max(programs, 1))
    pieces = []
    for start in range(0, max(batch_size, 1), step):  # one call even for an empty vmap, for the outputs' shapes
        chunk = [rearrange(x[start:start + step], "v b ... -> (v b) ...") if isinstance(x, torch.Tensor) else x
                 for x in moved]
        size = min(step, batch_size - start)
        outputs = function(*chunk)
        single = isinstance(outputs, torch.Tensor)
        pieces.append([rearrange(y, "(v b) ... -> v b ...", v=size, b=batch) for y in ((outputs,) if single else outputs)])
    joined = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*pieces)]
    return joined[0] if single else tuple(joined)


def _vmap_rule(function, info, in_dims, args):
    """A Function's ``vmap`` staticmethod: :func:`_vmapped`, with the outputs' vmapped dimension (0) beside them."""
    outputs = _vmapped(function, info.batch_size, in_dims, args)
    return outputs, 0 if isinstance(outputs, torch.Tensor) else (0,) * len(outputs)


def _legacy_vmap_support(forward):
    """Let a Function's ``forward`` take tensors batched by PyTorch's legacy vmap.

    ``torch.autograd.grad(..., is_grads_batched=True)``, ``torch.autograd.functional.jacobian`` and
    ``hessian`` with ``vectorize=True`` and gradcheck's batched checks use that older vmap, which
    does not call the Functions' ``vmap`` rules: the backends would see tensors without storage. The
    batch dimension is taken out of every tensor (unbatched ones are expanded), folded into the
    batch dimension as in the ``vmap`` rules, and put back on the outputs.

    The wrapper carries its own signature, ``(*args)``, as ``__signature__``: ``Function.apply`` binds the
    arguments to ``inspect.signature(forward)`` on every call (torch 2.13), which without a stored signature
    rebuilds ``forward``'s through ``__wrapped__`` (60-100 us on the CPU), and binding to ``forward``'s 7-15
    named parameters takes 13-22 us against 5 us for ``(*args)``. Every caller passes all arguments by
    position, so the bound arguments are the same; a wrong count fails in ``forward`` itself.
    """

    @functools.wraps(forward)
    def wrapper(*args):
        if not any(_compat.is_legacy_batched(x) for x in args):
            return forward(*args)
        level = _compat.legacy_vmap_level()
        if level != 1:
            raise RuntimeError(
                "flashbob.attention does not support nested legacy vmaps (torch._vmap_internals, used by "
                "is_grads_batched=True and vectorize=True); use torch.func.vmap instead"
            )
        batch_size = next(_compat.remove_legacy_batch_dim(x, level, 0).shape[0]
                          for x in args if _compat.is_legacy_batched(x))
        physical = [_compat.remove_legacy_batch_dim(x, level, batch_size) if isinstance(x, torch.Tensor) else x
                    for x in args]
        outputs = _vmapped(forward, batch_size, [0] * len(args), physical)
        if isinstance(outputs, torch.Tensor):
            return _compat.add_legacy_batch_dim(outputs, level)
        return tuple(_compat.add_legacy_batch_dim(x, level) for x in outputs)

    wrapper.__signature__ = _POSITIONAL_ONLY
    return wrapper


_POSITIONAL_ONLY = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])


def apply(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, without the work ``Function.apply`` does on every call that a call here does
    not need: where no ``torch.func`` transform is active, it binds the arguments to ``forward``'s signature to
    fill in defaults (none here: every caller passes all by position), ~15 us on the CPU, before it calls
    the C++ ``apply`` that this calls directly (after unwrapping tensors of finished transforms, as it does).
    Under a transform, ``function.apply`` itself, which routes the call through the transform's rules."""
    if _compat.functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*_compat.unwrap_finished_transforms(args))


def _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal: bool, window) -> dict:
    """The mask arguments of a backend's pass (:mod:`flashbob.masks`)."""
    return dict(key_mask=key_mask, q_ids=q_ids, k_ids=k_ids, tile_state=tile_state, tile_bits=tile_bits,
                causal=causal, window=window)


class Attention(torch.autograd.Function):
    """``(Q, K, V) -> (O, stats)``; ``stats`` (the backend's softmax row statistics: lse for the blocked
    backend, row max and log-sum for the kernels) is returned only so it can be saved."""

    @staticmethod
    @_legacy_vmap_support
    def forward(q, k, v, key_mask, q_ids, k_ids, tile_state, tile_bits, causal: bool, window, scale: float, backend):
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window)
        return kept.through("forward", (q, k, v, *masks.values(), scale, backend),
                            lambda: backend.forward(q, k, v, scale=scale, **masks))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, *masks, ctx.causal, ctx.window, ctx.scale, ctx.backend = inputs
        o, stats = output
        ctx.set_materialize_grads(False)  # absent tangents stay None: the backends skip them
        ctx.save_for_backward(q, k, v, o, stats, *masks)
        ctx.save_for_forward(q, k, v, o, stats, *masks)

    @staticmethod
    def backward(ctx, do, _stats_grad):
        if do is None:  # O's cotangent is absent (zero)
            return (None,) * 12
        q, k, v, o, stats, *masks = ctx.saved_tensors
        dq, dk, dv, _delta = apply(
            AttentionBackward, q, k, v, do, o, stats, *masks, ctx.causal, ctx.window, ctx.scale, ctx.backend
        )
        return dq, dk, dv, *(None,) * 9

    @staticmethod
    def jvp(ctx, q_dot, k_dot, v_dot, *_):
        q, k, v, o, stats, *masks = ctx.saved_tensors
        return apply(
            AttentionTangent, q, k, v, o, stats, q_dot, k_dot, v_dot, *masks, ctx.causal, ctx.window, ctx.scale,
            ctx.backend,
        )

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_rule(functools.partial(apply, Attention), info, in_dims, args)


class AttentionBackward(torch.autograd.Function):
    """``(Q, K, V, dO, O, stats) -> (dQ, dK, dV, Δ)``. Its backward (the BoB) treats ``O`` and ``stats`` as the
    functions of ``Q, K, V`` they are and returns no gradient for them; its ``jvp`` takes their tangents where
    the forward's tangent was computed (forward-over-reverse) and recomputes them where not."""

    @staticmethod
    @_legacy_vmap_support
    def forward(q, k, v, do, o, stats, key_mask, q_ids, k_ids, tile_state, tile_bits, causal: bool, window,
                scale: float, backend):
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window)
        return backend.backward(q, k, v, o, stats, do, scale=scale, **masks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, do, o, stats, *masks, ctx.causal, ctx.window, ctx.scale, ctx.backend = inputs
        delta = output[3]
        ctx.mark_non_differentiable(delta)
        ctx.set_materialize_grads(False)  # absent cotangents and tangents stay None: the backends skip them
        ctx.save_for_backward(q, k, v, do, o, stats, delta, *masks)
        ctx.save_for_forward(q, k, v, do, o, stats, delta, *masks)

    @staticmethod
    def backward(ctx, dq_bar, dk_bar, dv_bar, _delta_grad):
        q, k, v, do, o, stats, delta, *masks = ctx.saved_tensors
        q_bar, k_bar, v_bar, do_bar = apply(
            BackwardOverBackward, q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, *masks, ctx.causal,
            ctx.window, ctx.scale, ctx.backend,
        )
        return q_bar, k_bar, v_bar, do_bar, *(None,) * 11

    @staticmethod
    def jvp(ctx, q_dot, k_dot, v_dot, do_dot, o_dot, stats_dot, *_):
        q, k, v, do, o, stats, delta, *masks = ctx.saved_tensors
        if o_dot is None or stats_dot is None:  # O entered without the forward's tangent: recompute it
            o_dot = stats_dot = None
        dq_dot, dk_dot, dv_dot = apply(
            AttentionBackwardTangent, q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, o_dot, stats_dot,
            *masks, ctx.causal, ctx.window, ctx.scale, ctx.backend,
        )
        return dq_dot, dk_dot, dv_dot, None

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_rule(functools.partial(apply, AttentionBackward), info, in_dims, args)


class _Terminal(torch.autograd.Function):
    """The Functions whose outputs are not differentiated again (BoB and the tangents): their derivatives
    raise ``ERROR``; their vmap rule folds the vmapped dimension into the batch."""

    ERROR = THIRD_ORDER_ERROR

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @classmethod
    def backward(cls, ctx, *grads):
        raise RuntimeError(cls.ERROR)

    @classmethod
    def jvp(cls, ctx, *tangents):
        raise RuntimeError(cls.ERROR)

    @classmethod
    def vmap(cls, info, in_dims, *args):
        return _vmap_rule(functools.partial(apply, cls), info, in_dims, args)


class BackwardOverBackward(_Terminal):
    """``(Q, K, V, dO; Ū, W̄, Z̄) -> (Q̄, K̄, V̄, dŌ)``, the closed-form BoB; not differentiable."""

    @staticmethod
    @_legacy_vmap_support
    def forward(q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, key_mask, q_ids, k_ids, tile_state, tile_bits,
                causal, window, scale, backend):
        return backend.bob(q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, scale=scale,
                           **_masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window))


class AttentionTangent(_Terminal):
    """``(Q, K, V; Q̇, K̇, V̇) -> (Ȯ, the tangent of stats)`` with ``O`` and ``stats`` as constants: ``Attention``'s
    jvp; not differentiable."""

    ERROR = TANGENT_ERROR

    @staticmethod
    @_legacy_vmap_support
    def forward(q, k, v, o, stats, q_dot, k_dot, v_dot, key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window,
                scale, backend):
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window)
        return kept.through(
            "forward_jvp", (q, k, v, o, stats, q_dot, k_dot, v_dot, *masks.values(), scale, backend),
            lambda: backend.forward_jvp(q, k, v, o, stats, q_dot, k_dot, v_dot, scale=scale, **masks),
        )


class AttentionBackwardTangent(_Terminal):
    """``(Q, K, V, dO; Q̇, K̇, V̇, dȮ; Ȯ, ṡtats) -> (dQ̇, dK̇, dV̇)``: ``AttentionBackward``'s jvp, with the
    tangents of ``O`` and ``stats`` when it has them (else they are recomputed, ``O``, ``stats`` and ``Δ`` being
    functions of ``Q, K, V, dO``); not differentiable (a third derivative)."""

    @staticmethod
    @_legacy_vmap_support
    def forward(q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, o_dot, stats_dot, key_mask, q_ids, k_ids,
                tile_state, tile_bits, causal, window, scale, backend):
        return backend.backward_jvp(
            q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, o_dot=o_dot, stats_dot=stats_dot, scale=scale,
            **_masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window),
        )
