"""Running a module with other tensors in place of some of its parameters and buffers, and leaving it as found.

A parameter lives in slots: an entry of some submodule's ``_parameters`` (or ``_buffers``) dict. One tensor can
sit in several slots (an embedding tied to the output head), and one slot can be reached under several names
(a block registered more than once, ``nn.ModuleList([block] * 3)``, or a module shared by two parents).
:func:`swapped` replaces a tensor in every slot that holds it, visiting each slot once, and puts back exactly
what each slot held. ``torch.func.functional_call`` swaps a slot once per name that reaches it, so with a
module registered twice it restores the value it put in rather than the parameter: the module loses its
Parameters for good.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import Tensor, nn


def _slot_owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule and attribute name of the parameter or buffer called ``name`` in ``module``."""
    path, _, attribute = name.rpartition(".")
    owner = module.get_submodule(path) if path else module
    if attribute not in owner._parameters and attribute not in owner._buffers:
        raise KeyError(f"{type(module).__name__} has no parameter or buffer named {name!r}")
    return owner, attribute


@contextlib.contextmanager
def swapped(module: nn.Module, values: Mapping[str, Tensor]) -> Iterator[None]:
    """Within the block, ``module`` holds ``values[name]`` wherever it held the tensor named ``name`` (a parameter
    or buffer name as ``named_parameters``/``named_buffers`` gives it), in every slot holding that tensor: tied
    tensors stay tied, a shared submodule is swapped once. Afterwards every slot holds what it held before, also
    when the block raised."""
    replacement: dict[int, Tensor] = {}
    for name, value in values.items():
        owner, attribute = _slot_owner(module, name)
        current = owner._parameters.get(attribute, owner._buffers.get(attribute))
        if current is None:
            raise KeyError(f"{type(module).__name__}.{name} is None; there is no tensor to replace")
        replacement[id(current)] = value
    originals: list[tuple[dict, str, Tensor]] = []
    try:
        for submodule in module.modules():  # each submodule once, however many names reach it
            for slots in (submodule._parameters, submodule._buffers):
                for attribute, tensor in slots.items():
                    if tensor is not None and id(tensor) in replacement:
                        originals.append((slots, attribute, tensor))
                        slots[attribute] = replacement[id(tensor)]
        yield
    finally:
        for slots, attribute, tensor in reversed(originals):
            slots[attribute] = tensor


def call(module: nn.Module, values: Mapping[str, Tensor], *args, **kwargs):
    """``module(*args, **kwargs)`` with ``values`` in place of the named parameters and buffers (:func:`swapped`)."""
    with swapped(module, values):
        return module(*args, **kwargs)
