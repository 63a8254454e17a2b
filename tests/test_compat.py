"""Every private PyTorch and Triton API flashbob relies on (flashbob/_compat.py) still does what flashbob needs.

A torch or Triton release that removes or changes one fails here, naming it, rather than deep inside an attention
call."""

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._vmap_internals import vmap as legacy_vmap

from flashbob import _compat


def _broke(api: str) -> str:
    return (f"torch {torch.__version__} changed the private API {api}, which flashbob._compat wraps: "
            "adapt flashbob/_compat.py")


def test_the_legacy_vmap_is_seen_and_its_batch_dimension_moves():
    seen = {}

    def probe(x):
        seen["batched"] = _compat.is_legacy_batched(x)
        seen["level"] = _compat.legacy_vmap_level()
        physical = _compat.remove_legacy_batch_dim(x, seen["level"], 3)  # the vmapped size
        seen["shape"] = tuple(physical.shape)
        return _compat.add_legacy_batch_dim(physical * 2, seen["level"])

    x = torch.randn(3, 5)
    with pytest.warns(FutureWarning):  # torch recommends torch.vmap, which users of the legacy one don't call
        out = legacy_vmap(probe)(x)
    assert seen["batched"], _broke("torch._C._functorch.is_legacy_batchedtensor")
    assert seen["level"] == 1, _broke("torch._C._vmapmode_increment_nesting")
    assert seen["shape"] == (3, 5), _broke("torch._remove_batch_dim")
    torch.testing.assert_close(out, 2 * x, msg=_broke("torch._add_batch_dim"))
    assert not _compat.is_legacy_batched(x) and not _compat.is_legacy_batched(1.0)
    assert _compat.legacy_vmap_level() == 0, _broke("torch._C._vmapmode_increment_nesting")


def test_functorch_transforms_and_their_wrappers_are_seen():
    seen = {}

    def probe(x):
        seen["active"] = _compat.functorch_transforms_active()
        seen["wrapped"] = _compat.is_functorch_wrapped(x)
        return x.sin().sum()

    torch.func.grad(probe)(torch.randn(4))
    assert seen["active"], _broke("torch._C._are_functorch_transforms_active")
    assert seen["wrapped"], _broke("torch._C._functorch.is_functorch_wrapped_tensor")
    assert not _compat.functorch_transforms_active()
    assert not _compat.is_functorch_wrapped(torch.randn(4))


def test_tensors_of_finished_transforms_are_unwrapped():
    escaped = []
    torch.func.grad(lambda x: escaped.append(x) or x.sum())(torch.randn(3))
    plain = torch.randn(2)
    unwrapped = _compat.unwrap_finished_transforms((escaped[0], plain, 7))
    assert not _compat.is_functorch_wrapped(unwrapped[0]), _broke("torch._functorch.utils.unwrap_dead_wrappers")
    assert unwrapped[1] is plain and unwrapped[2] == 7


def test_traced_tensors_are_seen():
    with FakeTensorMode():
        fake = torch.empty(2, 3)
    assert _compat.is_traced(fake), _broke("torch._subclasses.FakeTensor")
    traced = torch.compile(lambda x: x + 1, backend=_record_traced, fullgraph=True)
    traced(torch.randn(2))
    assert _SEEN and all(_SEEN), _broke("torch._subclasses.functional_tensor.FunctionalTensor / FakeTensor")
    assert not _compat.is_traced(torch.randn(2)) and not _compat.is_traced(None)


_SEEN: list[bool] = []


def _record_traced(graph_module, example_inputs):
    from torch._functorch.aot_autograd import aot_module_simplified

    def compiler(gm, inputs):
        _SEEN.extend(_compat.is_traced(node.meta["val"]) for node in gm.graph.nodes
                     if node.op == "placeholder" and "val" in node.meta)
        return gm

    return aot_module_simplified(graph_module, example_inputs, fw_compiler=compiler)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_triton_allocator_is_read():
    import triton

    try:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
        assert _compat.triton_has_allocator(), (
            f"Triton {triton.__version__} changed triton.runtime._allocation, which flashbob._compat reads: "
            "adapt flashbob/_compat.py")
    finally:
        from triton.runtime import _allocation

        triton.set_allocator(_allocation.NullAllocator())
    assert not _compat.triton_has_allocator()
