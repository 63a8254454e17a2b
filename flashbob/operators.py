"""The passes of both backends as ``torch.library`` operators ``flashbob::<backend>_<pass>``, each with a fake
implementation, so that torch.compile puts attention into its graphs.

The passes are ``forward``, ``backward``, ``bob`` (backward-over-backward), ``forward_jvp`` and ``backward_jvp``;
each operator takes its pass's arguments in the order of the backends' functions, keyword arguments included:
tensors, optional tensors (``None``: an absent, zero cotangent or tangent; for ``backward_jvp``, no forward tangents
``o_dot``, ``stats_dot``), then the masks (:mod:`flashbob.masks`: ``key_mask``, the document ids ``q_ids``,
``k_ids``, a block mask's ``tile_state`` and ``tile_bits``, ``causal``, the window as ``window_left``,
``window_right``), ``scale`` and, for the kernels,
``allow_tf32``. :func:`with_window` calls them with ``window=(left, right)`` as the backends' functions take it.

* The blocked backend's passes are opaque custom operators (:func:`torch.library.custom_op`) with contiguous
  outputs; their fake implementations give the outputs' shapes and dtypes.
* The kernels' passes are opaque custom operators too: inductor calls them as they are and launches their kernels
  at run time, tuned, in the thread that runs the pass (the backward's, whose Triton allocator the kernels' tensor
  descriptors need). Their fake implementation is their host code run on fake tensors, which launches nothing
  (:mod:`flashbob.kernels.tracing`). They are not Triton operators (:func:`torch.library.triton_op`), whose kernels
  inductor compiles into its own code: with Triton 3.6 and torch 2.11, inductor's compilation of them raises in its
  worker process, and under aot_eager the backward's kernels find no allocator for their tensor descriptors
  (docs/performance.md).

The forward operators are differentiable once (:func:`torch.library.register_autograd`, through the backward
operator), which is what torch.compile, differentiating once, needs; the autograd Functions of
:mod:`flashbob.autograd` call the operators and give every derivative in eager mode.
"""

import os
from typing import Optional

import torch
from torch import Tensor

from flashbob import blocked
from flashbob.inputs import accumulator_dtype

PASSES = ("forward", "backward", "bob", "forward_jvp", "backward_jvp")


def _empty_like(x: Tensor) -> Tensor:
    """A contiguous tensor of ``x``'s shape, dtype and device."""
    return x.new_empty(x.shape)


def _row_statistic(q: Tensor) -> Tensor:
    """A contiguous ``(batch, heads, N)`` row statistic of ``q``'s rows, in the accumulator dtype."""
    return q.new_empty(q.shape[:3], dtype=accumulator_dtype(q.dtype))


def _contiguous(outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(x.contiguous() for x in outputs)


def _masks(key_mask: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
           tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool, window_left: Optional[int],
           window_right: Optional[int]) -> dict:
    """The masks as a backend's pass takes them (:mod:`flashbob.masks`)."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return dict(key_mask=key_mask, q_ids=q_ids, k_ids=k_ids, tile_state=tile_state, tile_bits=tile_bits,
                causal=causal, window=window)


def with_window(operator):
    """``operator`` called as the backends' functions are, with ``window=(left, right)`` (or None) where the
    operator takes ``window_left`` and ``window_right``."""

    def call(*args, window=None, **kwargs):
        left, right = window if window is not None else (None, None)
        return operator(*args, window_left=left, window_right=right, **kwargs)

    return call


def _differentiable_once(forward, backward) -> None:
    """Register the gradient of a forward operator ``(q, k, v, *masks, *options) -> (o, stats)`` (five mask tensors):
    its ``backward`` operator's ``(dq, dk, dv)`` for the cotangent of ``o`` (``stats`` is not differentiable)."""

    def setup_context(ctx, inputs, output):
        q, k, v, *masks = inputs[:8]
        ctx.options = inputs[8:]
        o, stats = output
        ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(q, k, v, o, stats, *masks)

    def gradient(ctx, do, _stats_grad):
        q, k, v, o, stats, *masks = ctx.saved_tensors
        dq, dk, dv, _delta = backward(q, k, v, o, stats, do, *masks, *ctx.options)
        return dq, dk, dv, *(None for _ in masks), *(None for _ in ctx.options)

    forward.register_autograd(gradient, setup_context=setup_context)


# ----------------------------------------------------------------------------- blocked backend
# Every operator's last arguments are the masks and options: key_mask, q_ids, k_ids, tile_state, tile_bits, causal,
# window_left, window_right, scale (and allow_tf32 for the kernels); the fake implementations take them as ``*_``.

@torch.library.custom_op("flashbob::blocked_forward", mutates_args=())
def blocked_forward(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
    tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool, window_left: Optional[int],
    window_right: Optional[int], scale: float,
) -> tuple[Tensor, Tensor]:
    """:func:`flashbob.blocked.forward`: ``(o, lse)``."""
    masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
    return _contiguous(blocked.forward(q, k, v, scale=scale, **masks))


@blocked_forward.register_fake
def _(q, k, v, *_):
    return _empty_like(q), _row_statistic(q)


@torch.library.custom_op("flashbob::blocked_backward", mutates_args=())
def blocked_backward(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, do: Tensor, key_mask: Optional[Tensor],
    q_ids: Optional[Tensor], k_ids: Optional[Tensor], tile_state: Optional[Tensor], tile_bits: Optional[Tensor],
    causal: bool, window_left: Optional[int], window_right: Optional[int], scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`flashbob.blocked.backward`: ``(dq, dk, dv, delta)``."""
    masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
    return _contiguous(blocked.backward(q, k, v, o, stats, do, scale=scale, **masks))


@blocked_backward.register_fake
def _(q, k, v, *_):
    return _empty_like(q), _empty_like(k), _empty_like(v), _row_statistic(q)


@torch.library.custom_op("flashbob::blocked_bob", mutates_args=())
def blocked_bob(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, o: Tensor, stats: Tensor, delta: Tensor, dq_bar: Optional[Tensor],
    dk_bar: Optional[Tensor], dv_bar: Optional[Tensor], key_mask: Optional[Tensor], q_ids: Optional[Tensor],
    k_ids: Optional[Tensor], tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool,
    window_left: Optional[int], window_right: Optional[int], scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`flashbob.blocked.bob`: ``(q_bar, k_bar, v_bar, do_bar)``."""
    masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
    return _contiguous(blocked.bob(q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, scale=scale, **masks))


@blocked_bob.register_fake
def _(q, k, v, do, *_):
    return _empty_like(q), _empty_like(k), _empty_like(v), _empty_like(do)


@torch.library.custom_op("flashbob::blocked_forward_jvp", mutates_args=())
def blocked_forward_jvp(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, q_dot: Optional[Tensor], k_dot: Optional[Tensor],
    v_dot: Optional[Tensor], key_mask: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
    tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool, window_left: Optional[int],
    window_right: Optional[int], scale: float,
) -> tuple[Tensor, Tensor]:
    """:func:`flashbob.blocked.forward_jvp`: ``(o_dot, stats_dot)``."""
    masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
    return _contiguous(blocked.forward_jvp(q, k, v, o, stats, q_dot, k_dot, v_dot, scale=scale, **masks))


@blocked_forward_jvp.register_fake
def _(q, k, v, o, stats, *_):
    return _empty_like(q), _empty_like(stats)


@torch.library.custom_op("flashbob::blocked_backward_jvp", mutates_args=())
def blocked_backward_jvp(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, o: Tensor, stats: Tensor, delta: Tensor, q_dot: Optional[Tensor],
    k_dot: Optional[Tensor], v_dot: Optional[Tensor], do_dot: Optional[Tensor], o_dot: Optional[Tensor],
    stats_dot: Optional[Tensor], key_mask: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
    tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool, window_left: Optional[int],
    window_right: Optional[int], scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`flashbob.blocked.backward_jvp`: ``(dq_dot, dk_dot, dv_dot)``."""
    masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
    return _contiguous(blocked.backward_jvp(q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, o_dot=o_dot,
                                            stats_dot=stats_dot, scale=scale, **masks))


@blocked_backward_jvp.register_fake
def _(q, k, v, *_):
    return _empty_like(q), _empty_like(k), _empty_like(v)


_differentiable_once(blocked_forward, blocked_backward)
BLOCKED = dict(zip(PASSES, (blocked_forward, blocked_backward, blocked_bob, blocked_forward_jvp, blocked_backward_jvp)))


# ----------------------------------------------------------------------------- Triton kernels


def kernels_run() -> bool:
    """Whether the kernels can run here: on a CUDA GPU, or in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel_operators() -> dict:
    """The kernels' passes as operators ``flashbob::triton_<pass>``, by pass (imports Triton)."""
    from flashbob import kernels

    def forward(
        q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
        tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool, window_left: Optional[int],
        window_right: Optional[int], scale: float, allow_tf32: bool,
    ) -> tuple[Tensor, Tensor]:
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
        return kernels.forward(q, k, v, scale=scale, allow_tf32=allow_tf32, **masks)

    def backward(
        q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, do: Tensor, key_mask: Optional[Tensor],
        q_ids: Optional[Tensor], k_ids: Optional[Tensor], tile_state: Optional[Tensor], tile_bits: Optional[Tensor],
        causal: bool, window_left: Optional[int], window_right: Optional[int], scale: float, allow_tf32: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
        return kernels.backward(q, k, v, o, stats, do, scale=scale, allow_tf32=allow_tf32, **masks)

    def bob(
        q: Tensor, k: Tensor, v: Tensor, do: Tensor, o: Tensor, stats: Tensor, delta: Tensor,
        dq_bar: Optional[Tensor], dk_bar: Optional[Tensor], dv_bar: Optional[Tensor], key_mask: Optional[Tensor],
        q_ids: Optional[Tensor], k_ids: Optional[Tensor], tile_state: Optional[Tensor], tile_bits: Optional[Tensor],
        causal: bool, window_left: Optional[int], window_right: Optional[int], scale: float, allow_tf32: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
        return kernels.bob(q, k, v, do, o, stats, delta, dq_bar, dk_bar, dv_bar, scale=scale, allow_tf32=allow_tf32,
                           **masks)

    def forward_jvp(
        q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, q_dot: Optional[Tensor], k_dot: Optional[Tensor],
        v_dot: Optional[Tensor], key_mask: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
        tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool, window_left: Optional[int],
        window_right: Optional[int], scale: float, allow_tf32: bool,
    ) -> tuple[Tensor, Tensor]:
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
        return kernels.forward_jvp(q, k, v, o, stats, q_dot, k_dot, v_dot, scale=scale, allow_tf32=allow_tf32,
                                   **masks)

    def backward_jvp(
        q: Tensor, k: Tensor, v: Tensor, do: Tensor, o: Tensor, stats: Tensor, delta: Tensor, q_dot: Optional[Tensor],
        k_dot: Optional[Tensor], v_dot: Optional[Tensor], do_dot: Optional[Tensor], o_dot: Optional[Tensor],
        stats_dot: Optional[Tensor], key_mask: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
        tile_state: Optional[Tensor], tile_bits: Optional[Tensor], causal: bool, window_left: Optional[int],
        window_right: Optional[int], scale: float, allow_tf32: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        masks = _masks(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left, window_right)
        return kernels.backward_jvp(q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, o_dot=o_dot,
                                    stats_dot=stats_dot, scale=scale, allow_tf32=allow_tf32, **masks)

    passes = {"forward": forward, "backward": backward, "bob": bob, "forward_jvp": forward_jvp,
              "backward_jvp": backward_jvp}
    operators = {}
    for name, host in passes.items():
        operators[name] = torch.library.custom_op(f"flashbob::triton_{name}", host, mutates_args=())
        operators[name].register_fake(host)
    _differentiable_once(operators["forward"], operators["backward"])
    return operators


#: The kernels' operators by pass, registered at import where the kernels can run (:func:`kernels_run`), so that
#: torch.compile finds them; none elsewhere, where Triton is not imported.
KERNELS = _kernel_operators() if kernels_run() else {}
