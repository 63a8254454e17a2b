"""flashbob.sdpa against torch's SDPA, the exact fallback (warning once / strict mode), and
flashbob.patch_sdpa on unmodified models (nanoGPT-style attention, nn.TransformerEncoderLayer)."""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import flashbob
from flashbob import dropin
from flashbob.dropin import FallbackError, FallbackWarning, naive_attention

TORCH_SDPA = F.scaled_dot_product_attention
pytestmark = pytest.mark.usefixtures("fresh_fallback")  # no fallback warned about yet, strict mode reset


def qkv(gen, batch=2, heads=4, kv_heads=2, n=9, m=11, d=8, lead=()):
    shape = lambda h, length: (*lead, batch, h, length, d)  # noqa: E731
    return tuple(torch.randn(*s, generator=gen, dtype=torch.float64) for s in (shape(heads, n), shape(kv_heads, m),
                                                                             shape(kv_heads, m)))


def key_padding(gen, batch, m):
    mask = torch.rand(batch, m, generator=gen) > 0.4
    mask[:, 0] = True
    return mask


@pytest.mark.parametrize("case", ["none", "causal", "bool_keys", "bool_keys_causal", "causal_and_keys",
                                  "float_keys", "heads_keys"])
def test_fast_paths_match_torch_and_do_not_warn(gen, case):
    q, k, v = qkv(gen, m=9)
    keys = key_padding(gen, 2, 9)
    kwargs = {
        "none": {},
        "causal": dict(is_causal=True),
        "bool_keys": dict(attn_mask=keys[:, None, None, :]),
        "bool_keys_causal": dict(attn_mask=keys[:, None, None, :], is_causal=True),  # torch 2.13: AND
        "causal_and_keys": dict(attn_mask=torch.ones(9, 9, dtype=torch.bool).tril() & keys[:, None, None, :]),
        "float_keys": dict(attn_mask=torch.zeros(2, 1, 1, 9, dtype=torch.float64).masked_fill(
            ~keys[:, None, None, :], float("-inf"))),
        "heads_keys": dict(attn_mask=keys[:, None, None, :].expand(2, 4, 1, 9)),
    }[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        got = flashbob.sdpa(q, k, v, enable_gqa=True, **kwargs)
    want = TORCH_SDPA(q, k, v, enable_gqa=True, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(7, 8), (2, 7, 8), (3, 2, 2, 7, 8)])
def test_other_ranks(gen, shape):
    """(L, E), (B, L, E) and (..., B, H, L, E) inputs, as SDPA accepts them."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    for causal in (False, True):
        got = flashbob.sdpa(x, x, x, is_causal=causal)
        assert got.shape == x.shape
        torch.testing.assert_close(got, TORCH_SDPA(x, x, x, is_causal=causal), rtol=1e-12, atol=1e-12)


def test_dense_masks_fall_back_exactly_with_one_warning(gen):
    q, k, v = qkv(gen)
    dense = torch.rand(2, 1, 9, 11, generator=gen) > 0.3
    bias = torch.randn(9, 11, generator=gen, dtype=torch.float64)
    with pytest.warns(FallbackWarning, match="not a key-padding"):
        got = flashbob.sdpa(q, k, v, attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, attn_mask=dense, enable_gqa=True), rtol=1e-12, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # once per reason
        got = flashbob.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, attn_mask=bias, enable_gqa=True), rtol=1e-12, atol=1e-12)


def test_dropout_falls_back_and_strict_mode_raises(gen):
    q, k, v = qkv(gen, heads=2)
    with pytest.warns(FallbackWarning, match="dropout"):
        out = flashbob.sdpa(q, k, v, dropout_p=0.5)
    assert out.shape == q.shape
    flashbob.set_strict(True)
    with pytest.raises(FallbackError, match="strict"):
        flashbob.sdpa(q, k, v, dropout_p=0.5)
    flashbob.sdpa(q, k, v)  # the fast path is unaffected


def test_strict_mode_from_the_environment(gen, monkeypatch):
    q, k, v = qkv(gen, heads=2)
    monkeypatch.setenv("FLASHBOB_STRICT", "1")
    with pytest.raises(FallbackError):
        flashbob.sdpa(q, k, v, attn_mask=torch.randn(9, 11, dtype=torch.float64))


def test_gqa_checks(gen):
    q, k, v = qkv(gen, heads=4, kv_heads=2)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        flashbob.sdpa(q, k, v)
    q3, k3, v3 = qkv(gen, heads=3, kv_heads=2)
    with pytest.raises(RuntimeError, match="divide"):
        flashbob.sdpa(q3, k3, v3, enable_gqa=True)


@pytest.mark.parametrize(
    "shapes",
    [((2, 4, 9, 8), (2, 1, 11, 8)), ((4, 9, 8), (1, 11, 8)), ((2, 4, 9, 8), (11, 8)),
     ((2, 1, 9, 8), (2, 4, 11, 8)), ((1, 9, 8), (3, 11, 8)), ((9, 8), (3, 11, 8)), ((9, 8), (2, 3, 11, 8))],
)
def test_one_head_broadcasts_without_enable_gqa_as_in_torch(gen, shapes):
    """SDPA broadcasts a single kv head over the query's heads without enable_gqa (multi-query attention written
    as broadcasting), and a single query head over the key's heads; flashbob.sdpa raised 'pass enable_gqa=True'
    for them, so such a model broke under patch_sdpa."""
    q = torch.randn(*shapes[0], generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(*shapes[1], generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    keys = key_padding(gen, 1, 11)[0]
    for kwargs in ({}, dict(is_causal=True), dict(attn_mask=keys)):
        got = flashbob.sdpa(q, k, v, **kwargs)
        want = TORCH_SDPA(q, k, v, **kwargs)
        assert got.shape == want.shape  # a 2-d query against 3-d keys gave (0, 9, 8) for (3, 9, 8)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        grads = [torch.autograd.grad(out.sin().sum(), (q, k, v)) for out in (got, want)]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_one_query_head_against_a_per_head_mask_as_in_torch(gen):
    q = torch.randn(2, 1, 9, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 11, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(2, 4, 9, 11, generator=gen) > 0.3
    keep[..., 0] = True
    for mask in (keep, torch.randn(2, 4, 9, 11, generator=gen, dtype=torch.float64)):
        torch.testing.assert_close(flashbob.sdpa(q, k, v, attn_mask=mask), TORCH_SDPA(q, k, v, attn_mask=mask))
    with pytest.raises(RuntimeError, match="must divide"):  # torch refuses it too
        flashbob.sdpa(q, k, v, enable_gqa=True)


def test_autocast_casts_the_arguments_as_torch_does(gen):
    """Under autocast SDPA runs in the autocast dtype (a float32 query with bfloat16 keys included); flashbob.sdpa
    returned float32 (and refused the mixed dtypes)."""
    q, k, v = (x.float() for x in qkv(gen, kv_heads=4))
    for keys in (k, k.bfloat16()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = flashbob.sdpa(q, keys, v, is_causal=True), TORCH_SDPA(q, keys, v, is_causal=True)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_an_empty_head_dim_averages_the_values_as_torch_does(gen):
    q, k = (torch.randn(2, 3, 5, 0, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(flashbob.sdpa(q, k, v), TORCH_SDPA(q, k, v), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_fallback_computes_half_precision_in_float32_as_torch_does(gen, dtype):
    """An additive bias takes the fallback; in float16/bfloat16 it computed scores, softmax and P V in that dtype,
    with 1.7x torch's error against float64. Compared as the norm of the error (computed in float32 as torch does,
    it is at most 0.99x torch's over 200 seeds); the largest element's error, compared before, differs from
    torch's by one rounding of the output."""
    q, k, v = qkv(gen, kv_heads=4, n=33, m=33, d=16)
    bias = torch.randn(2, 4, 33, 33, generator=gen, dtype=torch.float64)
    exact = TORCH_SDPA(q, k, v, attn_mask=bias)
    low = [x.to(dtype) for x in (q, k, v, bias)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = flashbob.sdpa(*low[:3], attn_mask=low[3])
    want = TORCH_SDPA(*low[:3], attn_mask=low[3])
    assert got.dtype == dtype
    assert (got.double() - exact).norm() <= 1.1 * (want.double() - exact).norm()


def test_fully_masked_rows_are_zero_with_zero_gradients(gen):
    q, k, v = (x.requires_grad_() for x in qkv(gen, heads=2, kv_heads=2))
    keys = key_padding(gen, 2, 11)
    keys[1] = False
    out = flashbob.sdpa(q, k, v, attn_mask=keys[:, None, None, :])
    assert (out[1] == 0).all()
    grads = torch.autograd.grad(out.sin().sum(), (q, k, v), create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v))
    for g in (*grads, *second):
        assert torch.isfinite(g).all() and (g[1] == 0).all()


def test_double_backward_through_sdpa_matches_naive(gen):
    q, k, v = (x.requires_grad_() for x in qkv(gen))
    keys = key_padding(gen, 2, 11)

    def hvp(fn):
        out = fn(q, k, v, attn_mask=keys[:, None, None, :], enable_gqa=True)
        grads = torch.autograd.grad(out.sin().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum((g * g.detach()).sum() for g in grads), (q, k, v))

    for a, b in zip(hvp(flashbob.sdpa), hvp(naive_attention)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@contextlib.contextmanager
def naive_sdpa():
    """The exact oracle for models: F.scaled_dot_product_attention replaced by naive attention."""
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = naive_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


def backends_used(monkeypatch) -> list:
    """The ``backend`` of every :func:`flashbob.dropin.sdpa` call a patched F.scaled_dot_product_attention makes."""
    calls, real = [], dropin.sdpa

    def recorded(*args, backend, **kwargs):
        calls.append(backend)
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(dropin, "sdpa", recorded)
    return calls


def test_patch_sdpa_restores_nests_and_decorates(gen, monkeypatch):
    calls = backends_used(monkeypatch)
    q = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64)

    def attend():
        return F.scaled_dot_product_attention(q, q, q)

    assert F.scaled_dot_product_attention is TORCH_SDPA
    with flashbob.patch_sdpa() as outer:
        attend()
        with flashbob.patch_sdpa(backend="blocked"):
            attend()
        attend()
        assert outer.backend == "auto"
    assert F.scaled_dot_product_attention is TORCH_SDPA and calls == ["auto", "blocked", "auto"]
    with pytest.raises(ValueError, match="boom"), flashbob.patch_sdpa():
        raise ValueError("boom")
    assert F.scaled_dot_product_attention is TORCH_SDPA

    @flashbob.patch_sdpa()
    def inside():
        return F.scaled_dot_product_attention is not TORCH_SDPA

    assert inside() and F.scaled_dot_product_attention is TORCH_SDPA
    # backends that run on any machine's CPU tensors ("triton" needs CUDA or the interpreter)
    first, second = flashbob.patch_sdpa(backend="blocked"), flashbob.patch_sdpa(backend="auto")
    first.__enter__()
    second.__enter__()
    try:
        first.__exit__(None, None, None)  # closed out of order: the other one still holds, with its own backend
        calls.clear()
        attend()
    finally:  # a failure here must not leave F.scaled_dot_product_attention patched for the tests after it
        second.__exit__(None, None, None)
    assert calls == ["auto"] and F.scaled_dot_product_attention is TORCH_SDPA


def test_patch_sdpa_refuses_an_unknown_backend_and_a_close_without_an_open():
    with pytest.raises(ValueError, match="backend must be"):
        flashbob.patch_sdpa(backend="bogus")  # at construction, not at the first attention call
    patch = flashbob.patch_sdpa()
    with pytest.raises(RuntimeError, match="not open in this thread"):
        patch.__exit__(None, None, None)
    with patch:
        pass
    with pytest.raises(RuntimeError, match="not open in this thread"):
        patch.__exit__(None, None, None)  # closed twice
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_patch_sdpa_holds_per_thread_and_the_last_one_out_restores(gen, monkeypatch):
    """Two threads whose patches overlap (A opens, B opens, A closes, B closes): B stayed patched until it closed,
    a thread without a patch kept torch's function all along, and torch's is back at the end. Before, A's exit
    put torch's back under B, and B's exit put A's patch back for good."""
    import threading

    calls = backends_used(monkeypatch)
    q = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64)
    expected = TORCH_SDPA(q, q, q)
    a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with flashbob.patch_sdpa(backend="blocked"):
            a_open.set()
            b_open.wait()
        a_closed.set()

    def thread_b():
        a_open.wait()
        with flashbob.patch_sdpa(backend="auto"):
            b_open.set()
            a_closed.wait()
            seen["b"] = F.scaled_dot_product_attention(q, q, q)

    def outsider():
        b_open.wait()
        seen["outsider"] = F.scaled_dot_product_attention(q, q, q)

    threads = [threading.Thread(target=f) for f in (thread_a, thread_b, outsider)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["auto"], calls  # B after A closed went through flashbob; the outsider did not
    torch.testing.assert_close(seen["b"], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(seen["outsider"], expected, rtol=0, atol=0)
    assert F.scaled_dot_product_attention is TORCH_SDPA


class NanoGPTAttention(torch.nn.Module):
    """nanoGPT's CausalSelfAttention, verbatim in structure: calls F.scaled_dot_product_attention."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


def model_hvp(model, x, loss_fn):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_fn(model, x), params, create_graph=True)
    vec = [torch.ones_like(p) for p in params]
    return torch.cat([h.reshape(-1) for h in torch.autograd.grad(grads, params, vec)])


def test_patch_gives_nanogpt_double_backward(gen):
    torch.manual_seed(0)
    model = NanoGPTAttention().double()
    x = torch.randn(2, 10, 16, generator=gen, dtype=torch.float64)
    loss = lambda m, x: m(x).tanh().sum()  # noqa: E731
    with flashbob.patch_sdpa():
        got = model_hvp(model, x, loss)
    with naive_sdpa():
        want = model_hvp(model, x, loss)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("padded", [False, True])
def test_patch_gives_transformer_encoder_layer_double_backward(gen, padded, monkeypatch):
    """TransformerEncoderLayer (training mode, so its fast path is off and MHA calls
    F.scaled_dot_product_attention; dropout 0); key_padding_mask arrives as a float -inf mask per head."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).double()
    x = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True  # True = ignore (nn.MultiheadAttention's convention)
    kwargs = dict(src_key_padding_mask=padding) if padded else {}
    loss = lambda m, x: m(x, **kwargs).tanh().sum()  # noqa: E731
    calls = []
    attention = dropin.attention
    monkeypatch.setattr(dropin, "attention", lambda *a, **kw: calls.append(kw["key_mask"]) or attention(*a, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with flashbob.patch_sdpa():
            got = model_hvp(layer, x, loss)
    assert calls and all((mask is not None) == padded for mask in calls)  # ran on flashbob, padding as a key mask
    with naive_sdpa():
        want = model_hvp(layer, x, loss)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
