"""Fused Triton kernels of attention, its backward, its backward-over-backward and their forward mode."""

from .backward import backward
from .bob import bob
from .common import logsumexp
from .forward import forward
from .jvp import backward_jvp, forward_jvp

__all__ = ["backward", "backward_jvp", "bob", "forward", "forward_jvp", "logsumexp"]
