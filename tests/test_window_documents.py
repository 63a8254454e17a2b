"""Sliding windows, packed documents and block masks (``window=``, ``document_ids=``, ``block_mask=``) in both
backends: every pass (forward, backward, the four BoB outputs, both tangents) against the float64 materialising
oracle with the equivalent dense mask, on random shapes and combinations of masks; gradcheck, gradgradcheck and forward AD through
flashbob.attention; and the checks of bad masks."""

import pytest
import torch

import flashbob
from flashbob import blocked, masks, reference
from tests.helpers import KERNEL_DEVICE, KERNEL_EXACT_DTYPE, needs_kernels

DEVICE, EXACT = KERNEL_DEVICE or "cpu", KERNEL_EXACT_DTYPE
TOLERANCE = 1e-10 if EXACT == torch.float64 else 1e-5


def backends():
    from flashbob import kernels

    return {"blocked": blocked, "triton": kernels}


def random_ids(gen, batch, length, documents, *, runs=True):
    """Document ids: sorted runs (packed sequences), or ids in any order (a document in several pieces)."""
    ids = torch.randint(0, documents, (batch, length), generator=gen)
    return ids.sort(-1).values if runs else ids


# (batch, heads, kv_heads, N, M, head_dim): ragged lengths, N != M, GQA
SHAPES = [(2, 4, 2, 45, 45, 16), (1, 2, 1, 33, 50, 16), (2, 2, 2, 50, 21, 32)]


def mask_cases(gen, batch, n, m):
    """Masks as keyword arguments of flashbob.attention, every kind and combinations of them."""
    from torch.nn.attention.flex_attention import create_block_mask

    self_attention = n == m
    runs = random_ids(gen, batch, n, 4) if self_attention else None
    return {
        "block_mask": dict(block_mask=create_block_mask(lambda b, h, i, j: (j < 2) | ((i - j).abs() <= 5), batch,
                                                        None, n, m, device="cpu", BLOCK_SIZE=(16, 8))),
        "block_mask_and_documents": dict(
            causal=True, document_ids=(random_ids(gen, batch, n, 3), random_ids(gen, batch, m, 3)),
            block_mask=create_block_mask(lambda b, h, i, j: (i + 2 * j) % 5 != 0, batch, None, n, m, device="cpu",
                                         BLOCK_SIZE=(32, 16))),
        "window": dict(window=(5, 3)),
        "causal_window": dict(causal=True, window=(7, None)),
        "window_zero": dict(window=(0, 0)),
        "window_wider_than_n": dict(window=(4 * n, 4 * m)),
        "left_only": dict(window=(None, 2)),
        "documents": dict(document_ids=(random_ids(gen, batch, n, 3), random_ids(gen, batch, m, 3))),
        "scattered_documents": dict(document_ids=(random_ids(gen, batch, n, 3, runs=False),
                                                  random_ids(gen, batch, m, 3, runs=False))),
        "one_token_documents": dict(document_ids=(torch.arange(n).expand(batch, n), torch.arange(m).expand(batch, m))),
        "documents_causal_window_keys": dict(
            causal=True, window=(6, 0), key_mask=torch.rand(batch, m, generator=gen) > 0.2,
            document_ids=runs if self_attention else (random_ids(gen, batch, n, 2), random_ids(gen, batch, m, 2))),
    }


def pass_options(kwargs, q, k):
    """flashbob.attention's mask arguments as a backend pass takes them."""
    document_ids = kwargs.get("document_ids")
    if isinstance(document_ids, torch.Tensor):
        document_ids = (document_ids, document_ids)
    q_ids, k_ids = document_ids if document_ids is not None else (None, None)
    tile_state, tile_bits = masks.block_tiles(kwargs.get("block_mask"), q, k)
    return dict(causal=kwargs.get("causal", False), window=kwargs.get("window"), key_mask=kwargs.get("key_mask"),
                q_ids=q_ids, k_ids=k_ids, tile_state=tile_state, tile_bits=tile_bits)


def oracle(t, dense, scale):
    """Every output in float64 by autograd through the materialised attention with the dense mask."""
    inputs = [t[name].double().requires_grad_() for name in ("q", "k", "v")]

    def attend(q, k, v):
        return reference.attention(q, k, v, scale=scale, attn_mask=dense)

    def gradients(q, k, v, do):
        return torch.func.vjp(attend, q, k, v)[1](do)

    o = attend(*inputs)
    grads = torch.autograd.grad(o, inputs, t["do"].double(), create_graph=True)
    bars = [t[name].double() for name in ("dq_bar", "dk_bar", "dv_bar")]
    do = t["do"].double().requires_grad_()
    grads_do = torch.autograd.grad(attend(*inputs), inputs, do, create_graph=True)
    second = torch.autograd.grad(grads_do, [*inputs, do], bars)
    primals = [t[name].double() for name in ("q", "k", "v")]
    tangents = [t[name].double() for name in ("q_dot", "k_dot", "v_dot")]
    o_dot = torch.func.jvp(attend, tuple(primals), tuple(tangents))[1]
    grads_dot = torch.func.jvp(gradients, (*primals, t["do"].double()), (*tangents, t["do_dot"].double()))[1]
    return {"o": o, "dq": grads[0], "dk": grads[1], "dv": grads[2], "q_bar": second[0], "k_bar": second[1],
            "v_bar": second[2], "do_bar": second[3], "o_dot": o_dot, "dq_dot": grads_dot[0],
            "dk_dot": grads_dot[1], "dv_dot": grads_dot[2]}


def every_pass(passes, t, options, scale):
    q, k, v, do = (t[name] for name in ("q", "k", "v", "do"))
    o, stats = passes.forward(q, k, v, scale=scale, **options)
    dq, dk, dv, delta = passes.backward(q, k, v, o, stats, do, scale=scale, **options)
    bob = passes.bob(q, k, v, do, o, stats, delta, t["dq_bar"], t["dk_bar"], t["dv_bar"], scale=scale, **options)
    tangents = [t[name] for name in ("q_dot", "k_dot", "v_dot")]
    o_dot, _ = passes.forward_jvp(q, k, v, o, stats, *tangents, scale=scale, **options)
    grads_dot = passes.backward_jvp(q, k, v, do, o, stats, delta, *tangents, t["do_dot"], scale=scale, **options)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv, "q_bar": bob[0], "k_bar": bob[1], "v_bar": bob[2],
            "do_bar": bob[3], "o_dot": o_dot, "dq_dot": grads_dot[0], "dk_dot": grads_dot[1],
            "dv_dot": grads_dot[2]}


@pytest.mark.parametrize(("backend", "shape"), [("blocked", 0), ("blocked", 1), ("blocked", 2),
                                               pytest.param("triton", 0, marks=needs_kernels)])
def test_every_pass_matches_the_dense_mask_oracle(gen, backend, shape):
    """Forward, backward, BoB and both tangents, for every mask and combination, equal the materialised
    attention with the same mask as a dense bool tensor (float64 autograd). Each case runs on one of the
    shapes, the cases cycling through them from shape ``shape`` on (the kernels, in Triton's interpreter, once)."""
    from flashbob.kernels import configs

    for index, case in enumerate(mask_cases(gen, 1, 1, 1)):
        batch, heads, kv_heads, n, m, head_dim = SHAPES[(shape + index) % len(SHAPES)]
        check_case(gen, backend, case, batch, heads, kv_heads, n, m, head_dim, configs)


def check_case(gen, backend, case, batch, heads, kv_heads, n, m, head_dim, configs):
    dtype, device = (EXACT, DEVICE) if backend == "triton" else (torch.float64, "cpu")
    rows = {"q": (heads, n), "do": (heads, n), "dq_bar": (heads, n), "q_dot": (heads, n), "do_dot": (heads, n)}
    names = ("q", "k", "v", "do", "dq_bar", "dk_bar", "dv_bar", "q_dot", "k_dot", "v_dot", "do_dot")
    t = {name: torch.randn(batch, *rows.get(name, (kv_heads, m)), head_dim, generator=gen, dtype=torch.float64)
         .to(device=device, dtype=dtype) for name in names}
    scale = head_dim ** -0.5
    kwargs = mask_cases(gen, batch, n, m)[case]
    kwargs = {key: value.to(device) if isinstance(value, torch.Tensor) or key == "block_mask" else
              tuple(x.to(device) for x in value) if key == "document_ids" else value
              for key, value in kwargs.items()}
    dense = masks.dense(n, m, device=device, **kwargs)
    expected = oracle(t, dense, scale)
    with configs.override(block_m=16, block_n=16):
        got = every_pass(backends()[backend], t, pass_options(kwargs, t["q"], t["k"]), scale)
    for name, value in expected.items():
        error = (got[name].double() - value).abs().max().item()
        scale_of = max(1.0, value.abs().max().item())
        assert error <= TOLERANCE * scale_of, f"{case} at {(batch, heads, kv_heads, n, m, head_dim)}: {name} off " \
                                              f"by {error:.3g}"


def test_a_query_that_sees_no_key_gets_zeros_not_nan(gen):
    """A window that leaves some queries without keys (N > M, window (0, 0)) and a document with no keys: zero
    output rows and zero gradients."""
    q = torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    q_ids = torch.tensor([[0] * 6 + [1] * 6])
    for kwargs in (dict(window=(0, 0)), dict(document_ids=(q_ids, torch.zeros(1, 6, dtype=torch.long)))):
        o = flashbob.attention(q, k, v, **kwargs)
        (dq,) = torch.autograd.grad(o.square().sum(), q)
        assert torch.isfinite(o).all() and torch.isfinite(dq).all()
        assert o[:, :, 6:].abs().max() == 0 and dq[:, :, 6:].abs().max() == 0


@pytest.mark.parametrize("backend", ["blocked", pytest.param("triton", marks=needs_kernels)])
def test_gradcheck_gradgradcheck_and_forward_ad(backend):
    """gradcheck and check_forward_ad through flashbob.attention with a window and documents, and gradgradcheck
    (blocked backend; in Triton's interpreter it takes a minute)."""
    gen = torch.Generator().manual_seed(0)
    device = DEVICE if backend == "triton" else "cpu"
    if backend == "triton" and EXACT != torch.float64:
        pytest.skip("gradcheck needs float64 through the kernels (the interpreter)")
    q, k, v = (torch.randn(1, 1, 7, 2, generator=gen, dtype=torch.float64).to(device).requires_grad_()
               for _ in range(3))
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2]], device=device)

    def attend(q, k, v):
        return flashbob.attention(q, k, v, window=(3, 1), document_ids=ids, backend=backend)

    assert torch.autograd.gradcheck(attend, (q, k, v), check_forward_ad=True)
    if backend == "blocked":  # through the kernels, every second derivative is checked against the oracle above
        assert torch.autograd.gradgradcheck(attend, (q, k, v))


def test_dense_mask_is_the_definition():
    """masks.dense against the definitions written out element by element."""
    n, m = 7, 9
    ids_q, ids_k = torch.tensor([[0, 0, 1, 1, 1, 2, 2]]), torch.tensor([[0, 1, 1, 0, 2, 2, 2, 1, 0]])
    dense = masks.dense(n, m, causal=True, window=(2, 5), document_ids=(ids_q, ids_k))[0, 0]
    expected = torch.tensor([[j <= i and i - 2 <= j and ids_q[0, i] == ids_k[0, j] for j in range(m)]
                             for i in range(n)])
    assert torch.equal(dense, expected)


def test_document_ranges_hull_and_whole_part():
    """Each query's hull of its document's keys, and the whole part: the hull where the document is one run."""
    ranges = masks.document_ranges(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 0, 1, 2, 1, 3, 3]]))
    # rows: lo, hi, whole_lo, whole_hi; document 1's keys (2 and 4) are two runs: no whole part
    assert ranges[0].tolist() == [[0, 2, 3, 5], [2, 5, 4, 7], [0, 2, 3, 5], [2, 2, 4, 7]]


def test_bad_masks_get_clear_errors():
    q = torch.randn(2, 2, 5, 4)
    kv = torch.randn(2, 2, 6, 4)
    cases = [
        (dict(window=(-1, 0)), ValueError, "window's left bound must be >= 0"),
        (dict(window=(1.5, 0)), TypeError, "window's left bound must be an int"),
        (dict(window=3), TypeError, "window must be a pair"),
        (dict(document_ids=torch.zeros(2, 5, dtype=torch.long)), ValueError, "N == M"),
        (dict(document_ids=(torch.zeros(2, 5), torch.zeros(2, 6))), TypeError, "integer tensor"),
        (dict(document_ids=(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long))), ValueError,
         r"k_ids must have shape \(batch, M\) = \(2, 6\)"),
        (dict(document_ids=[torch.zeros(2, 5, dtype=torch.long)]), TypeError, "document_ids must be"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            flashbob.attention(q, kv, kv, **kwargs)


# ----------------------------------------------------------------------------- FlexAttention block masks


def flex_mask_mods(gen, batch, n, m):
    """mask_mods of several kinds: sliding window, packed documents with causality, a per-head pattern, and
    global tokens plus a window."""
    documents = random_ids(gen, batch, max(n, m), 3)
    return {
        "sliding_window": (lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 20), None),
        "causal_documents": (lambda b, h, q, kv: (q >= kv) & (documents[b, q] == documents[b, kv]), None),
        "per_head": (lambda b, h, q, kv: (q + 3 * h) % 4 != kv % 3, "heads"),
        "global_tokens_and_window": (lambda b, h, q, kv: (kv < 2) | ((q - kv).abs() <= 5), None),
    }


@pytest.mark.parametrize("block_size", [(16, 16), (32, 8)])
def test_block_masks_match_flex_attention_and_the_dense_oracle(gen, block_size):
    """flashbob.flex_attention equals torch's flex_attention (forward; torch's has no CPU backward), and every
    derivative equals the materialising oracle with the dense mask of the mask_mod, for several mask_mods, a per-head
    mask, N != M and GQA."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    batch, heads, kv_heads, n, m, head_dim = 2, 4, 2, 70, 53, 16
    t = {name: torch.randn(batch, h, length, head_dim, generator=gen, dtype=torch.float64)
         for name, h, length in (("q", heads, n), ("k", kv_heads, m), ("v", kv_heads, m), ("do", heads, n))}
    for name, (mask_mod, per_head) in flex_mask_mods(gen, batch, n, m).items():
        block_mask = create_block_mask(mask_mod, batch, heads if per_head else None, n, m, device="cpu",
                                       BLOCK_SIZE=block_size)
        q, k, v = (t[x].clone().requires_grad_() for x in ("q", "k", "v"))
        out = flashbob.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        with torch.no_grad():
            torch_out = torch_flex_attention(t["q"], t["k"], t["v"], block_mask=block_mask, enable_gqa=True)
        torch.testing.assert_close(out, torch_out, rtol=1e-10, atol=1e-10, msg=name)
        dense = masks.dense(n, m, block_mask=block_mask)
        mask_mod_dense = create_mask(mask_mod, batch, heads if per_head else None, n, m, device="cpu")
        assert torch.equal(dense.expand(batch, -1, -1, -1), mask_mod_dense.expand(batch, dense.shape[1], -1, -1)), name
        expected = reference.attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=name)
        grads = torch.autograd.grad(out, (q, k, v), t["do"], create_graph=True)
        hvp = torch.autograd.grad(sum((g * g).sum() for g in grads), (q, k, v))
        grads_ref = torch.autograd.grad(expected, (q, k, v), t["do"], create_graph=True)
        hvp_ref = torch.autograd.grad(sum((g * g).sum() for g in grads_ref), (q, k, v))
        for got, want in zip((*grads, *hvp), (*grads_ref, *hvp_ref)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)
        tangents = tuple(torch.randn_like(x) for x in (q, k, v))
        o_dot = torch.func.jvp(lambda *x: flashbob.flex_attention(*x, block_mask=block_mask, enable_gqa=True),
                               (t["q"], t["k"], t["v"]), tangents)[1]
        o_dot_ref = torch.func.jvp(lambda *x: reference.attention(*x, attn_mask=dense), (t["q"], t["k"], t["v"]),
                                   tangents)[1]
        torch.testing.assert_close(o_dot, o_dot_ref, rtol=1e-10, atol=1e-10, msg=name)


def test_block_mask_tiles_hold_partial_tiles_only():
    """A sliding window of 64 over 4096 tokens in 128-tiles: the tiles' element-wise mask holds the partial
    (diagonal) tiles, ~2 per query tile, not N x M."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = 4096
    block_mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 64), None, None, n, n, device="cpu")
    q = torch.zeros(1, 1, n, 8)
    tile_state, tile_bits = masks.block_tiles(block_mask, q, q)
    assert tile_bits.numel() <= 2 * (n // 128) * 128 * 128 < n * n / 10
    assert tile_state.shape == (1, 1, n // 128, n // 128)


def test_bad_block_masks_and_flex_arguments_get_clear_errors():
    from torch.nn.attention.flex_attention import create_block_mask

    q = torch.randn(1, 2, 32, 8)
    k = torch.randn(1, 1, 32, 8)
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64, device="cpu")
    with pytest.raises(ValueError, match="Q_LEN = 64, KV_LEN = 64 but the inputs have N = 32"):
        flashbob.attention(q, k, k, block_mask=block_mask)
    with pytest.raises(TypeError, match="block_mask must be a torch.nn.attention.flex_attention.BlockMask"):
        flashbob.attention(q, k, k, block_mask=torch.ones(32, 32, dtype=torch.bool))
    small = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 32, 32, device="cpu")
    with pytest.raises(TypeError, match="takes no score_mod"):
        flashbob.flex_attention(q, k, k, score_mod=lambda score, b, h, q, kv: score, block_mask=small)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashbob.flex_attention(q, k, k, block_mask=small)
    per_head = create_block_mask(lambda b, h, q, kv: q >= kv + h, None, 2, 32, 32, device="cpu")
    with pytest.raises(ValueError, match="backend='triton' takes a block_mask that is the same for every head"):
        flashbob.attention(q, k, k, block_mask=per_head, backend="triton")


def test_patch_flex_attention_routes_torch_calls_without_score_mod(gen):
    """Inside the patch, torch's flex_attention (looked up on its module) runs flashbob's, which is differentiable
    twice; calls with a score_mod keep torch's function; the patch closes cleanly."""
    from torch.nn.attention import flex_attention as torch_flex
    from torch.nn.attention.flex_attention import create_block_mask

    original = torch_flex.flex_attention
    q, k, v = (torch.randn(1, 2, 24, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    block_mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 24, 24, device="cpu",
                                   BLOCK_SIZE=(8, 8))
    with flashbob.patch_flex_attention(backend="blocked"):
        out = torch_flex.flex_attention(q, k, v, block_mask=block_mask)
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        torch.autograd.grad(dq.sum(), (q, k, v))  # a second derivative: torch's flex_attention has none
        scored = torch_flex.flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block_mask,
                                           score_mod=lambda s, b, h, qi, kv: s * 2)  # torch's: no CPU backward
        assert scored.shape == out.shape
    assert torch_flex.flex_attention is original
    torch.testing.assert_close(out, reference.attention(q, k, v, causal=True), rtol=1e-10, atol=1e-10)
