"""flashbob.sdpa's argument checks (before any path is chosen) and the masks that must take the exact
path: integer padding masks raise, a learnable bias (even all zeros) gets its exact first and second
derivatives, also under torch.func and forward mode; dropout_p and an oversized scale raise naming the
argument; strict mode's error is one sentence."""

import math
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashbob
from flashbob import dropin
from flashbob.dropin import FallbackError, FallbackWarning
from tests.helpers import BACKENDS, assert_matches, exact_tolerance, on_backend

TORCH_SDPA = F.scaled_dot_product_attention
pytestmark = pytest.mark.usefixtures("fresh_fallback")  # no fallback warned about yet, strict mode reset


def qkv(gen, batch=2, heads=2, kv_heads=1, n=5, m=7, d=4):
    """Float64 query, key, value with odd N != M and grouped-query heads."""
    shapes = ((batch, heads, n, d), (batch, kv_heads, m, d), (batch, kv_heads, m, d))
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)


def torch_math_sdpa(*args, **kwargs):
    """torch's SDPA on its math backend: exact and twice differentiable in float64."""
    with sdpa_kernel(SDPBackend.MATH):
        return TORCH_SDPA(*args, **kwargs)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- mask dtypes


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float16])
def test_mask_of_another_dtype_raises_like_torch(gen, dtype):
    """A 0/1 integer padding mask (Hugging Face's attention_mask) was added to the scores as a bias."""
    q, k, v = qkv(gen)
    mask = torch.ones(2, 1, 1, 7, dtype=dtype)
    mask[1, ..., 4:] = 0
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        TORCH_SDPA(q, k, v, attn_mask=mask, enable_gqa=True)
    with pytest.raises(TypeError, match=r"attn_mask must be a bool mask .* pass attn_mask\.bool\(\)"):
        flashbob.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)


def test_bool_float32_and_query_dtype_masks_are_accepted_as_in_torch(gen):
    q, k, v = qkv(gen)
    keys = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keys[1, ..., 4:] = False
    want = TORCH_SDPA(q, k, v, attn_mask=keys, enable_gqa=True)
    for mask in (keys, torch.zeros(keys.shape).masked_fill(~keys, -math.inf), keys.double().log()):
        close(flashbob.sdpa(q, k, v, attn_mask=mask, enable_gqa=True), want)


@pytest.mark.parametrize("causal", [False, True])
def test_float_mask_that_hides_every_key_of_a_query_gives_zero_like_torch(gen, causal):
    """A float bias with finite values elsewhere and -inf on every key a query sees (its whole row, or with
    is_causal the first key, the only one query 0 sees): that query's output and gradients are 0 as in torch's
    SDPA (they were NaN, and NaN gradients for every key and value); other rows are exact."""
    q, k, v = qkv(gen, n=5, m=7)
    bias = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    if causal:
        bias[:, 0] = -math.inf
    else:
        bias[2] = -math.inf
    leaves = [(q, k, v), tuple(x.clone() for x in (q, k, v))]
    for inputs in leaves:
        for x in inputs:
            x.requires_grad_()
    cotangent = torch.randn(2, 2, 5, 4, generator=gen, dtype=torch.float64)
    outputs = []
    causal_bias = bias.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(), -math.inf)  # torch's is_causal
    for fn, inputs in zip((torch_math_sdpa, flashbob.sdpa), leaves):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            if fn is torch_math_sdpa:  # torch refuses a mask with is_causal: the causal mask folded into the bias
                out = fn(*inputs, attn_mask=causal_bias if causal else bias, enable_gqa=True)
            else:
                out = fn(*inputs, attn_mask=bias, is_causal=causal, enable_gqa=True)
        outputs.append([out, *torch.autograd.grad((out * cotangent).sum(), inputs)])
    empty = 0 if causal else 2
    assert not outputs[1][0][..., empty, :].any()
    for got, want in zip(outputs[1], outputs[0]):
        assert torch.isfinite(got).all()
        close(got, want)


# ----------------------------------------------------------------------------- learnable biases


def all_derivatives(fn, q, k, v, bias, cotangents):
    """Output, first derivatives w.r.t. q, k, v, bias, and the second derivatives w.r.t. q and bias of
    a random contraction of the first ones (the double-backward path), from fresh leaves."""
    q, k, v, bias = (x.detach().clone().requires_grad_() for x in (q, k, v, bias))
    out = fn(q, k, v, attn_mask=bias, enable_gqa=True)
    first = torch.autograd.grad((out * cotangents[0]).sum(), (q, k, v, bias), create_graph=True)
    second = torch.autograd.grad(sum((g * c).sum() for g, c in zip(first, cotangents[1:])), (q, bias))
    return [out.detach(), *(g.detach() for g in first), *second]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_learnable_bias_gets_exact_first_and_second_derivatives(gen, backend):
    """A zero-initialised bias that requires grad looked like a key-padding mask of all True, so the
    output did not depend on it (no gradient: it never trained under patch_sdpa)."""
    q, k, v = qkv(gen)
    bias = torch.zeros(2, 1, 5, 7, dtype=torch.float64)
    cotangents = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (q, q, k, v, bias)]
    with pytest.warns(FallbackWarning, match="requires grad"), flashbob.patch_sdpa(backend=backend):
        got = all_derivatives(F.scaled_dot_product_attention, q, k, v, bias, cotangents)
    want = all_derivatives(torch_math_sdpa, q, k, v, bias, cotangents)
    assert want[4].abs().max() > 1e-3  # the bias gradient the old code lost is far from zero
    for a, b in zip(got, want):
        close(a, b)
    with warnings.catch_warnings():  # the same mask without grad still runs on the kernels
        warnings.simplefilter("error", FallbackWarning)
        q, k, v, bias = on_backend(backend, q, k, v, bias)  # float32 on a GPU
        out = flashbob.sdpa(q, k, v, attn_mask=bias, enable_gqa=True, backend=backend)
        assert_matches(out.cpu(), want[0], exact_tolerance(out))


def test_mask_derivatives_under_torch_func_and_forward_mode(gen):
    """torch.func.grad / jvp and forward-mode AD w.r.t. the bias, and vmap over bool masks (whose values
    cannot be read inside vmap): all take the exact path and match torch."""
    q, k, v = qkv(gen)
    bias = torch.zeros(2, 1, 5, 7, dtype=torch.float64)
    tangent, weights = (torch.randn(s, generator=gen, dtype=torch.float64) for s in (bias.shape, q.shape))

    def loss(fn):
        return lambda b: (fn(q, k, v, attn_mask=b, enable_gqa=True) * weights).sum()

    with pytest.warns(FallbackWarning, match="torch.func transform"):
        close(torch.func.grad(loss(flashbob.sdpa))(bias), torch.func.grad(loss(torch_math_sdpa))(bias))
        close(torch.func.jvp(loss(flashbob.sdpa), (bias,), (tangent,))[1],
              torch.func.jvp(loss(torch_math_sdpa), (bias,), (tangent,))[1])
    with pytest.warns(FallbackWarning, match="forward-mode tangent"), fwAD.dual_level():
        dual = fwAD.make_dual(bias, tangent)
        got = fwAD.unpack_dual(loss(flashbob.sdpa)(dual)).tangent
        want = fwAD.unpack_dual(loss(torch_math_sdpa)(dual)).tangent
    close(got, want)
    masks = torch.rand(3, 2, 1, 5, 7, generator=gen) > 0.3
    masks[..., 0] = True
    attend = lambda fn: lambda m: fn(q, k, v, attn_mask=m, enable_gqa=True)  # noqa: E731
    dropin._warned.clear()
    with pytest.warns(FallbackWarning, match="torch.func transform"):
        close(torch.func.vmap(attend(flashbob.sdpa))(masks), torch.func.vmap(attend(torch_math_sdpa))(masks))


def test_meta_mask_takes_the_exact_path():
    """A mask on the meta device has no values to classify (before: NotImplementedError from aten::equal)."""
    q = torch.empty(2, 2, 5, 4, device="meta")
    with pytest.warns(FallbackWarning, match="meta device"):
        out = flashbob.sdpa(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool, device="meta"))
    assert out.shape == q.shape and out.is_meta


# ----------------------------------------------------------------------------- options, checked first


@pytest.mark.parametrize("dropout_p", [-0.1, 1.5, math.nan])
def test_dropout_p_outside_zero_one_raises_before_any_warning(gen, dropout_p):
    q, k, v = qkv(gen)
    dense = torch.rand(5, 7, generator=gen) > 0.3  # would take the fallback, and warn, if it were reached
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
            flashbob.sdpa(q, k, v, attn_mask=dense, dropout_p=dropout_p, enable_gqa=True)


@pytest.mark.parametrize("function", ["sdpa", "attention"])
def test_scale_too_large_for_a_float_raises_naming_scale(gen, function):
    q, k, v = qkv(gen, kv_heads=2)
    fn = flashbob.sdpa if function == "sdpa" else flashbob.attention
    with pytest.raises(ValueError, match="scale must be a finite number, got a value too large for a float"):
        fn(q, k, v, scale=10**400)


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(scale=10**400), ValueError, "scale must be a finite number"),
        (dict(backend="fast"), ValueError, "backend must be 'auto', 'triton' or 'blocked'"),
        (dict(key=torch.zeros(2, 1, 7, 4)), TypeError, r"key.dtype \(torch.float32\) must match query.dtype"),
        (dict(key=torch.zeros(2, 1, 7, 3, dtype=torch.float64)), ValueError, "key has head_dim 3 but query has 4"),
        (dict(value=torch.zeros(2, 1, 6, 4, dtype=torch.float64)), ValueError, "value must have key's shape"),
        (dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, "attn_mask of shape"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
        (dict(enable_gqa=1), TypeError, "enable_gqa must be a bool"),
    ],
)
def test_errors_come_before_any_fallback_warning(gen, change, error, message):
    """With dropout_p > 0 (which takes the fallback) any bad argument raises, and nothing warns first."""
    q, k, v = qkv(gen)
    kwargs = dict(query=q, key=k, value=v, dropout_p=0.5, enable_gqa=True) | change
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(error, match=message):
            flashbob.sdpa(**kwargs)


def test_integer_query_raises_instead_of_falling_back():
    x = torch.ones(1, 1, 3, 4, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(TypeError, match="query must be float16, bfloat16, float32 or float64, got torch.int64"):
            flashbob.sdpa(x, x, x)


def test_strict_mode_error_is_one_sentence(gen):
    q, k, v = qkv(gen)
    flashbob.set_strict(True)
    with pytest.raises(FallbackError) as raised:
        flashbob.sdpa(q, k, v, dropout_p=0.5, enable_gqa=True)
    assert str(raised.value) == (
        "flashbob.sdpa: the flashbob kernels do not handle dropout (dropout_p > 0), and strict mode forbids the "
        "exact but materialising (O(L*S) memory) fallback attention; call flashbob.set_strict(False) to allow it."
    )
    with pytest.raises(FallbackError, match=r"^flashbob\.sdpa: the flashbob kernels do not handle an attn_mask "
                                            r"that is not a key-padding .* mask, and strict mode forbids"):
        flashbob.sdpa(q, k, v, attn_mask=torch.rand(5, 7, generator=gen) > 0.3, enable_gqa=True)
