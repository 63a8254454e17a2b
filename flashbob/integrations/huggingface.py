"""Hugging Face transformers: ``attn_implementation="bob"`` (needs the ``hf`` extra).

:func:`register` adds ``"bob"`` to transformers' ``AttentionInterface`` (the attention
function) and ``AttentionMaskInterface`` (SDPA-style boolean masks, or None for plain causal), so
that models using the attention interface (Llama, Qwen2, Mistral, GPT-2, ...) can be built with
``attn_implementation="bob"`` and get exact double backward (Hessian-vector products, ...).

Why not ``"flashbob"``: recent transformers (checked with 5.24) treat every implementation name that
contains ``"flash"`` as a FlashAttention kernel to load from the Hub, so that name cannot be used
there. :func:`register` also registers ``"flashbob"`` when the installed transformers does not
special-case it (older releases).

Masks: no mask + causal module runs the kernels with ``causal=True``. A boolean mask is read as flashbob's masks
where they give exactly that mask (checked element by element): causal, the module's sliding window
(``sliding_window``: Mistral, Qwen2, Gemma, ...), packed sequences (position ids that restart, or flash-attention's
``cu_seq_lens_q`` / ``cu_seq_lens_k``) as document ids, and a key-padding mask; these run in the kernels. Anything
else goes through :func:`flashbob.sdpa` (its exact fallback, with a one-time warning, or an error in strict mode).
"""

from __future__ import annotations

import sys
import warnings

import torch

from flashbob import masks
from flashbob.attention import attention
from flashbob.dropin import as_bool_mask, sdpa

NAME = "bob"


def flashbob_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention-interface function: ``(B, H, N, d)`` inputs (kv heads unrepeated),
    returns ``((B, N, H, d) output, None)`` like the SDPA implementation. Packed sequences that come as
    flash-attention's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` without a mask are kept apart, as flash-attention does.

    Raises:
        ValueError: a model passes what softmax attention with a mask cannot express: ``softcap``,
            ``position_bias``, or attention sinks (``s_aux`` / ``sinks``, e.g. GPT-OSS), which would
            otherwise be dropped silently.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='flashbob' does not support softcap; use 'eager'")
    if kwargs.get("position_bias") is not None:
        raise ValueError("attn_implementation='flashbob' does not support position_bias; use 'eager' or 'sdpa'")
    sinks = next((name for name in ("s_aux", "sinks") if kwargs.get(name) is not None), None)
    if sinks is not None:
        raise ValueError(f"attn_implementation='flashbob' does not support attention sinks (this model passes "
                         f"{sinks}, a per-head logit added to every softmax row); use 'eager'")
    if kwargs.get("output_attentions", False) and not _warned_attentions:
        _warn_no_attention_weights()
    n = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(is_causal) and attention_mask is None and n > 1
    if attention_mask is None and kwargs.get("cu_seq_lens_q") is not None:  # packed sequences, as flash-attention
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k")
        if dropout == 0.0 and n == key.shape[2] and (cu_k is None or torch.equal(cu_k.to(cu_q.device), cu_q)):
            ids = _packed_sequences(cu_q, query, n, "cu_seq_lens_q")[0]
            out = attention(query, key, value, causal=is_causal, document_ids=ids, scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        attention_mask = _packed_sequences_mask(cu_q, cu_k, query, key, is_causal)
        is_causal = False
    compact = _as_flashbob_masks(module, query, key, attention_mask, kwargs) if dropout == 0.0 else None
    if compact is not None:
        out = attention(query, key, value, scale=scaling, **compact)
        return out.transpose(1, 2).contiguous(), None
    if is_causal and key.shape[2] > n:  # prefill of an empty static cache: top-left causal on the first n keys
        key, value = key[:, :, :n], value[:, :, :n]
    out = sdpa(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _packed_sequences(cu: torch.Tensor, query: torch.Tensor, length: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the ``batch * length`` flattened positions' sequence and its offset from the sequence's end (< 0),
    both ``(batch, length)``, from flash-attention's cumulative sequence lengths ``cu`` (as
    ``DataCollatorWithFlattening`` passes them)."""
    batch = query.shape[0]
    cu = cu.to(device=query.device, dtype=torch.long)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != batch * length:
        raise ValueError(f"{name} must be the cumulative sequence lengths (0, ..., {batch * length}) of the "
                         f"{batch * length} flattened positions, got {cu.tolist()}")
    if not torch.isin(torch.arange(0, batch * length, length, device=cu.device), cu).all():
        raise ValueError(f"{name}: a packed sequence that crosses from one batch row to the next is not supported "
                         f"(rows of {length}), got {cu.tolist()}")
    position = torch.arange(batch * length, device=query.device)
    sequence = torch.searchsorted(cu[1:], position, right=True)
    return sequence.reshape(batch, length), (position - cu[1:][sequence]).reshape(batch, length)


def _packed_sequences_mask(cu_q: torch.Tensor, cu_k: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                           causal: bool) -> torch.Tensor:
    """flash-attention's varlen semantics as a ``(batch, 1, N, M)`` boolean mask: ``cu_seq_lens_q`` / ``_k`` (the
    sequences' cumulative lengths over the flattened ``batch * N`` queries and ``batch * M`` keys) let a query see
    only the keys of its own sequence, causally (bottom-right aligned within the sequence, as flash-attention)
    when ``causal``. (Sequences of equal query and key lengths take document ids instead.)"""
    n, m = query.shape[2], key.shape[2]
    seq_q, end_q = _packed_sequences(cu_q, query, n, "cu_seq_lens_q")
    seq_k, end_k = _packed_sequences(cu_q if cu_k is None else cu_k, query, m, "cu_seq_lens_k")
    mask = seq_q[:, :, None] == seq_k[:, None, :]
    if causal:
        mask = mask & (end_k[:, None, :] <= end_q[:, :, None])
    return mask[:, None]


def _as_flashbob_masks(module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> dict | None:
    """flashbob.attention's masks (causal, window, document_ids, key_mask) that give exactly transformers' boolean
    (or 0 / -inf) ``attention_mask`` ``(batch, 1, N, N)``, or None.

    The candidates: the module's causality, its ``sliding_window`` (a query sees the ``sliding_window`` keys up to
    itself: ``window = (sliding_window - 1, 0)``), documents where the position ids restart (packed sequences), and
    the keys some query sees as the key mask. They are taken only if they give the mask element for element
    (compared one block of rows at a time), so a mask they cannot express goes on to :func:`flashbob.sdpa`."""
    mask = None if attention_mask is None else as_bool_mask(attention_mask)
    batch, n, m = query.shape[0], query.shape[2], key.shape[2]
    if mask is None or mask.dim() != 4 or mask.shape[1] != 1 or n != m or n < 2:
        return None
    mask = mask.expand(batch, 1, n, m)[:, 0]
    causal = bool(getattr(module, "is_causal", True))
    sliding_window = kwargs.get("sliding_window")
    window = (int(sliding_window) - 1, 0) if sliding_window else None
    document_ids = _documents(kwargs.get("position_ids"), batch, n)
    key_mask = mask.any(dim=1)
    q_ids = k_ids = document_ids
    candidate = masks.Mask(n, m, masks.band(causal, window), key_mask, q_ids, k_ids)
    rows_per_block = max(1, (1 << 22) // max(1, batch * m))
    for start in range(0, n, rows_per_block):
        rows = slice(start, min(n, start + rows_per_block))
        if not torch.equal(candidate.visible(rows, slice(0, m), mask.device)[:, 0].expand(batch, -1, -1),
                           mask[:, rows]):
            return None
    return dict(causal=causal, window=window, document_ids=document_ids,
                key_mask=None if bool(key_mask.all()) else key_mask)


def _documents(position_ids: torch.Tensor | None, batch: int, n: int) -> torch.Tensor | None:
    """Document ids ``(batch, N)`` from position ids that restart (packed sequences: a new document wherever the
    position does not follow the previous one); None without position ids or without a restart."""
    if position_ids is None or position_ids.shape[-1] != n:
        return None
    position_ids = position_ids.expand(batch, n)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(dim=1)


_warned_attentions = False


def _warn_no_attention_weights() -> None:
    """Say once per process that ``output_attentions=True`` gets no weights (as transformers' 'sdpa' does)."""
    global _warned_attentions
    _warned_attentions = True
    warnings.warn("attn_implementation='flashbob' never forms the attention weights, so output_attentions=True "
                  "returns None for them; use attn_implementation='eager' to get them", UserWarning, stacklevel=3)


def flashbob_mask(*args, config=None, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask (boolean, or None for plain causal), for models whose attention goes through the
    attention interface (and so reaches :func:`flashbob_attention_forward`).

    Raises:
        ValueError: the model computes attention itself (Bloom, MPT, XGLM, MegatronBERT, RoFormer, ImageGPT, ...):
            transformers accepts any registered name for it, but it never calls flashbob and would read the SDPA
            mask as its own additive mask (a boolean added to the scores, or no causal mask at all): silently wrong.
    """
    if config is not None and not _uses_attention_interface(type(config)):
        name = getattr(config, "_attn_implementation", None) or NAME
        family = type(config).__name__.removesuffix("Config")
        raise ValueError(f"attn_implementation={name!r}: {family} models compute attention themselves, "
                         f"not through transformers' attention interface, so they never call flashbob (and would read "
                         f"its SDPA-style mask as their own); use attn_implementation='eager'")
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, config=config, **kwargs)


def _uses_attention_interface(config_class: type) -> bool:
    """False where the modeling module next to ``config_class``'s (``configuration_x`` -> ``modeling_x``) is loaded
    and never looks up ``ALL_ATTENTION_FUNCTIONS``; True where it does, or where it cannot be told."""
    module = config_class.__module__
    if ".configuration_" not in module:
        return True
    modeling = sys.modules.get(module.replace(".configuration_", ".modeling_"))
    return modeling is None or hasattr(modeling, "ALL_ATTENTION_FUNCTIONS")


def _usable_name(name: str) -> bool:
    """False where transformers would take ``name`` for a FlashAttention kernel (names with "flash")."""
    try:
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return True
    return not is_flash_attention_requested(requested_attention_implementation=name)


def register(name: str = NAME) -> list[str]:
    """Register flashbob's attention (and SDPA-style mask creation) in transformers under ``name``
    (default ``"bob"``) and, where the installed transformers allows it, ``"flashbob"``.
    Returns the names registered; pass one as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    names = [name] + (["flashbob"] if name != "flashbob" and _usable_name("flashbob") else [])
    for registered in names:
        AttentionInterface.register(registered, flashbob_attention_forward)
        AttentionMaskInterface.register(registered, flashbob_mask)
    return names
