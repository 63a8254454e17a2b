"""flashbob: softmax attention that is exactly differentiable twice, without an N x M tensor."""

from flashbob import reference
from flashbob.attention import attention

__version__ = "0.1.0"
__all__ = ["attention", "reference", "__version__"]
