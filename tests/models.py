"""A small float64 MLP for tests (the tests' transformer is :class:`recipes.common.transformer.Transformer`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Sequential):
    """Linear layers of widths ``sizes`` with ``tanh`` between them (smooth, so every Hessian block is nonzero).

    Args:
        sizes: Input width, hidden widths, output width.
        dtype: Parameter dtype.
    """

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype = torch.float64) -> None:
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out, dtype=dtype), nn.Tanh()]
        super().__init__(*layers[:-1])
