"""Drop-in replacement for :func:`torch.nn.functional.scaled_dot_product_attention`.

:func:`sdpa` takes SDPA's arguments and runs :func:`flashbob.attention` (exact double backward,
no ``L x S`` tensor) whenever the request is one the backends handle:

* no mask, ``is_causal``, or a **key-padding** mask: a boolean mask (or a float mask whose entries
  are all ``0`` or ``-inf``, as :class:`torch.nn.MultiheadAttention` builds from
  ``key_padding_mask``) that is the same for every query and every head, i.e. broadcastable as
  ``(batch or 1, 1 or heads, 1, S)``; combined with ``is_causal`` if set;
* a boolean mask that is exactly ``causal & key-padding`` (what Hugging Face models build), detected
  by comparing it with the causal mask (top-left aligned, as ``is_causal``);
* ``enable_gqa=True`` with ``heads % kv_heads == 0`` (native grouped-query attention).

Anything else (arbitrary dense masks, per-query masks, additive float biases, ``dropout_p > 0``, a
value head_dim different from the query's, empty sequences) goes to an **exact fallback**: naive
materialising attention (:func:`flashbob.reference.attention`), twice differentiable through autograd,
which warns once per reason (:class:`FallbackWarning`). In strict mode (:func:`set_strict`, or the
environment variable ``FLASHBOB_STRICT=1``) the fallback raises :class:`FallbackError` instead.

A float mask is only read as a key-padding mask when its values may be read and it carries no
derivative: a mask that requires grad (a learnable bias, even one initialised to zeros), one inside a
``torch.func`` transform (``vmap``, ``grad``, ``jvp``), one with a forward-mode tangent, and one on the
meta device all take the exact fallback, which gives the mask its exact first and second derivatives.

Every argument is checked first, as SDPA checks it, and only then is a path chosen (so a
:class:`FallbackWarning` never precedes an error): ``attn_mask`` must be bool (True = attend) or a float
mask of the query's dtype or float32 (SDPA's rule; an integer 0/1 padding mask raises a TypeError that
says to pass ``attn_mask.bool()``), ``dropout_p`` a number in ``[0, 1]``, ``scale`` a finite number.

As in torch 2.13, ``is_causal=True`` together with ``attn_mask`` attends where both allow.
Inputs are ``(..., L, E)`` as in SDPA: 4-d ``(batch, heads, L, E)`` is used as is, 3-d
``(batch, L, E)`` is treated as one head per batch element, 2-d ``(L, E)`` as one of each, and
more than 4 dimensions are flattened into the batch.

:func:`patch_sdpa` routes ``torch.nn.functional.scaled_dot_product_attention`` itself through
:func:`sdpa`, so unmodified models (nanoGPT-style code, :class:`torch.nn.TransformerEncoderLayer`
through :func:`torch.nn.functional.multi_head_attention_forward`) gain exact double backward.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from flashbob import _compat, reference
from flashbob.attention import attention
from flashbob.inputs import accumulator_dtype, check_sdpa_arguments
from flashbob.patching import Patch, Route

__all__ = ["sdpa", "patch_sdpa", "set_strict", "is_strict", "FallbackWarning", "FallbackError"]


class FallbackWarning(UserWarning):
    """Emitted (once per reason) when :func:`sdpa` runs the exact, materialising fallback."""


class FallbackError(RuntimeError):
    """Raised instead of falling back when strict mode is on."""


_strict: bool | None = None  # None: read FLASHBOB_STRICT
_warned: set[str] = set()


def set_strict(strict: bool = True) -> None:
    """Strict mode: :func:`sdpa` raises :class:`FallbackError` instead of running the naive fallback.
    Overrides the ``FLASHBOB_STRICT`` environment variable; ``set_strict(None)`` defers to it again."""
    global _strict
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool or None, got {type(strict).__name__}")
    _strict = strict


def is_strict() -> bool:
    """Whether strict mode is on (:func:`set_strict`, else ``FLASHBOB_STRICT=1``)."""
    return _strict if _strict is not None else os.environ.get("FLASHBOB_STRICT", "0") == "1"


def _fallback(reason: str) -> None:
    """Warn (once per reason) that the call takes the exact fallback, or raise in strict mode.

    ``reason`` names what the kernels do not handle, as a noun phrase ("dropout (dropout_p > 0)").
    """
    what = f"flashbob.sdpa: the flashbob kernels do not handle {reason}"
    if is_strict():
        raise FallbackError(
            f"{what}, and strict mode forbids the exact but materialising (O(L*S) memory) fallback attention; "
            "call flashbob.set_strict(False) to allow it."
        )
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"{what}; using the exact but materialising (O(L*S) memory) fallback attention. "
            "Call flashbob.set_strict(True) or set FLASHBOB_STRICT=1 to raise instead.",
            FallbackWarning,
            stacklevel=3,
        )


def naive_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The exact fallback: :func:`flashbob.reference.attention` (SDPA's math, materialised,
    differentiable any number of times through autograd) called with SDPA's arguments.

    Boolean masks: True = attend; rows that attend to nothing give zero output (and gradients). Float
    masks are added to the scores (in the scores' dtype, as SDPA). The kv heads (dimension -3) are
    repeated when their number differs from the query's, which
    :func:`~flashbob.inputs.check_sdpa_arguments` allows only with ``enable_gqa``. float16 and bfloat16 inputs
    are computed in float32 and the output rounded back, as SDPA's math backend does.
    """
    dtype = query.dtype
    wide = accumulator_dtype(dtype)
    query, key, value, attn_mask = (x.to(wide) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                                    for x in (query, key, value, attn_mask))
    return reference.attention(
        query, key, value, causal=is_causal, scale=scale, attn_mask=attn_mask, dropout_p=dropout_p
    ).to(dtype)


def _opaque_mask_reason(mask: torch.Tensor) -> str | None:
    """Why ``mask`` must take the exact fallback whatever its values, or None if they may be read.

    Reading a mask as a key-padding mask turns it into a constant: a mask that carries derivatives
    would lose them (a learnable bias initialised to zeros looks like "attend everywhere"), and a
    mask whose values cannot be read cannot be classified. (torch.compile cannot trace the test for a torch.func
    transform's tensor; under it the values of a mask that is read break the graph there.)
    """
    if not torch.compiler.is_compiling() and _compat.is_functorch_wrapped(mask):
        return "an attn_mask inside a torch.func transform (its values cannot be read, and it may carry derivatives)"
    if mask.requires_grad:
        return "an attn_mask that requires grad (a learnable bias, which needs its exact gradient)"
    if torch.autograd.forward_ad.unpack_dual(mask).tangent is not None:
        return "an attn_mask with a forward-mode tangent"
    if mask.is_meta:
        return "an attn_mask on the meta device (its values cannot be read)"
    return None


def _fallback_reason(query, key, value, attn_mask, dropout_p) -> str | None:
    """What sends a (valid) call to the exact fallback before its shapes are brought to 4-d, or None."""
    if dropout_p > 0:
        return "dropout (dropout_p > 0)"
    if value.shape[-1] != query.shape[-1]:
        return "a value head_dim different from the query's"
    if 0 in (query.shape[-2], key.shape[-2], query.numel(), key.numel()):
        return "empty inputs"
    return None if attn_mask is None else _opaque_mask_reason(attn_mask)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """A bool view of ``mask`` (True = attend) if it is bool or a float mask of only 0 and -inf, else None."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() and bool(((mask == 0) | (mask == float("-inf"))).all()):
        return mask == 0
    return None


def key_mask_of(mask: torch.Tensor, batch: int, heads: int, n: int, m: int) -> tuple[torch.Tensor | None, bool]:
    """Split a boolean mask broadcastable to ``(batch, heads, n, m)`` into ``(key_mask (batch, m), causal)``
    when it is a key-padding mask (same for every query and head) or exactly ``causal & key-padding``;
    ``(None, False)`` otherwise."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dim() > 4 or mask.shape[-1] != m:
        return None, False
    try:
        mask = mask.expand(batch, mask.shape[1], mask.shape[2], m)
    except RuntimeError:
        return None, False
    if mask.shape[1] not in (1, heads) or mask.shape[2] not in (1, n):
        return None, False
    if mask.shape[1] > 1:
        if not torch.equal(mask, mask[:, :1].expand_as(mask)):
            return None, False
        mask = mask[:, :1]
    if mask.shape[2] == 1:
        return mask[:, 0, 0, :].contiguous(), False
    keys = mask[:, 0, -1, :]  # the last query sees every kept key that causality allows
    if torch.equal(mask[:, 0], reference.causal_mask(n, m, mask.device) & keys[:, None, :]):
        return keys.contiguous(), True
    if torch.equal(mask[:, 0], keys[:, None, :].expand(-1, n, -1)):
        return keys.contiguous(), False
    return None, False


def _autocast(*tensors):
    """Cast as autocast casts SDPA's arguments (lower-precision list): floating tensors other than float64 go to
    the autocast dtype of the query's device."""
    query = tensors[0]
    if not isinstance(query, torch.Tensor):
        return tensors
    device = query.device.type
    # cpu and cuda have autocast; asked only for other devices, since torch 2.11's Dynamo cannot trace the question
    if device not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device):
        return tensors
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
                 else x for x in tensors)


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention` with exact double backward.

    Same arguments and result as SDPA (see the module docstring for what runs on the flashbob
    backends and what on the exact fallback); ``backend`` is passed to :func:`flashbob.attention`. Under
    autocast the floating arguments other than float64 are first cast to the autocast dtype, as autocast casts
    SDPA's.

    Raises:
        TypeError, ValueError: a malformed argument (:func:`~flashbob.inputs.check_sdpa_arguments`), named in
            the message.
        RuntimeError: head counts that do not fit (as SDPA).
        FallbackError: in strict mode, a request that would take the exact fallback.
    """
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    check_sdpa_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend)
    if query.dim() == 2 and key.dim() > 2:
        query = query.unsqueeze(0)  # (L, E) broadcasts as (1, L, E): one head, as in SDPA
    if not enable_gqa and query.dim() > 2 and key.dim() > 2 and query.shape[-3] == 1 < key.shape[-3]:
        query = query.expand(*query.shape[:-3], key.shape[-3], *query.shape[-2:])  # one query head broadcasts
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    reason = _fallback_reason(query, key, value, attn_mask, dropout_p)
    if reason is not None:
        _fallback(reason)
        return naive_attention(*args)

    # (..., L, E) -> (batch, heads, L, E)
    if query.dim() == 3 and key.dim() == 3 and query.shape[0] == key.shape[0]:
        q4, k4, v4 = (x.unsqueeze(1) for x in (query, key, value))
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
        unpack_shape = None
    else:
        while query.dim() < 4:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
        if query.shape[:-3] != key.shape[:-3]:
            _fallback("batch dimensions of query and key that differ (broadcast)")
            return naive_attention(*args)
        # flatten, not einops.pack: its reshape(-1) fails on an empty batch (an empty vmap under jacfwd)
        unpack_shape = query.shape[:-3]
        q4, k4, v4 = (x.flatten(0, -4) for x in (query, key, value))
        if attn_mask is not None and attn_mask.dim() > 4:
            attn_mask = attn_mask.expand(*query.shape[:-3], *attn_mask.shape[-3:]).flatten(0, -4)
    batch, heads, n, _ = q4.shape
    m = k4.shape[2]

    causal, key_mask = is_causal, None
    if attn_mask is not None:
        bool_mask = as_bool_mask(attn_mask)
        key_mask, mask_is_causal = (None, False) if bool_mask is None else key_mask_of(bool_mask, batch, heads, n, m)
        if key_mask is None:
            _fallback("an attn_mask that is not a key-padding (or causal & key-padding) mask")
            return naive_attention(*args)
        causal = causal or mask_is_causal
    out = attention(q4, k4, v4, causal=causal, scale=scale, key_mask=key_mask, backend=backend)
    if unpack_shape is None:
        return out.squeeze(1)
    out = out.unflatten(0, unpack_shape)
    while out.dim() > max(x.dim() for x in args[:3]):
        out = out.squeeze(0)
    return out


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """What ``F.scaled_dot_product_attention`` is while a :class:`patch_sdpa` is open in any thread: :func:`sdpa`
    with the backend of this thread's innermost patch, or the replaced function in a thread without one."""
    return _SDPA_ROUTE.call(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)


_SDPA_ROUTE = Route(F, "scaled_dot_product_attention", lambda *args, **kwargs: sdpa(*args, **kwargs), _patched_sdpa)


class patch_sdpa(Patch):
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through :func:`sdpa`.

    A context manager and a decorator; the patch holds in the thread that opened it, until it closes
    (also on errors). Patches nest (the innermost one's ``backend`` applies) and may close in any order;
    other threads keep the original function meanwhile, and the last patch to close, in any thread, puts
    it back. Code that imported the function by name before patching (``from torch.nn.functional import
    scaled_dot_product_attention``) keeps the original. Example::

        with flashbob.patch_sdpa():
            loss = model(x).sum()              # model calls F.scaled_dot_product_attention
            grads = torch.autograd.grad(loss, params, create_graph=True)
    """

    route = _SDPA_ROUTE
