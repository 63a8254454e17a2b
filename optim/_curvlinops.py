"""curvlinops, an optional dependency of optim: its import with an error that says how to install it, and its
random draws tied to a caller's generator."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

INSTALL = "pip install --no-deps curvlinops-for-pytorch"


def curvlinops(module: str, caller: str) -> ModuleType:
    """Import ``module`` (``"curvlinops"`` or one of its submodules) for ``caller``.

    Raises:
        ImportError: curvlinops is not installed; the message names ``caller`` and the command that installs it
            (``--no-deps``: its declared dependencies would pull in torchvision and another torch build).
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{caller} needs curvlinops (an optional dependency of optim, not installed here): {INSTALL}"
        ) from error


@contextmanager
def drawing_from(generator: torch.Generator | None, device: torch.device) -> Iterator[None]:
    """curvlinops draws its random vectors from torch's global generator. With a ``generator``, the block runs on a
    fork of the global state (CPU and ``device``) seeded with a number drawn from ``generator``, and the global
    state is as before afterwards; with ``None`` it draws from the global generator itself."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
