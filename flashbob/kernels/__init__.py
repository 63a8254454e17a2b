"""Fused Triton kernels of attention, its backward and its backward-over-backward."""

from .backward import backward
from .bob import bob
from .common import logsumexp
from .forward import forward

__all__ = ["forward", "backward", "bob", "logsumexp"]
