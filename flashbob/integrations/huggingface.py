"""Hugging Face transformers: ``attn_implementation="bob"`` (needs the ``hf`` extra).

:func:`register` adds ``"bob"`` to transformers' ``AttentionInterface`` (the attention
function) and ``AttentionMaskInterface`` (SDPA-style boolean masks, or None for plain causal), so
that models using the attention interface (Llama, Qwen2, Mistral, GPT-2, ...) can be built with
``attn_implementation="bob"`` and get exact double backward (Hessian-vector products, ...).

Why not ``"flashbob"``: recent transformers (checked with 5.24) treat every implementation name that
contains ``"flash"`` as a FlashAttention kernel to load from the Hub, so that name cannot be used
there. :func:`register` also registers ``"flashbob"`` when the installed transformers does not
special-case it (older releases).

Masks: no mask + causal module runs the kernels with ``causal=True``; a boolean mask that is
``causal & key-padding`` (batches with padding) runs the kernels with ``causal=True`` and a key
mask; anything else (sliding windows, packed sequences, ...) goes through :func:`flashbob.sdpa`'s
exact fallback, with a one-time warning (or an error in strict mode).
"""

from __future__ import annotations

import sys
import warnings

import torch

from flashbob.dropin import sdpa

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
        attention_mask = _packed_sequences_mask(kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k"), query, key,
                                                is_causal)
        is_causal = False
    if is_causal and key.shape[2] > n:  # prefill of an empty static cache: top-left causal on the first n keys
        key, value = key[:, :, :n], value[:, :, :n]
    out = sdpa(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _packed_sequences_mask(cu_q: torch.Tensor, cu_k: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                           causal: bool) -> torch.Tensor:
    """flash-attention's varlen semantics as a ``(batch, 1, N, M)`` boolean mask: ``cu_seq_lens_q`` / ``_k`` (the
    sequences' cumulative lengths over the flattened ``batch * N`` queries and ``batch * M`` keys, as
    ``DataCollatorWithFlattening`` passes them) let a query see only the keys of its own sequence, causally
    (bottom-right aligned within the sequence, as flash-attention) when ``causal``."""
    batch, n, m = query.shape[0], query.shape[2], key.shape[2]

    def sequence_and_offset(cu: torch.Tensor, length: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        cu = cu.to(device=query.device, dtype=torch.long)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != batch * length:
            raise ValueError(f"{name} must be the cumulative sequence lengths (0, ..., {batch * length}) of the "
                             f"{batch * length} flattened positions, got {cu.tolist()}")
        if not torch.isin(torch.arange(0, batch * length, length, device=cu.device), cu).all():
            raise ValueError(f"{name}: a packed sequence that crosses from one batch row to the next is not supported "
                             f"(rows of {length}), got {cu.tolist()}")
        position = torch.arange(batch * length, device=query.device)
        sequence = torch.searchsorted(cu[1:], position, right=True)
        return sequence.reshape(batch, length), (position - cu[1:][sequence]).reshape(batch, length)  # offset < 0

    seq_q, end_q = sequence_and_offset(cu_q, n, "cu_seq_lens_q")
    seq_k, end_k = sequence_and_offset(cu_q if cu_k is None else cu_k, m, "cu_seq_lens_k")
    mask = seq_q[:, :, None] == seq_k[:, None, :]
    if causal:
        mask = mask & (end_k[:, None, :] <= end_q[:, :, None])
    return mask[:, None]


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
