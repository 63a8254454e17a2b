"""Boolean key-padding masks in both backends: every output of forward, backward and BoB against
the float64 oracle, fully masked rows (zero output and gradients, never NaN), masked keys (zero
dK, dV, K̄, V̄ rows), and causal + key mask combined."""

import pytest
import torch

import flashbob
from flashbob import blocked, reference
from flashbob.kernels import configs
from tests.helpers import BACKENDS, KERNEL_DEVICE, KERNEL_EXACT_DTYPE, assert_matches

DEVICE, EXACT = KERNEL_DEVICE or "cpu", KERNEL_EXACT_DTYPE  # float32 against the float64 oracle on a GPU
TOLERANCE = 1e-10 if EXACT == torch.float64 else 1e-5
COTANGENTS = ("dq_bar", "dk_bar", "dv_bar")
NAMES = ("o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "do_bar")


def backends():
    from flashbob import kernels

    return {"blocked": blocked, "triton": kernels}


def make_case(gen, batch, heads, kv_heads, n, m, head_dim, *, empty_row_batch=True):
    """Random inputs and a key mask in which batch 0 keeps a random subset (and never key 0, so that
    causal rows 0.. see nothing) and, if asked, the last batch element keeps no key at all."""
    shapes = {"q": (heads, n), "do": (heads, n), "dq_bar": (heads, n)}
    t = {
        name: torch.randn(batch, *shapes.get(name, (kv_heads, m)), head_dim, generator=gen, dtype=torch.float64)
        for name in ("q", "k", "v", "do", *COTANGENTS)
    }
    key_mask = torch.rand(batch, m, generator=gen) > 0.4
    key_mask[0, 0] = False
    key_mask[0, -1] = True
    if empty_row_batch and batch > 1:
        key_mask[-1] = False
    return {name: x.to(DEVICE, EXACT) for name, x in t.items()}, key_mask.to(DEVICE)


def run_backend(module, t, key_mask, causal, scale):
    q, k, v, do = (t[name] for name in ("q", "k", "v", "do"))
    o, stats = module.forward(q, k, v, causal=causal, scale=scale, key_mask=key_mask)
    dq, dk, dv, delta = module.backward(q, k, v, o, stats, do, causal=causal, scale=scale, key_mask=key_mask)
    bars = [t[name] for name in COTANGENTS]
    outs = module.bob(q, k, v, do, o, stats, delta, *bars, causal=causal, scale=scale, key_mask=key_mask)
    return dict(zip(NAMES, (o, dq, dk, dv, *outs)))


def run_reference(t, key_mask, causal, scale):
    q, k, v, do = (t[name].cpu().double() for name in ("q", "k", "v", "do"))
    key_mask = key_mask.cpu()
    o = reference.attention(q, k, v, causal=causal, scale=scale, key_mask=key_mask)
    grads = reference.attention_backward(q, k, v, do, causal=causal, scale=scale, key_mask=key_mask)
    bars = [t[name].cpu().double() for name in COTANGENTS]
    outs = reference.backward_over_backward(q, k, v, do, *bars, causal=causal, scale=scale, key_mask=key_mask)
    return dict(zip(NAMES, (o, *grads, *outs)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 21, 19, 16), (3, 2, 1, 17, 33, 8)])
def test_every_output_matches_the_masked_oracle(gen, backend, causal, shape):
    t, key_mask = make_case(gen, *shape)
    scale = shape[-1] ** -0.5
    with configs.override(block_m=16, block_n=16):
        got = run_backend(backends()[backend], t, key_mask, causal, scale)
    want = run_reference(t, key_mask, causal, scale)
    for name in NAMES:
        assert torch.isfinite(got[name]).all(), name
        assert_matches(got[name].cpu(), want[name], TOLERANCE, name)
    # fully masked rows: the whole last batch element, and (causal) rows before batch 0's first kept key
    for name in ("o", "dq", "q_bar", "do_bar"):
        assert (got[name][-1] == 0).all(), name
    if causal:
        first_kept = int(key_mask[0].nonzero()[0])
        for name in ("o", "dq", "q_bar", "do_bar"):
            assert (got[name][0, :, :first_kept] == 0).all(), name
    # masked keys: zero dK, dV, K̄, V̄ rows
    for name in ("dk", "dv", "k_bar", "v_bar"):
        assert (got[name][~key_mask[:, None, :, None].expand_as(got[name])] == 0).all(), name


def test_the_oracle_defines_fully_masked_rows_as_zero():
    q, k, v = (torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    key_mask = torch.zeros(1, 3, dtype=torch.bool)
    o = reference.attention(q, k, v, key_mask=key_mask)
    assert (o == 0).all()
    (dq,) = torch.autograd.grad(o.square().sum() + o.sum(), q, create_graph=True)
    assert torch.isfinite(dq).all() and (dq == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_with_key_mask_second_derivative(gen, backend):
    """Through the public entry: an HVP with a key mask (causal, with empty rows) matches the oracle."""
    t, key_mask = make_case(gen, 2, 2, 1, 18, 18, 8)
    q, k, v = (t[name].requires_grad_() for name in ("q", "k", "v"))
    tangents = [t[name] for name in ("dq_bar", "dk_bar", "dv_bar")]

    def hvp(fn):
        out = fn(q, k, v)
        grads = torch.autograd.grad(out.sin().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(grads, (q, k, v), tangents)

    with configs.override(block_m=16, block_n=16):
        got = hvp(lambda *x: flashbob.attention(*x, causal=True, key_mask=key_mask, backend=backend))
    want = hvp(lambda *x: reference.attention(*x, causal=True, key_mask=key_mask))
    for a, b, name in zip(got, want, "qkv"):  # the oracle in the same dtype: float32 on a GPU, hence 10x
        assert_matches(a, b, 10 * TOLERANCE, name)


def test_key_mask_checks():
    q = torch.randn(2, 2, 5, 4)
    with pytest.raises(TypeError, match="bool"):
        flashbob.attention(q, q, q, key_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="broadcast"):
        flashbob.attention(q, q, q, key_mask=torch.ones(3, 5, dtype=torch.bool))
    # (1, M) and (M,) broadcast over the batch
    o = flashbob.attention(q, q, q, key_mask=torch.ones(5, dtype=torch.bool))
    assert_matches(o, flashbob.attention(q, q, q), 1e-6)
