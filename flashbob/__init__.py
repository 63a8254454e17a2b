"""flashbob: softmax attention that is exactly differentiable twice, without an N x M tensor."""

from flashbob import masks, reference
from flashbob.attention import attention
from flashbob.dropin import FallbackError, FallbackWarning, patch_sdpa, sdpa, set_strict
from flashbob.flex import flex_attention, patch_flex_attention
from flashbob.kept import KeptAttention

__version__ = "0.1.0"
__all__ = [
    "attention", "sdpa", "patch_sdpa", "flex_attention", "patch_flex_attention", "set_strict", "FallbackWarning",
    "FallbackError", "KeptAttention", "masks", "reference", "tune", "__version__",
]


def __getattr__(name: str):
    """``flashbob.tune`` (:func:`flashbob.kernels.tuning.tune`), imported on first use: it imports triton."""
    if name == "tune":
        from flashbob.kernels.tuning import tune

        return tune
    raise AttributeError(f"module 'flashbob' has no attribute {name!r}")
