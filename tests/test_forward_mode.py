"""Forward-mode AD through flashbob.attention: the tangents of the output and of the first backward
against naive float64 attention (flashbob.reference) on both backends, with every subset of tangents;
gradcheck's forward-mode checks; forward-over-reverse Hessian products and torch.func.hessian; dual
tensors; vmap over tangents; the sdpa and patch_sdpa paths; PyTorch's legacy-vmap users
(is_grads_batched, vectorize=True); the clear errors for what is not differentiable."""

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import flashbob
from flashbob import blocked, reference
from flashbob.kernels import configs
from tests.helpers import assert_matches, needs_interpreter

TOL = 1e-12
#: Everything here is checked in float64, which the Triton kernels run only in the interpreter.
BACKENDS = ["blocked", pytest.param("triton", marks=needs_interpreter)]


def random_case(gen, *, gqa: bool, causal: bool, masked: bool, head_dim=4, max_length=11):
    """Random float64 inputs, their tangents and a key mask; lengths ``N``, ``M`` drawn from 1 to
    ``max_length`` (``N != M`` in general).

    With ``masked``, batch element 0 keeps no key (its rows see nothing) and element 1 a random subset."""
    heads, kv_heads = (4, 2) if gqa else (2, 2)
    n, m = (int(x) for x in torch.randint(1, max_length + 1, (2,), generator=gen))
    shapes = [(2, heads, n, head_dim), (2, kv_heads, m, head_dim), (2, kv_heads, m, head_dim), (2, heads, n, head_dim)]
    primals = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    tangents = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    key_mask = None
    if masked:
        key_mask = torch.rand(2, m, generator=gen) > 0.4
        key_mask[0] = False
        key_mask[1, torch.randint(0, m, (1,), generator=gen)] = True
    return primals, tangents, dict(causal=causal, key_mask=key_mask)


def attention_fns(backend: str, options: dict):
    """``(Q, K, V) -> O`` and ``(Q, K, V, dO) -> (dQ, dK, dV)`` through flashbob and through the reference."""
    def bob(q, k, v):
        return flashbob.attention(q, k, v, backend=backend, **options)

    def ref(q, k, v):
        return reference.attention(q, k, v, **options)

    def backward_of(fn):
        return lambda q, k, v, do: vjp(fn, q, k, v)[1](do)

    return (bob, ref), (backward_of(bob), backward_of(ref))


def jvp_in(fn, primals, tangents, which):
    """``torch.func.jvp`` of ``fn`` with tangents for the arguments in ``which`` only (the others held fixed)."""
    def partial(*chosen):
        args = list(primals)
        for index, x in zip(which, chosen):
            args[index] = x
        return fn(*args)

    return jvp(partial, tuple(primals[i] for i in which), tuple(tangents[i] for i in which))[1]


def nonempty_subsets(count):
    return [s for r in range(1, count + 1) for s in itertools.combinations(range(count), r)]


def check_subsets(backend, primals, tangents, options, forward_subsets, backward_subsets):
    """Tangents of ``O`` (given tangents of the inputs in each of ``forward_subsets``, indices into
    ``(Q, K, V)``) and of ``dQ, dK, dV`` (``backward_subsets``, into ``(Q, K, V, dO)``) against the reference."""
    (bob, ref), (bob_backward, ref_backward) = attention_fns(backend, options)
    for which in forward_subsets:
        got, want = jvp_in(bob, primals[:3], tangents, which), jvp_in(ref, primals[:3], tangents, which)
        assert_matches(got, want, TOL, f"O tangent, tangents of {which}")
    for which in backward_subsets:
        got, want = jvp_in(bob_backward, primals, tangents, which), jvp_in(ref_backward, primals, tangents, which)
        for name, a, b in zip(("dQ", "dK", "dV"), got, want):
            assert_matches(a, b, TOL, f"{name} tangent, tangents of {which}")


@pytest.mark.parametrize(
    "gqa, causal, masked", [(False, False, False), (True, True, True), (True, False, True), (False, True, False)]
)
def test_every_tangent_subset_matches_reference_blocked(gen, gqa, causal, masked):
    primals, tangents, options = random_case(gen, gqa=gqa, causal=causal, masked=masked)
    check_subsets("blocked", primals, tangents, options, nonempty_subsets(3), nonempty_subsets(4))


@needs_interpreter
def test_tangents_match_reference_triton(gen):
    """All tangents, and one random proper subset (the kernels specialise on each; every subset is
    checked on the blocked backend, the interpreter being slow)."""
    primals, tangents, options = random_case(gen, gqa=True, causal=True, masked=True, head_dim=16)
    forward_subset = nonempty_subsets(3)[int(torch.randint(0, 6, (1,), generator=gen))]
    backward_subset = nonempty_subsets(4)[int(torch.randint(0, 14, (1,), generator=gen))]
    with configs.override(block_m=16, block_n=16):
        check_subsets("triton", primals, tangents, options, [forward_subset, (0, 1, 2)],
                      [backward_subset, (0, 1, 2, 3)])


def test_blocked_panels_of_one_row_and_column(gen):
    """The blocked backend's JVPs agree whatever the panel size (one row/column at a time vs whole)."""
    (q, k, v, do), (q_dot, k_dot, v_dot, do_dot), options = random_case(gen, gqa=True, causal=True, masked=True)
    o, lse = blocked.forward(q, k, v, scale=0.5, **options)
    delta = blocked.backward(q, k, v, o, lse, do, scale=0.5, **options)[3]
    whole, one = (
        (
            *blocked.forward_jvp(q, k, v, o, lse, q_dot, k_dot, v_dot, scale=0.5, block=block, **options),
            *blocked.backward_jvp(q, k, v, do, o, lse, delta, q_dot, k_dot, v_dot, do_dot, scale=0.5, block=block,
                                  **options),
        )
        for block in (None, 1)
    )
    for a, b in zip(one, whole):
        assert_matches(a, b, TOL)


def test_blocked_backward_jvp_takes_both_forward_tangents_or_neither(gen):
    (q, k, v, do), (q_dot, *_), options = random_case(gen, gqa=False, causal=False, masked=False)
    o, lse = blocked.forward(q, k, v, scale=0.5, **options)
    delta = blocked.backward(q, k, v, o, lse, do, scale=0.5, **options)[3]
    with pytest.raises(ValueError, match="o_dot and stats_dot: pass both"):
        blocked.backward_jvp(q, k, v, do, o, lse, delta, q_dot, None, None, None, scale=0.5, o_dot=o, **options)


def test_gradcheck_forward_and_backward_ad(gen):
    """PyTorch's own checks: forward AD, backward AD, batched (vmapped) versions of both, and the
    second-order forward-over-reverse and reverse-over-reverse checks, against finite differences."""
    (q, k, v, _), _, options = random_case(gen, gqa=True, causal=True, masked=False, head_dim=2, max_length=4)
    inputs = tuple(x.clone().requires_grad_() for x in (q, k, v))
    fn = lambda q, k, v: flashbob.attention(q, k, v, backend="blocked", **options)  # noqa: E731
    assert torch.autograd.gradcheck(
        fn, inputs, check_forward_ad=True, check_backward_ad=True, check_batched_grad=True,
        check_batched_forward_grad=True,
    )
    assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True, check_rev_over_rev=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_over_reverse_equals_reverse_over_reverse(gen, backend):
    (q, k, v, _), (q_dot, k_dot, v_dot, _), options = random_case(
        gen, gqa=True, causal=True, masked=True, head_dim=16 if backend == "triton" else 4
    )
    loss = lambda q, k, v: flashbob.attention(q, k, v, backend=backend, **options).sin().sum()  # noqa: E731
    with configs.override(block_m=16, block_n=16):
        forward_over_reverse = jvp(grad(loss, argnums=(0, 1, 2)), (q, k, v), (q_dot, k_dot, v_dot))[1]
        inputs = tuple(x.clone().requires_grad_() for x in (q, k, v))
        grads = torch.autograd.grad(loss(*inputs), inputs, create_graph=True)
        reverse_over_reverse = torch.autograd.grad(grads, inputs, (q_dot, k_dot, v_dot))
    ref_loss = lambda q, k, v: reference.attention(q, k, v, **options).sin().sum()  # noqa: E731
    want = jvp(grad(ref_loss, argnums=(0, 1, 2)), (q, k, v), (q_dot, k_dot, v_dot))[1]
    for a, b, c in zip(forward_over_reverse, reverse_over_reverse, want):
        assert_matches(a, c, TOL)
        assert_matches(b, c, TOL)


@needs_interpreter
def test_forward_over_reverse_reuses_the_forward_tangents(gen, monkeypatch):
    """Where forward mode also went through the forward (``jvp`` of ``grad``; dual tensors with a
    ``create_graph`` gradient), the backward's tangent takes the forward's tangents of O and the statistics,
    so the kernels' row-scalar sweep (``jvp_rows``) does not run; where the forward ran outside forward mode
    (``jvp`` of a ``vjp`` function made outside), it does. All three match the reference."""
    launched = []
    launch = configs.launch
    monkeypatch.setattr(configs, "launch", lambda name, *a, **kw: launched.append(name) or launch(name, *a, **kw))
    (q, k, v, do), (q_dot, k_dot, v_dot, do_dot), options = random_case(gen, gqa=True, causal=True, masked=True,
                                                                        head_dim=16)
    bob = lambda q, k, v: flashbob.attention(q, k, v, backend="triton", **options)
    ref = lambda q, k, v: reference.attention(q, k, v, **options)
    loss = lambda fn: lambda q, k, v: fn(q, k, v).sin().sum()
    hvp = lambda fn: jvp(grad(loss(fn), argnums=(0, 1, 2)), (q, k, v), (q_dot, k_dot, v_dot))[1]
    with configs.override(block_m=16, block_n=16):
        got = hvp(bob)
        assert "jvp_fwd" in launched and "jvp_cols" in launched and "jvp_rows" not in launched, launched
        launched.clear()
        leaf = q.clone().requires_grad_()
        with forward_ad.dual_level():
            (g,) = torch.autograd.grad(loss(bob)(forward_ad.make_dual(leaf, q_dot), k, v), leaf, create_graph=True)
            got_dual = forward_ad.unpack_dual(g).tangent
        assert "jvp_fwd" in launched and "jvp_rows" not in launched, launched
        launched.clear()
        got_do = jvp(vjp(bob, q, k, v)[1], (do,), (do_dot,))[1]
        assert "jvp_rows" in launched and "jvp_fwd" not in launched, launched
    for a, b in zip(got, hvp(ref)):
        assert_matches(a, b, TOL)
    assert_matches(got_dual, jvp(lambda q: grad(loss(ref))(q, k, v), (q,), (q_dot,))[1], TOL)
    for a, b in zip(got_do, jvp(vjp(ref, q, k, v)[1], (do,), (do_dot,))[1]):
        assert_matches(a, b, TOL)


def test_hessian_matches_reference(gen):
    """torch.func.hessian (jacfwd of jacrev) through flashbob, all of (Q, K, V) at once."""
    (q, k, v, _), _, options = random_case(gen, gqa=True, causal=True, masked=True, head_dim=3, max_length=5)

    def loss(fn):
        return lambda q, k, v: fn(q, k, v, **options).pow(2).sum()

    got = hessian(loss(lambda *a, **o: flashbob.attention(*a, backend="blocked", **o)), argnums=(0, 1, 2))(q, k, v)
    want = hessian(loss(reference.attention), argnums=(0, 1, 2))(q, k, v)
    for got_row, want_row in zip(got, want):
        for a, b in zip(got_row, want_row):
            assert_matches(a, b, TOL)


@needs_interpreter
def test_hessian_through_the_kernels(gen):
    """torch.func.hessian and torch.autograd.functional.hessian(vectorize=True) with the Triton kernels: the
    vmapped tangents of the forward reach the backward's tangent (forward-over-reverse) and are folded into
    its batch. One query head per key head's pair (GQA), causal, a masked key, N != M."""
    q = torch.randn(1, 2, 3, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 5, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    options = dict(causal=True, key_mask=torch.tensor([[True, True, False, True, True]]))
    loss = lambda fn: lambda q: fn(q, k, v, **options).pow(2).sum()  # noqa: E731
    want = hessian(loss(reference.attention))(q)
    bob = loss(lambda *a, **o: flashbob.attention(*a, backend="triton", **o))
    with configs.override(block_m=16, block_n=16):
        assert_matches(hessian(bob)(q), want, TOL)
        assert_matches(torch.autograd.functional.hessian(bob, q, vectorize=True), want, TOL)


def test_dual_tensors_and_forward_over_reverse_with_forward_ad(gen):
    """torch.autograd.forward_ad: the output's tangent, and the tangent of a create_graph gradient."""
    (q, k, v, _), (q_dot, _, v_dot, _), options = random_case(gen, gqa=False, causal=True, masked=True)
    want = jvp(lambda q, v: reference.attention(q, k, v, **options), (q, v), (q_dot, v_dot))[1]
    ref_loss = lambda q: reference.attention(q, k, v, **options).sin().sum()  # noqa: E731
    want_hvp = jvp(grad(ref_loss), (q,), (q_dot,))[1]
    leaf = q.clone().requires_grad_()
    with forward_ad.dual_level():
        out = flashbob.attention(forward_ad.make_dual(leaf, q_dot), k, forward_ad.make_dual(v, v_dot), **options)
        assert_matches(forward_ad.unpack_dual(out).tangent, want, TOL)
        dual_q = forward_ad.make_dual(leaf, q_dot)
        (g,) = torch.autograd.grad(flashbob.attention(dual_q, k, v, **options).sin().sum(), leaf, create_graph=True)
        assert_matches(forward_ad.unpack_dual(g).tangent, want_hvp, TOL)


def test_vmap_over_tangents_and_jacfwd(gen):
    (q, k, v, _), _, options = random_case(gen, gqa=True, causal=False, masked=True)
    tangents = torch.randn(3, *q.shape, generator=gen, dtype=q.dtype)

    def along(fn):
        return vmap(lambda t: jvp(lambda q: fn(q, k, v, **options), (q,), (t,))[1])(tangents)

    assert_matches(along(flashbob.attention), along(reference.attention), TOL)
    bob = lambda k: flashbob.attention(q, k, v, **options)  # noqa: E731
    assert_matches(jacfwd(bob)(k), jacfwd(lambda k: reference.attention(q, k, v, **options))(k), TOL)
    assert_matches(jacfwd(bob)(k), jacrev(bob)(k), TOL)


def test_sdpa_and_patch_sdpa(gen):
    """Forward mode through flashbob.sdpa (key-padding mask and is_causal, GQA), patch_sdpa, and the
    exact fallback (a dense mask), against torch's math SDPA."""
    (q, k, v, _), (q_dot, k_dot, v_dot, _), _ = random_case(gen, gqa=True, causal=False, masked=False)
    padding = torch.rand(q.shape[0], 1, 1, k.shape[2], generator=gen) > 0.3
    padding[..., 0] = True
    dense = torch.rand(q.shape[2], k.shape[2], generator=gen) > 0.3
    dense[:, 0] = True

    def math_sdpa(q, k, v, **kwargs):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)

    cases = ((dict(attn_mask=padding), True), (dict(is_causal=True), True), (dict(attn_mask=dense), False))
    for kwargs, strict in cases:
        want = jvp(lambda *a: math_sdpa(*a, **kwargs), (q, k, v), (q_dot, k_dot, v_dot))[1]
        flashbob.set_strict(strict)  # strict: the flashbob path, not the exact fallback, must take it
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", flashbob.FallbackWarning)
                got = jvp(lambda *a: flashbob.sdpa(*a, enable_gqa=True, **kwargs), (q, k, v), (q_dot, k_dot, v_dot))[1]
        finally:
            flashbob.set_strict(None)
        assert_matches(got, want, TOL, str(kwargs))
    with flashbob.patch_sdpa():
        got = jvp(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True), (q, k, v),
                  (q_dot, k_dot, v_dot))[1]
    assert_matches(got, jvp(lambda *a: math_sdpa(*a, is_causal=True), (q, k, v), (q_dot, k_dot, v_dot))[1], TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_legacy_vmap_users(gen, backend):
    """is_grads_batched=True (first backward and BoB) and torch.autograd.functional.hessian/jacobian with
    vectorize=True (blocked only: slow in the interpreter) run PyTorch's legacy vmap, which does not
    call the Functions' vmap rules."""
    head_dim = 16 if backend == "triton" else 4
    (q, k, v, _), _, options = random_case(gen, gqa=True, causal=True, masked=True, head_dim=head_dim, max_length=5)

    def results(attention):
        inputs = tuple(x.clone().requires_grad_() for x in (q, k, v))
        out = attention(*inputs, **options)
        batched = torch.randn(3, *out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
        first = torch.autograd.grad(out, inputs, batched, is_grads_batched=True, retain_graph=True)
        (dq,) = torch.autograd.grad(out.sin().sum(), inputs[0], create_graph=True)
        second = torch.autograd.grad(dq, inputs, batched, is_grads_batched=True)
        if backend == "triton":
            return (*first, *second)
        loss = lambda q, k, v: attention(q, k, v, **options).sin().sum()  # noqa: E731
        hess = torch.autograd.functional.hessian(loss, (q, k, v), vectorize=True)
        jac = torch.autograd.functional.jacobian(lambda k: attention(q, k, v, **options), k, vectorize=True)
        return (*first, *second, *(h for row in hess for h in row), jac)

    with configs.override(block_m=16, block_n=16):
        got = results(lambda *a, **o: flashbob.attention(*a, backend=backend, **o))
    for a, b in zip(got, results(reference.attention), strict=True):
        assert_matches(a, b, TOL)


def test_hvp_and_vhp_of_torch_autograd_functional(gen):
    """vhp (the double backward) works; hvp reaches its second derivative by differentiating the backward's
    backward (the double-vjp trick), which flashbob does not support: its error says so and names the ways out."""
    (q, k, v, _), (q_dot, k_dot, v_dot, _), options = random_case(gen, gqa=True, causal=True, masked=True)
    loss = lambda fn: lambda q, k, v: fn(q, k, v, **options).sin().sum()  # noqa: E731
    got = torch.autograd.functional.vhp(loss(flashbob.attention), (q, k, v), (q_dot, k_dot, v_dot))[1]
    want = torch.autograd.functional.hvp(loss(reference.attention), (q, k, v), (q_dot, k_dot, v_dot))[1]
    for a, b in zip(got, want):
        assert_matches(a, b, TOL)
    with pytest.raises(RuntimeError, match="torch.autograd.functional.hvp, which reaches a second derivative by "
                       "differentiating the backward's backward") as error:
        torch.autograd.functional.hvp(loss(flashbob.attention), (q, k, v), (q_dot, k_dot, v_dot))
    assert "torch.autograd.functional.vhp" in str(error.value) and "optim.hvp" in str(error.value)


def test_what_is_not_differentiable_raises_clearly(gen):
    """Third derivatives in forward mode, and the forward's tangent differentiated again. Small lengths: the nested
    transforms run the first levels on every basis vector before the third one raises (at N = 11, M = 8 they take
    23 GB)."""
    (q, k, v, _), (q_dot, *_), options = random_case(gen, gqa=False, causal=False, masked=False, max_length=4)
    loss = lambda q: flashbob.attention(q, k, v, **options).pow(3).sum()  # noqa: E731
    third = "differentiable twice, not three times"
    with pytest.raises(RuntimeError, match=third):  # forward over reverse-over-reverse
        jvp(lambda q: jacrev(jacrev(loss))(q), (q,), (q_dot,))
    with pytest.raises(RuntimeError, match=third):  # reverse over forward-over-reverse
        jacrev(hessian(loss))(q)
    again = "forward-mode tangent cannot be differentiated again"
    with pytest.raises(RuntimeError, match=again):  # forward over forward-over-reverse: the forward's tangent first
        jacfwd(hessian(loss))(q)
    with pytest.raises(RuntimeError, match=again):  # reverse over forward
        jacrev(jacfwd(loss))(q)
    with pytest.raises(RuntimeError, match=again):  # forward over forward
        jacfwd(jacfwd(loss))(q)


def test_nested_legacy_vmap_raises_clearly(gen):
    (q, k, v, _), _, _ = random_case(gen, gqa=False, causal=False, masked=False, max_length=3)
    nested = torch._vmap_internals._vmap(torch._vmap_internals._vmap(lambda q: flashbob.attention(q, k, v)))
    with pytest.raises(RuntimeError, match="does not support nested legacy vmaps .* use torch.func.vmap"):
        nested(q.expand(2, 3, *q.shape))


def test_functions_bind_their_arguments_to_a_stored_signature():
    """Function.apply binds its arguments to inspect.signature(forward) on every call (torch 2.13): each flashbob
    Function's forward stores its wrapper's own signature (*args) (a few us to read and bind, instead of 60-100 us
    to rebuild the wrapped forward's through __wrapped__ and 13-22 us to bind to its named parameters), and the
    Triton backend is built once per allow_tf32 (at import) instead of per call."""
    import inspect

    from flashbob import autograd
    from flashbob.attention import TRITON

    functions = (autograd.Attention, autograd.AttentionBackward, autograd.BackwardOverBackward,
                 autograd.AttentionTangent, autograd.AttentionBackwardTangent)
    for function in functions:
        forward = function.forward
        assert "__signature__" in vars(forward), function.__name__
        (parameter,) = inspect.signature(forward).parameters.values()
        assert parameter.kind is inspect.Parameter.VAR_POSITIONAL, function.__name__
    assert all(TRITON[allow_tf32].forward.keywords["allow_tf32"] is allow_tf32 for allow_tf32 in (False, True))
