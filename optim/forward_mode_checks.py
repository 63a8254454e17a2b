"""What forward-mode curvature products need of a model, checked before a product or explained after one failed:
one deterministic function (no dropout, since each product runs the model again), and a forward-mode rule for
every operation."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from optim import _compat

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
CHECKPOINT_WITHOUT_FORWARD_RULE = "activation checkpointing (torch.utils.checkpoint)"  # named by the error below


def active_dropout(module: nn.Module) -> str | None:
    """The name of the first submodule of ``module`` that draws a random mask in its forward (a dropout layer,
    or ``nn.MultiheadAttention`` with a dropout rate, in training mode with a rate above 0); ``None`` if none
    does. Dropout called as a function (``F.dropout``) cannot be seen."""
    for name, sub in module.named_modules():
        if isinstance(sub, _DROPOUTS):
            rate = sub.p
        elif isinstance(sub, nn.MultiheadAttention):
            rate = sub.dropout
        else:
            continue
        if sub.training and rate > 0:
            return name or type(module).__name__
    return None


def check_deterministic(owner: str, module: nn.Module | None) -> None:
    """Raise ``RuntimeError`` if ``module`` would run with dropout (:func:`active_dropout`): products that run it
    again (forward mode) would each see another mask, so they would not be products of one matrix."""
    name = None if module is None else active_dropout(module)
    if name is not None:
        raise RuntimeError(
            f"{owner}: forward mode runs the model again for each curvature product, and its {name!r} draws a new "
            "dropout mask on every run, so the products would not be those of one matrix (a Gauss-Newton product "
            "would not even be symmetric); call model.eval() or set the dropout rate to 0 for the curvature, or "
            "use mode='reverse', which differentiates the closure's own graph"
        )


@contextmanager
def forward_mode_errors() -> Iterator[None]:
    """Turn PyTorch's error for an operation without a forward-mode rule into one that says what to do."""
    try:
        yield
    except NotImplementedError as error:
        if not re.search(r"forward[- ](mode )?AD", str(error)):
            raise
        if _compat.raised_in_torch_checkpoint(error):
            raise NotImplementedError(
                f"mode='forward' runs through {CHECKPOINT_WITHOUT_FORWARD_RULE}, which has no "
                f"forward-mode rule in torch {torch.__version__} (torch 2.11 has none, 2.13 has one). Turn "
                "checkpointing off for curvature products, or use mode='reverse'"
            ) from error
        raise NotImplementedError(
            "mode='forward' needs a forward-mode derivative of every operation of the model (and, for Hessian "
            "products, of its backward), and PyTorch has none for one of them (below). Use mode='reverse', or "
            "write that operation from simpler ones (e.g. F.silu as x * torch.sigmoid(x))"
        ) from error
    except RuntimeError as error:
        if "ZeroTensors are immutable" not in str(error):
            raise
        raise RuntimeError(
            "mode='forward' ran into a PyTorch forward-mode rule that writes into a zero tangent (below; in torch "
            "2.13 the backward of F.mse_loss, for Hessian products). Use mode='reverse', or write that operation "
            "from simpler ones (e.g. F.mse_loss(o, y) as (o - y).square().mean())"
        ) from error
