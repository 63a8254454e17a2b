"""Fused Triton kernels of attention, its backward and its backward-over-backward."""

from .backward import backward
from .bob import bob
from .forward import forward

__all__ = ["forward", "backward", "bob"]
