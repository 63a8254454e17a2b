"""Every output of the Triton kernels against the float64 autograd oracle in flashbob.reference."""

import itertools

import pytest
import torch

import flashbob
from flashbob import blocked, kernels, reference
from flashbob.kernels import configs
from tests.helpers import (
    KERNEL_DEVICE,
    KERNEL_EXACT_DTYPE,
    assert_matches,
    assert_terms_match,
    needs_gpu,
    needs_interpreter,
    needs_kernels,
    relative_error,
)

pytestmark = needs_kernels
DEVICE = KERNEL_DEVICE
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
# The interpreter runs float64 kernels, which Triton 3.6 cannot compile for the H200: on a GPU the
# tests of exactness run in float32 (no TF32) against the same float64 oracle.
EXACT = KERNEL_EXACT_DTYPE
CPU_ONLY = needs_interpreter
FP16_BAR = 1.5  # half precision: no worse than 1.5x eager PyTorch autograd in the same dtype
FORWARD, BACKWARD, BOB = ("o", "lse"), ("dq", "dk", "dv", "delta"), ("q_bar", "k_bar", "v_bar", "do_bar")
COTANGENTS = ("dq_bar", "dk_bar", "dv_bar")

# (batch, heads, kv_heads, N, M, head_dim): N < M and N > M, lengths that are not multiples of the
# 16x16 test tiles, single rows/keys, GQA and MQA, padded and large head dims.
SHAPES = [
    (1, 2, 2, 17, 33, 16),
    (2, 4, 2, 45, 17, 32),
    (1, 4, 1, 1, 45, 64),
    (1, 2, 1, 20, 1, 40),
    (1, 2, 2, 64, 64, 40),
    (1, 1, 1, 20, 13, 128),
    (1, 2, 1, 9, 20, 256),
]


@pytest.fixture
def small_tiles():
    """16x16 tiles, so that the small test shapes span several tiles and ragged tails."""
    with configs.override(block_m=16, block_n=16):
        yield


def make_inputs(gen, shape, dtype, *, layout="contiguous"):
    """Random q, k, v, do and cotangents; ``layout="transposed"`` gives (B, N, H, d) storage viewed
    as (B, H, N, d), ``"strided"`` a head_dim stride of 2."""
    batch, heads, kv_heads, n, m, head_dim = shape

    def randn(h, rows):
        x = torch.randn(batch, rows, h, 2 * head_dim, generator=gen, dtype=torch.float64).to(dtype)
        x = x.transpose(1, 2)
        x = x[..., ::2] if layout == "strided" else x[..., :head_dim]
        return x.contiguous() if layout == "contiguous" else x

    names = ("q", "k", "v", "do", *COTANGENTS)
    rows = {"q": (heads, n), "do": (heads, n), "dq_bar": (heads, n)}
    return {name: randn(*rows.get(name, (kv_heads, m))).to(DEVICE) for name in names}


def run_kernels(inputs, cotangents, *, causal, scale, key_mask=None):
    """All ten outputs of forward, backward and BoB, chained as the autograd wiring chains them."""
    q, k, v, do = (inputs[name] for name in ("q", "k", "v", "do"))
    flags = {"causal": causal, "scale": scale, "key_mask": key_mask}
    o, stats = kernels.forward(q, k, v, **flags)
    dq, dk, dv, delta = kernels.backward(q, k, v, o, stats, do, **flags)
    bars = [inputs[name] if name in cotangents else None for name in COTANGENTS]
    outs = kernels.bob(q, k, v, do, o, stats, delta, *bars, **flags)
    assert stats.shape == (*q.shape[:2], 2, q.shape[2]), "stats must be (B, H, 2, N)"
    return dict(zip(FORWARD + BACKWARD + BOB, (o, kernels.logsumexp(stats), dq, dk, dv, delta, *outs)))


def run_reference(inputs, cotangents, *, causal, scale, dtype=torch.float64, key_mask=None):
    """The same ten outputs from the naive autograd oracle, computed in ``dtype``."""
    q, k, v, do = (inputs[name].to(dtype) for name in ("q", "k", "v", "do"))
    flags = {"causal": causal, "scale": scale, "key_mask": key_mask}
    o = reference.attention(q, k, v, **flags)
    lse = reference.log_sum_exp(q, k, **flags)
    dq, dk, dv = reference.attention_backward(q, k, v, do, **flags)
    bars = [inputs[name].to(dtype) if name in cotangents else None for name in COTANGENTS]
    outs = reference.backward_over_backward(q, k, v, do, *bars, **flags)
    values = (o, lse, dq, dk, dv, (do * o).sum(-1), *outs)
    return dict(zip(FORWARD + BACKWARD + BOB, values))


def check_layout(outputs, inputs):
    """Outputs are shaped like their inputs, in the input dtype; row statistics in the accumulator dtype."""
    dtype = inputs["q"].dtype
    like = {"o": "q", "dq": "q", "q_bar": "q", "do_bar": "q", "dk": "k", "k_bar": "k", "dv": "v", "v_bar": "v"}
    for name, source in like.items():
        assert outputs[name].shape == inputs[source].shape and outputs[name].dtype == dtype, name
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name in ("lse", "delta"):
        assert outputs[name].shape == inputs["q"].shape[:3] and outputs[name].dtype == stat_dtype, name


def assert_matches_reference(outputs, inputs, cotangents, *, causal, scale, tolerance):
    """Every output within ``tolerance`` of the float64 oracle, relative to the output's norm.

    References that are exactly zero in exact arithmetic (dQ and dK when each query sees a single
    key, V̄ without dq_bar and dk_bar, ...) are detected by their size and held to ``tolerance`` times
    the largest entry of any output: they are sums of terms of that size that cancel, so their
    rounding scales with it (float32 K̄ with one key reached 1.08e-5 against outputs of ~20).
    """
    check_layout(outputs, inputs)
    compared = assert_terms_match(outputs, run_reference(inputs, cotangents, causal=causal, scale=scale), tolerance)
    assert {"o", "lse", "dv", "delta"} <= set(compared), "degenerate inputs: nothing was compared"


def assert_no_worse_than_eager(outputs, inputs, cotangents, *, causal, scale):
    """Half precision: every output's error against the float64 oracle is at most ``FP16_BAR``
    times that of eager autograd through naive attention in the same dtype (the project's bar)."""
    check_layout(outputs, inputs)
    exact = run_reference(inputs, cotangents, causal=causal, scale=scale)
    eager = run_reference(inputs, cotangents, causal=causal, scale=scale, dtype=inputs["q"].dtype)
    for name, ref in exact.items():
        ours, theirs = relative_error(outputs[name], ref), relative_error(eager[name], ref)
        assert ours <= FP16_BAR * theirs, f"{name}: {ours:.2e} > {FP16_BAR} x eager {theirs:.2e}"


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, marks=CPU_ONLY), torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}N{}M{}d{}".format(*s))
def test_all_outputs(gen, shape, causal, dtype, small_tiles):
    inputs = make_inputs(gen, shape, dtype)
    scale = shape[-1] ** -0.5
    outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=scale)
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=causal, scale=scale, tolerance=TOLERANCE[dtype])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_hot_rows_half_precision(gen, causal, small_tiles):
    """Rows that see one key (key-padding mask) in float16: BoB's Q̄ and dŌ vanish or nearly so there,
    and the kernels form G_S and G_dP in float32 before rounding, so without cancellation: at most
    eager's error. Forming them as r1 - A r2 - C r3 and r4 - A O (differences of rounded terms, as an
    earlier schedule did) gave 1.3x eager here (3.6x and 3.9x in bf16 on the H200)."""
    batch, heads, n, d = 2, 2, 40, 32
    t = {name: torch.randn(batch, heads, n, d, generator=gen, dtype=torch.float64) for name in
         ("q", "k", "v", "do", *COTANGENTS)}
    key_mask = torch.rand(batch, n, generator=gen) > 0.3
    key_mask[:, 0] = True
    key_mask[1, 1:] = False  # batch element 1: every row sees key 0 only
    t, key_mask = {name: x.to(DEVICE) for name, x in t.items()}, key_mask.to(DEVICE)
    flags = {"causal": causal, "scale": d ** -0.5, "key_mask": key_mask}

    def bob_outputs(x, backend):
        o, stats = backend.forward(x["q"], x["k"], x["v"], **flags)
        *_, delta = backend.backward(x["q"], x["k"], x["v"], o, stats, x["do"], **flags)
        q_bar, _, _, do_bar = backend.bob(x["q"], x["k"], x["v"], x["do"], o, stats, delta,
                                          *(x[name] for name in COTANGENTS), **flags)
        return q_bar.double(), do_bar.double()

    half = {name: x.half() for name, x in t.items()}
    exact = bob_outputs(t, blocked)
    eager = [torch.zeros_like(x) for x in exact]
    for b in range(batch):  # eager float16 autograd through naive attention, one batch element at a time
        sub = {name: x[b:b + 1].to(DEVICE) for name, x in half.items()}
        outs = reference.backward_over_backward(
            sub["q"], sub["k"], sub["v"], sub["do"], *(sub[name] for name in COTANGENTS), causal=causal,
            scale=d ** -0.5, key_mask=key_mask[b:b + 1])
        eager[0][b], eager[1][b] = outs[0][0].double(), outs[3][0].double()
    ours = bob_outputs(half, kernels)
    for name, a, e, r in zip(("q_bar", "do_bar"), ours, eager, exact):
        assert relative_error(a, r) <= relative_error(e, r), f"{name}: {relative_error(a, r):.2e} > eager"


SUBSETS = [s for r in range(1, 4) for s in itertools.combinations(COTANGENTS, r)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cotangents", SUBSETS, ids="+".join)
def test_bob_cotangent_subsets(gen, cotangents, causal, small_tiles):
    shape = (1, 4, 2, 33, 21, 32)
    inputs = make_inputs(gen, shape, EXACT)
    outputs = run_kernels(inputs, cotangents, causal=causal, scale=0.3)
    assert_matches_reference(outputs, inputs, cotangents, causal=causal, scale=0.3, tolerance=TOLERANCE[EXACT])
    if "dq_bar" not in cotangents and "dk_bar" not in cotangents:
        assert not outputs["v_bar"].any(), "without dual scores A-bar, V-bar is exactly zero"


def test_bob_without_cotangents_returns_zeros(gen):
    inputs = make_inputs(gen, (1, 2, 1, 5, 7, 16), EXACT)
    outputs = run_kernels(inputs, (), causal=True, scale=0.25)
    for name, like in zip(BOB, ("q", "k", "v", "do")):
        assert outputs[name].shape == inputs[like].shape and not outputs[name].any()


def test_key_mask_placeholder_is_made_once_and_never_written(gen):
    """Without a key mask every launch gets the same one-byte placeholder per device (no allocation per call),
    and the kernels, which never read it, leave it zero."""
    from flashbob.kernels import common

    inputs = make_inputs(gen, (1, 1, 1, 5, 7, 16), EXACT)
    placeholder, has_key_mask = common.key_mask_operand(None, inputs["q"], inputs["k"])
    run_kernels(inputs, COTANGENTS, causal=False, scale=0.25)
    again, _ = common.key_mask_operand(None, inputs["q"], inputs["k"])
    assert not has_key_mask and again is placeholder
    assert placeholder.dtype == torch.uint8 and placeholder.tolist() == [0]


@pytest.mark.parametrize("mask", [[[0.5, 1.0, 1.0]], [[256, 1, 1]], [[1, 1, 1]]], ids=["float", "int64", "uint8"])
def test_key_mask_of_another_dtype_is_refused(gen, mask):
    """The kernels take a bool key mask (as flashbob.attention and the blocked backend): a cast of another dtype
    to uint8 read 0.5 and 256 as 0, masking keys that are truthy, and gave a wrong output without an error."""
    inputs = make_inputs(gen, (1, 1, 1, 4, 3, 16), EXACT)
    key_mask = torch.tensor(mask, dtype=torch.uint8 if mask == [[1, 1, 1]] else None, device=DEVICE)
    with pytest.raises(TypeError, match="key_mask must be a bool tensor"):
        kernels.forward(inputs["q"], inputs["k"], inputs["v"], causal=False, scale=0.3, key_mask=key_mask)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_non_contiguous_inputs(gen, layout, causal, small_tiles):
    shape = (2, 4, 2, 19, 26, 32)
    inputs = make_inputs(gen, shape, EXACT, layout=layout)
    assert not inputs["q"].is_contiguous()
    outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=0.2)
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=causal, scale=0.2, tolerance=TOLERANCE[EXACT])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4], SHAPES[5]], ids=lambda s: "N{}M{}d{}".format(*s[3:]))
def test_float16_no_worse_than_eager(gen, shape, causal, small_tiles):
    """float16 kernels vs eager autograd through naive attention in float16, both against float64."""
    inputs = make_inputs(gen, shape, torch.float16)
    scale = shape[-1] ** -0.5
    outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=scale)
    assert_no_worse_than_eager(outputs, inputs, COTANGENTS, causal=causal, scale=scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [EXACT, torch.float16], ids=str)
def test_default_block_sizes(gen, dtype, causal):
    """The block sizes of configs.choose, not the test tiles: several tiles at N = M = 70."""
    shape = (1, 2, 1, 70, 70, 64)
    inputs = make_inputs(gen, shape, dtype)
    # (in half precision the 128-row defaults of bob_scalars and bob_do_bar cover N = 70 in one tile)
    assert configs.choose("bob_q_bar", 64, dtype).block_m < 70
    assert configs.choose("bob_cols", 64, dtype).block_n < 70
    outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=0.125)
    if dtype == EXACT:
        assert_matches_reference(outputs, inputs, COTANGENTS, causal=causal, scale=0.125, tolerance=TOLERANCE[EXACT])
    else:
        assert_no_worse_than_eager(outputs, inputs, COTANGENTS, causal=causal, scale=0.125)


def test_rejects_bad_shapes():
    q, k = torch.zeros(1, 3, 4, 300), torch.zeros(1, 3, 4, 300)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.forward(q, k, k, causal=False, scale=1.0)
    q, k = torch.zeros(1, 3, 4, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="q's 3 heads must be a multiple of k's and v's 2 heads"):
        kernels.forward(q, k, k, causal=False, scale=1.0)


def test_config_override_is_scoped():
    before = configs.choose("forward", 64, torch.float16)
    with configs.override(block_m=16, block_n=16):
        assert configs.choose("forward", 64, torch.float16).block_m == 16
    assert configs.choose("forward", 64, torch.float16) == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernels_run_on_the_operands_gpu(gen, causal):
    """Operands on cuda:1 while cuda:0 is current: Triton launches on the current device, so the launcher makes
    the operands' one current; all ten outputs match the oracle and stay on cuda:1, cuda:0 stays current."""
    inputs = {name: x.to("cuda:1") for name, x in make_inputs(gen, (1, 4, 2, 45, 33, 64), EXACT).items()}
    with torch.cuda.device(0):
        outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=0.125)
        assert torch.cuda.current_device() == 0
    assert all(x.device == torch.device("cuda:1") for x in outputs.values())
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=causal, scale=0.125, tolerance=TOLERANCE[EXACT])


@needs_gpu
def test_cuda_graph_capture_and_replay(gen):
    """Forward and backward captured in a CUDA graph (the "tma" kernels allocate their descriptors' scratch memory
    at each launch): replays on new inputs copied into the captured tensors give what eager calls give."""
    shape = (1, 4, 333, 64)
    q, k, v, do = (torch.randn(shape, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step():
        o = flashbob.attention(q, k, v, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and picks the configurations outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        with torch.no_grad():
            for x in (q, k, v, do):
                x.copy_(torch.randn(shape, generator=gen).to(x))
        graph.replay()
        replayed = [x.clone() for x in captured]
        for ours, eager in zip(replayed, step(), strict=True):
            torch.testing.assert_close(ours, eager, rtol=0, atol=0)


@pytest.mark.parametrize("block_m,block_n", [(16, 64), (64, 16)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rectangular_tiles(gen, block_m, block_n, causal):
    """Autotuning picks block_m != block_n: the causal split and ragged tails must hold for those too."""
    inputs = make_inputs(gen, (1, 2, 1, 45, 37, 32), EXACT)
    with configs.override(block_m=block_m, block_n=block_n):
        outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=0.2)
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=causal, scale=0.2, tolerance=TOLERANCE[EXACT])


TMA_KERNELS = tuple(kernel for kernel in configs.KERNELS if "tma" in configs.VARIANTS[kernel])
DEFAULT_TMA = ("forward", "dq", "dkdv", "bob_scalars", "bob_q_bar", "bob_do_bar")


def tma_runs(inputs) -> bool:
    """Whether the "tma" variant runs (rather than falls back) for these inputs, in every kernel that has it."""
    config = configs.BlockConfig(16, 16, 4, 1, "tma")
    return all(configs.variant_for(kernel, config, tuple(inputs.values())) == "tma" for kernel in TMA_KERNELS)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,tiles", [((1, 2, 2, 17, 33, 16), (16, 16)), ((2, 4, 2, 45, 17, 40), (16, 32)),
                                         ((1, 2, 1, 40, 40, 32), (32, 16))],
                         ids=["N17M33", "gqa-N45M17-d40", "N40-rect"])
@pytest.mark.parametrize("variant", ["base", "tma"])
def test_each_variant_matches_reference(gen, shape, tiles, causal, variant):
    """Both code paths of forward, dQ, dK/dV and BoB's four sweeps against the float64 oracle, whichever is a
    kernel's default: the base one, and "tma" (tiles through tensor descriptors, whole key blocks of the row
    kernels unmasked): odd N != M, GQA, padded head_dim, rectangular tiles. The interpreter emulates tensor
    descriptors, so the "tma" variant itself runs here, not its fallback."""
    inputs = make_inputs(gen, shape, EXACT)
    assert tma_runs(inputs), "the variant would fall back: this test would not test it"
    scale = shape[-1] ** -0.5
    with configs.override(block_m=tiles[0], block_n=tiles[1], variant=variant):
        outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=scale)
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=causal, scale=scale, tolerance=TOLERANCE[EXACT])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", ["base", "tma"])
def test_each_variant_with_key_mask(gen, causal, variant):
    """The key-padding mask in both code paths (the "tma" variant's unmasked whole key blocks still apply it):
    batch element 1 masks its first five keys, so that with the causal mask its first rows see no key and get
    zeros."""
    shape = (2, 2, 1, 37, 37, 16)
    inputs = make_inputs(gen, shape, EXACT)
    key_mask = torch.rand(2, 37, generator=gen) > 0.4
    key_mask[1, :5] = False
    key_mask = key_mask.to(DEVICE)
    with configs.override(block_m=16, block_n=16, variant=variant):
        outputs = run_kernels(inputs, COTANGENTS, causal=causal, scale=0.25, key_mask=key_mask)
    refs = run_reference(inputs, COTANGENTS, causal=causal, scale=0.25, key_mask=key_mask)
    refs.pop("lse")  # +inf in the rows that see no key
    assert_terms_match(outputs, refs, TOLERANCE[EXACT])
    if causal:
        assert not outputs["q_bar"][1, :, :5].any() and not outputs["do_bar"][1, :, :5].any()


@pytest.mark.parametrize("cotangents", [("dq_bar",), ("dk_bar",), ("dv_bar",)], ids="+".join)
def test_tma_variant_bob_cotangent_subsets(gen, cotangents):
    """BoB's "tma" variant with one cotangent: the absent ones' descriptors and terms are compiled out."""
    inputs = make_inputs(gen, (1, 4, 2, 33, 21, 32), EXACT)
    with configs.override(block_m=16, block_n=16, variant="tma"):
        outputs = run_kernels(inputs, cotangents, causal=True, scale=0.3)
    assert_matches_reference(outputs, inputs, cotangents, causal=True, scale=0.3, tolerance=TOLERANCE[EXACT])


def test_kernel_variant_environment_switch(gen, monkeypatch):
    """FLASHBOB_KERNEL_VARIANT=tma runs the variant in every kernel that has it (the others run their base code),
    whatever the configuration says, and the results still match the oracle; override(variant=...) wins; a name
    that is no variant is an error naming the setting."""
    ran = []
    variant_for = configs.variant_for

    def recorded(kernel, config, descriptors):
        ran.append((kernel, variant_for(kernel, config, descriptors)))
        return ran[-1][1]

    monkeypatch.setattr(configs, "variant_for", recorded)
    inputs = make_inputs(gen, (1, 2, 1, 21, 18, 16), EXACT)
    monkeypatch.delenv("FLASHBOB_KERNEL_VARIANT", raising=False)
    with configs.override(block_m=16, block_n=16):  # unset: each kernel's default
        run_kernels(inputs, COTANGENTS, causal=True, scale=0.25)
    assert {kernel for kernel, variant in ran if variant == "tma"} == set(DEFAULT_TMA)
    ran.clear()
    monkeypatch.setenv("FLASHBOB_KERNEL_VARIANT", "tma")
    with configs.override(block_m=16, block_n=16):
        outputs = run_kernels(inputs, COTANGENTS, causal=True, scale=0.25)
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=True, scale=0.25, tolerance=TOLERANCE[EXACT])
    assert {kernel for kernel, _ in ran} >= {"forward", "dq", "dkdv", "bob_cols"}
    assert all(variant == ("tma" if kernel in TMA_KERNELS else "base") for kernel, variant in ran)
    ran.clear()
    with configs.override(block_m=16, block_n=16, variant="base"):
        run_kernels(inputs, COTANGENTS, causal=True, scale=0.25)
    assert ran and all(variant == "base" for _, variant in ran)
    monkeypatch.setenv("FLASHBOB_KERNEL_VARIANT", "wgmma")
    with pytest.raises(ValueError, match=r"^FLASHBOB_KERNEL_VARIANT must be one of base, tma or unset; got 'wgmma'$"):
        run_kernels(inputs, COTANGENTS, causal=True, scale=0.25)


class GpuOperand:
    """What descriptors_usable reads of a contiguous (1, 2, 64, 64) bf16 operand on cuda:0, on any machine."""

    device = torch.device("cuda", 0)

    def stride(self, dim=None):
        strides = (8192, 4096, 64, 1)
        return strides if dim is None else strides[dim]

    def data_ptr(self):
        return 1 << 20

    def element_size(self):
        return 2


@pytest.mark.parametrize("capability,hip,usable", [((9, 0), None, True), ((10, 0), None, True),
                                                   ((8, 0), None, False), ((9, 4), "6.2", False)],
                         ids=["hopper", "blackwell", "ampere", "rocm-mi300"])
def test_descriptors_only_on_nvidia_hopper_and_later(monkeypatch, capability, hip, usable):
    """Tensor descriptors on an NVIDIA GPU of compute capability 9 or more; on an older one, and on ROCm (whose
    MI300 torch reports as capability 9.4), the "tma" variant falls back to the base code."""
    monkeypatch.setattr(configs, "_compute_capability", lambda index: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert configs.descriptors_usable((GpuOperand(),)) is usable


def test_tma_variant_falls_back_to_the_base_code(gen, monkeypatch):
    """Where tensor descriptors cannot address the operands (rows not a multiple of 16 bytes apart, a start
    that is not 16-byte aligned, a CPU tensor outside the interpreter) or the kernel has no such variant, the
    launch runs the base code with the same tiles, and the outputs are still right."""
    config = configs.BlockConfig(16, 16, 4, 1, "tma")
    inputs = make_inputs(gen, (1, 2, 1, 19, 23, 20), torch.float16)  # 20 halves = 40 bytes a row
    operands = tuple(inputs[name] for name in ("q", "k", "v", "do"))
    assert configs.variant_for("forward", config, operands) == "base"
    aligned = make_inputs(gen, (1, 2, 1, 19, 23, 16), EXACT)
    operands = tuple(aligned[name] for name in ("q", "k", "v", "do"))
    shifted = torch.empty(aligned["q"].numel() + 1, dtype=EXACT, device=DEVICE)[1:].view_as(aligned["q"])
    assert configs.variant_for("dq", config, operands) == "tma"
    assert configs.variant_for("bob_cols", config, (shifted, *operands[1:])) == "base"
    assert configs.variant_for("delta", config, operands) == "base"
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert configs.variant_for("forward", config, operands) == "base"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    padded = make_inputs(gen, (1, 2, 1, 19, 23, 21), EXACT)  # rows 21 floats apart: not a multiple of 16 bytes
    inputs = {name: x[..., :20] for name, x in padded.items()}
    assert not tma_runs(inputs)
    with configs.override(block_m=16, block_n=16, variant="tma"):
        outputs = run_kernels(inputs, COTANGENTS, causal=True, scale=0.3)
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=True, scale=0.3, tolerance=TOLERANCE[EXACT])


def test_rows_expanded_to_stride_zero_run_the_base_code_and_stay_exact(gen):
    """A matrix expanded along its rows (row stride 0, as an expanded tangent or cotangent can be) is not given to
    a tensor descriptor, whose strides must be positive; expanded batch and head axes (they only move its start)
    still are. Both give the outputs of the same values made contiguous."""
    config = configs.BlockConfig(16, 16, 4, 1, "tma")
    inputs = make_inputs(gen, (2, 2, 1, 19, 23, 16), EXACT)
    contiguous = configs.variant_for("dq", config, (inputs["q"], inputs["k"], inputs["v"]))
    inputs["do"] = inputs["do"][:, :, :1].expand_as(inputs["do"])  # row stride 0
    inputs["v"] = inputs["v"][:1].expand_as(inputs["v"])  # batch stride 0
    assert configs.variant_for("dq", config, (inputs["q"], inputs["k"], inputs["v"])) == contiguous
    assert configs.variant_for("dq", config, (inputs["q"], inputs["k"], inputs["do"])) == "base"
    with configs.override(block_m=16, block_n=16, variant="tma"):
        outputs = run_kernels(inputs, COTANGENTS, causal=True, scale=0.3)
    assert_matches_reference(outputs, inputs, COTANGENTS, causal=True, scale=0.3, tolerance=TOLERANCE[EXACT])


def test_backward_is_two_launches_and_returns_delta(gen, monkeypatch):
    """The first-order backward launches dQ (which also writes delta = rowsum(dO ∘ O)) and then dK/dV, no delta
    kernel of its own; its delta is the float64 row dot product, in the accumulator dtype."""
    launched = []
    launch = configs.launch
    monkeypatch.setattr(configs, "launch", lambda name, *a, **kw: launched.append(name) or launch(name, *a, **kw))
    inputs = make_inputs(gen, (2, 4, 2, 19, 23, 16), EXACT)
    q, k, v, do = (inputs[name] for name in ("q", "k", "v", "do"))
    o, stats = kernels.forward(q, k, v, causal=True, scale=0.3)
    launched.clear()
    with configs.override(block_m=16, block_n=16):
        *_, delta = kernels.backward(q, k, v, o, stats, do, causal=True, scale=0.3)
    assert launched == ["dq", "dkdv"]
    assert delta.dtype == stats.dtype and delta.shape == q.shape[:3]
    assert_matches(delta, (do.double() * o.double()).sum(-1), TOLERANCE[EXACT], "delta")


def test_default_variants():
    """Candidates name no variant (they run the kernel's default); "tma" is the default of the first-order kernels
    and BoB's row sweeps, "base" of the rest; an unknown variant name is an error."""
    for kernel in configs.KERNELS:
        assert all(c.variant is None for c in configs.candidates(kernel, 64, torch.bfloat16, 4096)), kernel
    assert {kernel for kernel in configs.KERNELS if configs.VARIANTS[kernel][0] == "tma"} == set(DEFAULT_TMA)
    assert configs.VARIANTS["forward"] == ("tma", "base") and configs.VARIANTS["bob_cols"] == ("base", "tma")
    assert configs.VARIANTS["delta"] == ("base",)
    with pytest.raises(ValueError, match="unknown variant 'tmaa'"):
        with configs.override(variant="tmaa"):
            pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128, 256])
def test_autotune_spaces_are_pruned_not_empty(dtype, head_dim):
    for kernel in configs.KERNELS:
        space = configs.candidates(kernel, head_dim, dtype, 4096)
        assert space, kernel
        assert configs.choose(kernel, head_dim, dtype, 4096) == space[0]
        assert len(space) == 1 or all(configs.fits(kernel, c, head_dim, dtype) for c in space), kernel
        # tl.dot needs 16 along every dimension (a 16 x 8 float32 config broke autotuning on the H200)
        assert kernel == "delta" or all(min(c.block_m, c.block_n) >= 16 for c in space), kernel
    assert not configs.fits("bob_q_bar", configs.BlockConfig(128, 128, 4, 3), 256, dtype)
    short = configs.candidates("forward", head_dim, dtype, 20)
    assert all(min(c.block_m, c.block_n) <= 32 for c in short)


def test_autotune_switches(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "1")
    assert configs.autotune_enabled()
    with configs.override(block_m=16):
        assert not configs.autotune_enabled()
    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "0")
    assert not configs.autotune_enabled()
    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not configs.autotune_enabled()


def test_launch_falls_back_when_the_compiler_rejects_a_config(monkeypatch):
    """The fit estimate is rough: a config that runs out of shared memory gives way to the next one."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "0")
    tried = []

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **constants):
                tried.append((BLOCK_M, BLOCK_N, num_warps, num_stages))
                if len(tried) == 1:
                    raise OutOfResources(262144, 232448, "shared memory")
            return run

    configs.launch("bob_q_bar", Kernel(), (1,), head_dim=256, dtype=torch.float16, length=4096, HEAD_DIM=256)
    space = configs.candidates("bob_q_bar", 256, torch.float16, 4096)
    assert [configs.BlockConfig(*t) for t in tried] == list(space[:2])
