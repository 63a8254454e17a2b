"""The forward-mode kernels (kernels.forward_jvp, kernels.backward_jvp) against a float64 oracle:
torch.func.jvp through the naive attention of flashbob.reference (and through its vjp for the backward)."""

import csv
import functools
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.environment import child_environment
from flashbob import kernels, reference
from flashbob.kernels import configs
from tests.helpers import assert_terms_match, relative_error

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # tests/conftest.py sets it
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
# float64 kernels do not compile for the GPU (Triton 3.6): there the exact tests run in float32.
EXACT = torch.float64 if DEVICE == "cpu" else torch.float32
CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="float64 kernels do not compile for the GPU (Triton 3.6)")
FP16_BAR = 1.5  # half precision: no worse than 1.5x eager PyTorch forward mode in the same dtype (measured ~0.5x)
PRIMALS = ("q", "k", "v", "do")
TANGENTS = ("q_dot", "k_dot", "v_dot", "do_dot")
OUTPUTS = ("o_dot", "dq_dot", "dk_dot", "dv_dot")

# (batch, heads, kv_heads, N, M, head_dim): N < M and N > M, lengths that are not multiples of the 16x16
# test tiles, GQA and MQA, one key, padded and the largest head dims.
SHAPES = [
    (1, 2, 2, 17, 33, 16),
    (1, 4, 2, 37, 17, 32),
    (1, 2, 1, 20, 1, 40),
    (1, 2, 1, 9, 20, 256),
]
shape_id = "B{}H{}Hkv{}N{}M{}d{}".format


@pytest.fixture
def small_tiles():
    """16x16 tiles, so that the small test shapes span several tiles and ragged tails."""
    with configs.override(block_m=16, block_n=16):
        yield


def make_inputs(gen, shape, dtype, *, layout="contiguous"):
    """Random primals and tangents; ``layout="transposed"`` gives (B, N, H, d) storage viewed as
    (B, H, N, d), ``"strided"`` a head_dim stride of 2."""
    batch, heads, kv_heads, n, m, head_dim = shape

    def randn(h, rows):
        x = torch.randn(batch, rows, h, 2 * head_dim, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
        x = x[..., ::2] if layout == "strided" else x[..., :head_dim]
        return (x.contiguous() if layout == "contiguous" else x).to(DEVICE)

    query_side = {"q", "do", "q_dot", "do_dot"}
    return {name: randn(*((heads, n) if name in query_side else (kv_heads, m))) for name in PRIMALS + TANGENTS}


def run_kernels(inputs, tangents, *, causal, scale, key_mask=None, given_forward_tangents=False):
    """``o_dot`` and ``(dq_dot, dk_dot, dv_dot)`` from the kernels, on the kernels' own forward and backward;
    ``given_forward_tangents``: backward_jvp takes forward_jvp's tangents of O and the statistics (as in
    forward-over-reverse) instead of its own row sweep."""
    q, k, v, do = (inputs[name] for name in PRIMALS)
    q_dot, k_dot, v_dot, do_dot = (inputs[name] if name in tangents else None for name in TANGENTS)
    flags = dict(causal=causal, scale=scale, key_mask=key_mask)
    o, stats = kernels.forward(q, k, v, **flags)
    *_, delta = kernels.backward(q, k, v, o, stats, do, **flags)
    o_dot, stats_dot = kernels.forward_jvp(q, k, v, o, stats, q_dot, k_dot, v_dot, **flags)
    given = {"o_dot": o_dot, "stats_dot": stats_dot} if given_forward_tangents else {}
    dots = kernels.backward_jvp(q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, **flags, **given)
    return dict(zip(OUTPUTS, (o_dot, *dots)))


def run_oracle(inputs, tangents, *, causal, scale, key_mask=None, dtype=torch.float64):
    """The same four tangents from torch.func.jvp through naive attention, computed in ``dtype``."""
    primals = tuple(inputs[name].to(dtype) for name in PRIMALS)
    dots = tuple(inputs[name].to(dtype) if name in tangents else torch.zeros_like(x)
                 for name, x in zip(TANGENTS, primals))
    attention = functools.partial(reference.attention, causal=causal, scale=scale, key_mask=key_mask)

    def backward(q, k, v, do):
        return torch.func.vjp(attention, q, k, v)[1](do)

    _, o_dot = torch.func.jvp(attention, primals[:3], dots[:3])
    _, grad_dots = torch.func.jvp(backward, primals, dots)
    return dict(zip(OUTPUTS, (o_dot, *grad_dots)))


def assert_matches_oracle(outputs, inputs, tangents, *, causal, scale, key_mask=None, tolerance):
    """Every tangent shaped and typed like its primal and within ``tolerance`` of the float64 oracle,
    relative to its norm. Tangents that vanish in exact arithmetic (dQ-dot and dK-dot with one key)
    are held to ``tolerance`` times the largest entry of any tangent, the size of the terms that cancel."""
    for name, like in zip(OUTPUTS, ("q", "q", "k", "v")):
        assert outputs[name].shape == inputs[like].shape and outputs[name].dtype == inputs[like].dtype, name
    assert_terms_match(outputs, run_oracle(inputs, tangents, causal=causal, scale=scale, key_mask=key_mask), tolerance)


def check(gen, shape, tangents, *, causal, dtype=EXACT, scale=None, layout="contiguous", key_mask=None):
    """Both schedules of backward_jvp (its own row sweep; forward_jvp's tangents) against the oracle."""
    inputs = make_inputs(gen, shape, dtype, layout=layout)
    scale = shape[-1] ** -0.5 if scale is None else scale
    for given in (False, True):
        outputs = run_kernels(inputs, tangents, causal=causal, scale=scale, key_mask=key_mask,
                              given_forward_tangents=given)
        assert_matches_oracle(outputs, inputs, tangents, causal=causal, scale=scale, key_mask=key_mask,
                              tolerance=TOLERANCE[dtype])
    return inputs, outputs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: shape_id(*s))
def test_all_tangents(gen, shape, causal, small_tiles):
    check(gen, shape, TANGENTS, causal=causal)


@pytest.mark.parametrize("tangent", TANGENTS)
def test_one_tangent(gen, tangent, small_tiles):
    """Each tangent alone: every other one's terms are compiled out."""
    _, outputs = check(gen, (1, 2, 1, 33, 21, 16), (tangent,), causal=True, scale=0.3)
    if tangent == "do_dot":
        assert not outputs["o_dot"].any(), "O does not depend on dO: forward_jvp returns zeros"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_random_tangent_subsets(gen, causal, small_tiles):
    """Two or three of the four tangents, drawn at random (the seed is printed), in float32."""
    subsets = [s for r in (2, 3) for s in itertools.combinations(TANGENTS, r)]
    tangents = subsets[torch.randint(len(subsets), (), generator=gen).item()]
    print(f"tangents: {tangents}")
    check(gen, (1, 2, 1, 19, 26, 16), tangents, causal=causal, scale=0.4, dtype=torch.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_mask_with_rows_that_see_no_key(gen, causal, small_tiles):
    """Batch element 1 keeps no key (all of its rows are empty); in batch element 0 key 0 is masked
    (causal: query 0 sees no key). Empty rows get 0 in every tangent, never NaN."""
    shape = (2, 1, 1, 21, 21, 16)
    key_mask = torch.rand(2, 21, generator=gen) > 0.3
    key_mask[0, 0], key_mask[0, 1], key_mask[1] = False, True, False
    key_mask = key_mask.to(DEVICE)
    _, outputs = check(gen, shape, TANGENTS, causal=causal, key_mask=key_mask)
    assert not outputs["o_dot"][1].any() and not outputs["dq_dot"][1].any()
    assert not outputs["dk_dot"][1].any() and not outputs["dv_dot"][1].any()
    if causal:
        assert not outputs["o_dot"][0, :, 0].any() and not outputs["dq_dot"][0, :, 0].any()


@pytest.mark.parametrize("layout,causal", [("transposed", False), ("strided", True)])
def test_non_contiguous_inputs(gen, layout, causal, small_tiles):
    inputs, _ = check(gen, (1, 4, 2, 19, 26, 32), TANGENTS, causal=causal, scale=0.2, layout=layout)
    assert not inputs["q"].is_contiguous() and not inputs["k_dot"].is_contiguous()


TMA_KERNELS = ("jvp_fwd", "jvp_rows", "jvp_dq", "jvp_cols")


@pytest.fixture
def tma_tiles():
    """The opt-in "tma" variant (tiles through tensor descriptors, whole key blocks of the row sweeps unmasked)
    with 16x16 tiles; the interpreter emulates tensor descriptors, so the variant itself runs, not its fallback."""
    with configs.override(block_m=16, block_n=16, variant="tma"):
        yield


def assert_tma_ran(inputs):
    config = configs.BlockConfig(16, 16, 4, 1, "tma")
    for kernel in TMA_KERNELS:
        assert configs.variant_for(kernel, config, tuple(inputs.values())) == "tma", kernel


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: shape_id(*s))
def test_tma_variant_all_tangents(gen, shape, causal, tma_tiles):
    """The "tma" variant of the four forward-mode kernels: odd N != M, GQA, every tangent."""
    inputs, _ = check(gen, shape, TANGENTS, causal=causal)
    assert_tma_ran(inputs)


def test_tma_variant_every_tangent_subset(gen, tma_tiles):
    """The "tma" variant with each of the 15 subsets of tangents (the absent ones' descriptors and terms are
    compiled out), causal, N != M."""
    subsets = [s for r in range(1, 5) for s in itertools.combinations(TANGENTS, r)]
    inputs = make_inputs(gen, (1, 1, 1, 19, 26, 16), EXACT)
    assert_tma_ran(inputs)
    for tangents, given in itertools.product(subsets, (False, True)):
        outputs = run_kernels(inputs, tangents, causal=True, scale=0.4, given_forward_tangents=given)
        assert_matches_oracle(outputs, inputs, tangents, causal=True, scale=0.4, tolerance=TOLERANCE[EXACT])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tma_variant_key_mask(gen, causal, tma_tiles):
    """The variant's unmasked whole key blocks still apply the key-padding mask; rows that see no key get 0."""
    key_mask = torch.rand(2, 37, generator=gen) > 0.4
    key_mask[1, :5] = False
    _, outputs = check(gen, (2, 2, 1, 37, 37, 16), TANGENTS, causal=causal, key_mask=key_mask.to(DEVICE))
    if causal:
        assert not outputs["o_dot"][1, :, :5].any() and not outputs["dq_dot"][1, :, :5].any()


def test_default_block_sizes(gen):
    """The block sizes of configs.choose, not the test tiles: several tiles at N = M = 70."""
    for kernel in ("jvp_fwd", "jvp_rows", "jvp_dq"):
        assert configs.choose(kernel, 64, EXACT).block_m < 70, kernel
    assert configs.choose("jvp_cols", 64, EXACT).block_n < 70
    check(gen, (1, 1, 1, 70, 70, 64), TANGENTS, causal=True, scale=0.125)


@pytest.mark.parametrize("given", [False, True], ids=["own-rows", "forward-tangents"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float16_no_worse_than_eager(gen, causal, given, small_tiles):
    """float16 kernels vs eager forward mode (torch.func.jvp through naive attention) in float16,
    both against float64; backward_jvp with its own row sweep and with forward_jvp's (rounded) tangents."""
    shape = (1, 2, 1, 37, 21, 32)
    scale = shape[-1] ** -0.5
    inputs = make_inputs(gen, shape, torch.float16)
    outputs = run_kernels(inputs, TANGENTS, causal=causal, scale=scale, given_forward_tangents=given)
    exact = run_oracle(inputs, TANGENTS, causal=causal, scale=scale)
    eager = run_oracle(inputs, TANGENTS, causal=causal, scale=scale, dtype=torch.float16)
    for name, ref in exact.items():
        assert outputs[name].dtype == torch.float16, name
        ours, theirs = relative_error(outputs[name], ref), relative_error(eager[name], ref)
        assert ours <= FP16_BAR * theirs, f"{name}: {ours:.2e} > {FP16_BAR} x eager {theirs:.2e}"


@pytest.mark.parametrize("given", [False, True], ids=["own-rows", "forward-tangents"])
def test_one_hot_rows_half_precision(gen, given, small_tiles):
    """Rows that see one key (batch element 1 keeps key 0 only) in float16: there O-dot is V-dot of that key
    and dQ-dot, dK-dot vanish, which eager float16 forward mode gets exactly. forward_jvp subtracts
    O times the sum of the rounded matmul operands P∘S-dot, so this cancels exactly too (with the
    float32 r-dot instead, O-dot was off by 3e-4); backward_jvp sums Delta-dot from P∘S-dot∘(dP - Delta) in
    float32, where dP - Delta vanishes on such rows (when it went through the rounded O-dot with the float32
    r-dot, dQ-dot and dK-dot were off by 2e-3 to 6e-3). Given forward_jvp's tangents, backward_jvp takes its
    r-dot, the sum of the rounded operands, which is consistent with O-dot, so Delta-dot cancels there too."""
    shape = (2, 1, 1, 24, 24, 32)
    key_mask = torch.rand(2, 24, generator=gen) > 0.3
    key_mask[:, 0], key_mask[1, 1:] = True, False
    key_mask = key_mask.to(DEVICE)
    inputs = make_inputs(gen, shape, torch.float16)
    flags = dict(causal=False, scale=shape[-1] ** -0.5, key_mask=key_mask)
    outputs = {name: x[1] for name, x in run_kernels(inputs, TANGENTS, given_forward_tangents=given, **flags).items()}
    exact = {name: x[1] for name, x in run_oracle(inputs, TANGENTS, **flags).items()}
    term_size = max(ref.abs().max().item() for ref in exact.values())
    assert relative_error(outputs["o_dot"], exact["o_dot"]) < 1e-6
    for name in ("dq_dot", "dk_dot"):
        assert exact[name].abs().max() < 1e-12, name
        assert outputs[name].double().abs().max() < 1e-4 * term_size, name


def test_without_tangents_returns_zeros_without_a_launch(gen, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(configs, "launch", no_launch)
    inputs = make_inputs(gen, (1, 2, 1, 5, 7, 16), EXACT)
    q, k, v, do = (inputs[name] for name in PRIMALS)
    o, stats, delta = torch.zeros_like(q), torch.zeros(1, 2, 2, 5), torch.zeros(1, 2, 5)
    o_dot, stats_dot = kernels.forward_jvp(q, k, v, o, stats, None, None, None, causal=True, scale=0.25)
    dots = kernels.backward_jvp(q, k, v, do, o, stats, delta, None, None, None, None, causal=True, scale=0.25)
    for x, like in zip((o_dot, stats_dot, *dots), (q, stats, q, k, v)):
        assert x.shape == like.shape and x.dtype == like.dtype and not x.any()


def test_rejects_misshapen_tangents(gen):
    inputs = make_inputs(gen, (1, 2, 1, 5, 7, 16), EXACT)
    q, k, v, do = (inputs[name] for name in PRIMALS)
    o, stats = kernels.forward(q, k, v, causal=False, scale=0.25)
    with pytest.raises(ValueError, match="k_dot"):
        kernels.forward_jvp(q, k, v, o, stats, None, q, None, causal=False, scale=0.25)
    with pytest.raises(ValueError, match="do_dot"):
        kernels.backward_jvp(q, k, v, do, o, stats, stats[:, :, 0], None, None, None, k, causal=False, scale=0.25)
    with pytest.raises(ValueError, match="stats"):
        kernels.forward_jvp(q, k, v, o, stats[:, :, 0], q, None, None, causal=False, scale=0.25)
    *_, delta = kernels.backward(q, k, v, o, stats, do, causal=False, scale=0.25)
    with pytest.raises(ValueError, match="o_dot and stats_dot"):
        kernels.backward_jvp(q, k, v, do, o, stats, delta, q, None, None, None, causal=False, scale=0.25, o_dot=o)
    with pytest.raises(ValueError, match="stats_dot"):
        kernels.backward_jvp(q, k, v, do, o, stats, delta, q, None, None, None, causal=False, scale=0.25, o_dot=o,
                             stats_dot=stats[:, :, 0])


@CPU_ONLY
def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_jvp_kernels.py runs in the interpreter at a tiny shape and its float32 accuracy passes."""
    times, accuracy = tmp_path / "times.csv", tmp_path / "accuracy.csv"
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_jvp_kernels.py", "--device", "cpu", "--lengths", "24", "--heads", "1",
         "--head-dim", "16", "--causal", "1", "--impls", "kernels", "--reps", "1", "--warmup", "0",
         "--dtypes", "fp32", "--out", str(times), "--accuracy-out", str(accuracy)],
        cwd=root, env=child_environment(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    timed = list(csv.DictReader(times.open()))
    assert [r["workload"] for r in timed] == ["forward", "backward", "forward_jvp", "backward_jvp", "backward_jvp_for"]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in timed)
    checked = list(csv.DictReader(accuracy.open()))
    assert [r["output"] for r in checked] == [*OUTPUTS, "dq_dot_for", "dk_dot_for", "dv_dot_for"]
    assert all(r["verdict"] == "PASS" and float(r["err_kernels"]) < 1e-5 for r in checked), checked
