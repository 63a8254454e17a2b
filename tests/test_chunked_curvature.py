"""The cross-entropy curvature a chunk of rows at a time: CrossEntropyHessian (and the GGN products built on
it) and SophiaG's label sampling give what one chunk gives, and hold only a chunk's temporaries besides
their output (peak memory measured by the profiler's CPU allocator records)."""

from __future__ import annotations

import gzip
import json
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import hessian
from torch.profiler import ProfilerActivity, profile

from optim import CrossEntropyHessian, GGNOperator, SophiaG

DTYPE = torch.float64
EXACT = {"rtol": 1e-12, "atol": 1e-14}
ONE_CHUNK = 2**40
FLOAT32 = 4  # bytes


def lm_logits(gen: torch.Generator, shape=(3, 7, 5)) -> tuple[Tensor, Tensor, Tensor]:
    """Logits ``(B, T, V)`` with an odd T, a tangent and targets with three ignored rows (one of them NaN)."""
    logits = torch.randn(shape, generator=gen, dtype=DTYPE)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    targets.view(-1)[[0, 8, 13]] = -100
    logits.view(-1, shape[-1])[13] = torch.nan  # an ignored row: never reaches the result
    return logits, torch.randn(shape, generator=gen, dtype=DTYPE), targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_hessian_chunks_give_the_one_chunk_product_and_the_dense_hessian(gen, reduction):
    """Chunks of 1, 2 (across the batch boundary: 7 rows per sequence) and 4 rows, and one chunk."""
    logits, u, targets = lm_logits(gen)
    one_chunk = CrossEntropyHessian(targets, reduction, chunk_elements=ONE_CHUNK)(logits, u)
    counted = (targets != -100).reshape(-1)
    clean = torch.where(counted.view(3, 7, 1), logits, 0.0)
    loss = lambda z: F.cross_entropy(z.flatten(0, -2), targets.flatten(), reduction=reduction)  # noqa: E731
    dense = hessian(loss)(clean).reshape(logits.numel(), -1) @ u.reshape(-1)
    torch.testing.assert_close(one_chunk, dense.view_as(u), rtol=1e-10, atol=1e-12)
    assert not one_chunk.view(-1, 5)[~counted].any()
    for chunk_elements in (1, 10, 23):
        chunked = CrossEntropyHessian(targets, reduction, chunk_elements=chunk_elements)(logits, u)
        torch.testing.assert_close(chunked, one_chunk, **EXACT)
        overwritten = u.clone()
        hessian_ = CrossEntropyHessian(targets, reduction, chunk_elements=chunk_elements)
        assert hessian_(logits, overwritten, out=overwritten) is overwritten
        torch.testing.assert_close(overwritten, one_chunk, **EXACT)


def test_cross_entropy_hessian_takes_flattened_targets_and_rejects_bad_arguments(gen):
    logits, u, targets = lm_logits(gen)
    flat_targets = CrossEntropyHessian(targets.flatten())(logits, u)
    torch.testing.assert_close(flat_targets, CrossEntropyHessian(targets)(logits, u), **EXACT)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match=f"chunk_elements must be a positive integer .*, got {bad!r}"):
            CrossEntropyHessian(targets, chunk_elements=bad)
    with pytest.raises(ValueError, match=r"CrossEntropyHessian: 20 targets for the 21 rows of the logits \(3, 7, 5\)"):
        CrossEntropyHessian(targets.flatten()[:20])(logits, u)
    with pytest.raises(ValueError, match=r"targets \(7, 3\) do not line up with the logits \(3, 7, 5\): expected them "
                                         r"shaped \(3, 7\), or flattened"):
        CrossEntropyHessian(targets.T)(logits, u)  # as many targets as rows, transposed: rows would get wrong targets
    rows = CrossEntropyHessian(targets)(logits.flatten(0, 1), u.flatten(0, 1))  # (B*T, V) logits, (B, T) targets
    torch.testing.assert_close(rows, flat_targets.flatten(0, 1), **EXACT)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float64 tensor of shape \(3, 7, 5\), got "
                                         r"torch.float64 \(3, 5, 7\) \(not contiguous\)"):
        CrossEntropyHessian(targets)(logits, u, out=torch.empty(3, 7, 5, dtype=DTYPE).transpose(1, 2))


def test_ggn_product_leaves_a_tangent_that_aliases_vec_alone(gen):
    """Outputs that are a parameter's view: J v is a view of ``vec``, which the product must not overwrite."""
    logits, _, targets = lm_logits(gen)
    weight = nn.Parameter(logits.nan_to_num().reshape(21, 5))
    op = GGNOperator(weight.view(3, 7, 5), [weight], CrossEntropyHessian(targets, chunk_elements=5))
    vec = torch.randn(21, 5, generator=gen, dtype=DTYPE)
    kept = vec.clone()
    (product,) = op.matvec([vec])
    assert torch.equal(vec, kept)
    expected = CrossEntropyHessian(targets)(weight.detach().view(3, 7, 5), kept.view(3, 7, 5))
    torch.testing.assert_close(product, expected.view(21, 5), **EXACT)


def sophia_g_run(chunk_elements: int, gen_seed: int) -> tuple[Tensor, Tensor]:
    """Parameters and Hessian estimate after three refresh steps of SophiaG on a linear LM head, float64."""
    torch.manual_seed(gen_seed)
    head = nn.Linear(6, 5, dtype=DTYPE)
    hidden = torch.randn(3, 7, 6, dtype=DTYPE)
    targets = torch.randint(0, 5, (3, 7))
    targets.view(-1)[[0, 8, 13]] = -100
    opt = SophiaG(head.parameters(), lr=1e-2, update_period=1, chunk_elements=chunk_elements,
                  generator=torch.Generator().manual_seed(gen_seed))

    def closure():
        logits = head(hidden)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten()), "outputs": logits,
                "targets": targets}

    for _ in range(3):
        opt.step(closure)
    params = torch.cat([p.detach().reshape(-1) for p in head.parameters()])
    return params, torch.cat([opt.state[p]["hessian"].reshape(-1) for p in head.parameters()])


def test_sophia_g_chunked_label_sampling_gives_the_one_chunk_steps(gen):
    """On the CPU the sampled labels do not depend on the chunk size, so neither do the steps."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    params, estimate = sophia_g_run(ONE_CHUNK, seed)
    assert estimate.any()
    for chunk_elements in (1, 12):
        chunked_params, chunked_estimate = sophia_g_run(chunk_elements, seed)
        torch.testing.assert_close(chunked_params, params, **EXACT)
        torch.testing.assert_close(chunked_estimate, estimate, **EXACT)
    with pytest.raises(ValueError, match="SophiaG: invalid chunk_elements: 0; expected an integer >= 1"):
        SophiaG(nn.Linear(2, 2).parameters(), chunk_elements=0)


# --- Peak memory -------------------------------------------------------------------------------------
# Float32 logits (R, V) = (2 * 255, 1024), 2 MiB, in chunks of 1/16 of them. On the CPU a bfloat16
# matrix product allocates float32 temporaries of its own, which would blur what is measured here.

SHAPE, CHUNK = (2, 255, 1024), 2 * 255 * 1024 // 16
LOGITS_BYTES, CHUNK_BYTES = 2 * 255 * 1024 * FLOAT32, CHUNK * FLOAT32


@pytest.fixture
def peak_bytes(tmp_path) -> Callable[[Callable[[], object]], int]:
    """``measure(fn)``: the peak of the bytes that ``fn()`` (its result included) holds at once through torch's
    CPU allocator, beyond what was held before: the running sum of the allocations and frees that the
    profiler's memory timeline records."""

    def measure(fn: Callable[[], object]) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            fn()
        path = tmp_path / "memory.raw.json.gz"
        with warnings.catch_warnings():  # deprecated in favour of CUDA-only tools; its CPU records are what we need
            warnings.simplefilter("ignore")
            prof.export_memory_timeline(str(path), device="cpu")
        held = peak = 0
        for _time, action, size, _category in json.loads(gzip.decompress(path.read_bytes())):
            if action in (2, 4):  # allocated, freed (a negative size); 1: held before, 3: written in place
                held += size
                peak = max(peak, held)
        return peak

    return measure


def lm_head(chunk_elements: int, gen: torch.Generator) -> tuple[GGNOperator, Tensor, Tensor, Tensor, Tensor]:
    """A linear LM head over fixed hidden states, its GGN operator, a direction, the logits, targets and hidden
    states."""
    hidden = torch.randn(*SHAPE[:2], 32, generator=gen)
    weight = nn.Parameter(torch.randn(32, SHAPE[-1], generator=gen) / 8)
    targets = torch.randint(0, SHAPE[-1], SHAPE[:2], generator=gen)
    targets[0, :5] = -100
    logits = hidden @ weight
    op = GGNOperator(logits, [weight], CrossEntropyHessian(targets, chunk_elements=chunk_elements))
    return op, torch.randn(weight.shape, generator=gen), logits, targets, hidden


def test_cross_entropy_hessian_holds_its_output_and_a_chunk(gen, peak_bytes):
    logits, u = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    targets = torch.randint(0, SHAPE[-1], SHAPE[:2], generator=gen)
    whole = peak_bytes(lambda: CrossEntropyHessian(targets, chunk_elements=ONE_CHUNK)(logits, u))
    chunked = peak_bytes(lambda: CrossEntropyHessian(targets, chunk_elements=CHUNK)(logits, u))
    assert whole >= 2.5 * LOGITS_BYTES, whole / LOGITS_BYTES  # output, softmax and (u - p.u) of every row
    assert chunked <= LOGITS_BYTES + 5 * CHUNK_BYTES, chunked / LOGITS_BYTES


def test_ggn_product_holds_one_tensor_the_size_of_the_logits(gen, peak_bytes):
    """J v is overwritten by H_L J v: besides the parameter-sized result, one logits-sized tensor and a chunk."""
    op, vec, *_ = lm_head(CHUNK, gen)
    chunked = peak_bytes(lambda: op.matvec([vec]))
    assert chunked <= LOGITS_BYTES + 5 * CHUNK_BYTES + 2 * vec.numel() * FLOAT32, chunked / LOGITS_BYTES
    op.loss_hessian = CrossEntropyHessian(op.loss_hessian.targets, chunk_elements=ONE_CHUNK)
    whole = peak_bytes(lambda: op.matvec([vec]))
    assert whole >= 2.5 * LOGITS_BYTES, whole / LOGITS_BYTES


def test_forward_mode_ggn_product_with_lean_tangents_holds_the_logits_and_one_tangent(gen, peak_bytes):
    """Forward mode recomputes the logits in its J v. PyTorch's matrix-product rule holds them four times (value,
    two terms, their sum); lean_tangents writes the head's tangent into one buffer: the value and one tangent,
    which H_L J v then overwrites. Both products equal reverse mode's."""
    op, vec, logits, _, hidden = lm_head(CHUNK, gen)
    peaks = {}
    for lean in (False, True):
        forward = GGNOperator(lambda values: hidden @ values[0], op.params, op.loss_hessian, mode="forward",
                              evaluated=logits, lean_tangents=lean)  # fmt: skip
        peaks[lean] = peak_bytes(lambda: forward.matvec([vec]))  # noqa: B023
        torch.testing.assert_close(forward.matvec([vec]), op.matvec([vec]), rtol=1e-5, atol=1e-7)
    assert peaks[True] <= 2 * LOGITS_BYTES + 5 * CHUNK_BYTES + 2 * vec.numel() * FLOAT32, peaks[True] / LOGITS_BYTES
    assert peaks[False] >= 3.5 * LOGITS_BYTES, peaks[False] / LOGITS_BYTES


def test_sophia_g_refresh_holds_one_tensor_the_size_of_the_logits(gen, peak_bytes):
    """The sampled loss's gradient w.r.t. the logits, a chunk's temporaries and parameter-sized tensors."""
    op, _, logits, targets, _ = lm_head(CHUNK, gen)
    weight = op.params[0]
    peaks = {}
    for chunk_elements in (CHUNK, ONE_CHUNK):
        opt = SophiaG([weight], chunk_elements=chunk_elements, generator=torch.Generator().manual_seed(0))
        peaks[chunk_elements] = peak_bytes(lambda: opt.update_hessian(logits, targets))  # noqa: B023
    parameter_sized = 6 * weight.numel() * FLOAT32
    assert peaks[CHUNK] <= LOGITS_BYTES + 5 * CHUNK_BYTES + parameter_sized, peaks[CHUNK] / LOGITS_BYTES
    assert peaks[ONE_CHUNK] >= 2 * LOGITS_BYTES, peaks[ONE_CHUNK] / LOGITS_BYTES
