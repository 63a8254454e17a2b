"""flashbob under torch.compile: attention is one operator in the graph (no graph break, also through
:func:`flashbob.sdpa` and a patched ``F.scaled_dot_product_attention``), ``fullgraph=True`` compiles, training steps
on new data recompile nothing and give eager's gradients (aot_eager and inductor); every pass's operator passes
:func:`torch.library.opcheck`. On a GPU the kernels' operators are traced and their kernels go into the graph; in
Triton's interpreter they are opaque operators."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import flashbob
from flashbob import operators
from tests.helpers import KERNEL_DEVICE, KERNEL_EXACT_DTYPE, needs_gpu, needs_kernels

WIDTH, HEADS = 16, 2
ATTENTION = {
    "attention": lambda q, k, v, backend: flashbob.attention(q, k, v, causal=True, backend=backend),
    "sdpa": lambda q, k, v, backend: flashbob.sdpa(q, k, v, is_causal=True, backend=backend),
    "patched": lambda q, k, v, backend: F.scaled_dot_product_attention(q, k, v, is_causal=True),  # in patch_sdpa
}


class SelfAttention(nn.Module):
    """Query/key/value projection, causal attention through ``attention`` (a key of :data:`ATTENTION`), output
    projection."""

    def __init__(self, attention: str, backend: str, device=None, dtype=torch.float64):
        super().__init__()
        self.attend, self.backend = ATTENTION[attention], backend
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, device=device, dtype=dtype)
        self.out = nn.Linear(WIDTH, WIDTH, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=HEADS)
        return self.out(rearrange(self.attend(q, k, v, self.backend), "b h n d -> b n (h d)"))


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).tanh().square().mean()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and leaves no compiled code behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("attention", ATTENTION)
def test_attention_is_one_operator_in_the_graph(gen, attention):
    model = SelfAttention(attention, "auto")
    x = torch.randn(2, 7, WIDTH, generator=gen, dtype=torch.float64)
    with flashbob.patch_sdpa():
        explained = torch._dynamo.explain(loss)(model, x)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
    assert "torch.ops.flashbob.blocked_forward" in explained.graphs[0].code


def test_a_padding_mask_stays_in_the_graph(gen):
    """A bool ``(B, 1, 1, S)`` padding mask is read by its shape alone: no graph break (a mask that sdpa classifies
    by its values, a float one or a ``(B, 1, L, S)`` one, breaks the graph there: its values are data)."""
    q, k, v = (torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    padding = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    explained = torch._dynamo.explain(flashbob.sdpa)(q, k, v, attn_mask=padding[:, None, None, :], is_causal=True)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert "torch.ops.flashbob.blocked_forward" in explained.graphs[0].code


def assert_steps_match_eager(model, compiler, gen, *, device="cpu", dtype=torch.float64, tolerance=1e-10,
                             dynamic=None, lengths=(7, 7, 7)):
    """Three training steps of ``model`` on new data, compiled with ``compiler`` and ``fullgraph=True``: no
    recompilation, one graph, and eager's loss and gradients."""
    compiled = torch.compile(loss, backend=compiler, fullgraph=True, dynamic=dynamic)
    params = list(model.parameters())
    torch._dynamo.utils.counters.clear()
    with flashbob.patch_sdpa(), torch._dynamo.config.patch(error_on_recompile=True):
        for n in lengths:
            x = torch.randn(2, n, WIDTH, generator=gen, dtype=torch.float64).to(device, dtype)
            got = compiled(model, x)
            grads = torch.autograd.grad(got, params)
            want = loss(model, x)
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
            for a, b in zip(grads, torch.autograd.grad(want, params), strict=True):
                torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("attention", ATTENTION)
def test_compiled_steps_match_eager_aot_eager(gen, attention):
    assert_steps_match_eager(SelfAttention(attention, "blocked"), "aot_eager", gen)


def test_compiled_steps_match_eager_inductor(gen):
    assert_steps_match_eager(SelfAttention("attention", "blocked"), "inductor", gen)


def test_dynamic_lengths_compile_once(gen):
    """With dynamic shapes the blocked operators' fake implementations take symbolic lengths."""
    assert_steps_match_eager(SelfAttention("attention", "blocked"), "aot_eager", gen, dynamic=True, lengths=(5, 9, 12))


@needs_kernels
def test_compiled_steps_match_eager_kernels(gen):
    """The kernels' operators, opaque in the graph, on the GPU or in the interpreter."""
    model = SelfAttention("attention", "triton", device=KERNEL_DEVICE, dtype=KERNEL_EXACT_DTYPE)
    tolerance = 1e-10 if KERNEL_EXACT_DTYPE == torch.float64 else 1e-5
    assert_steps_match_eager(model, "aot_eager", gen, device=KERNEL_DEVICE, dtype=KERNEL_EXACT_DTYPE,
                             tolerance=tolerance)


@needs_gpu
def test_compiled_steps_match_eager_kernels_inductor(gen):
    model = SelfAttention("attention", "triton", device="cuda", dtype=torch.float32)
    assert_steps_match_eager(model, "inductor", gen, device="cuda", dtype=torch.float32, tolerance=1e-5)


@needs_gpu
def test_the_kernels_are_operators_in_the_graph(gen):
    """The forward and backward graphs that AOTAutograd hands the backend call flashbob's kernel operators, which
    launch the kernels at run time."""
    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph.code)
        return make_boxed_func(graph.forward)

    model = SelfAttention("attention", "triton", device="cuda", dtype=torch.float32)
    compiled = torch.compile(loss, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    x = torch.randn(2, 7, WIDTH, device="cuda")
    torch.autograd.grad(compiled(model, x), list(model.parameters()))
    assert [graph.count("flashbob.triton_forward") for graph in graphs] == [1, 0]
    assert [graph.count("flashbob.triton_backward") for graph in graphs] == [0, 1]


# ----------------------------------------------------------------------------- opcheck


#: Each operator's case: the pass and its arguments (without the kernels' ``allow_tf32``) on :func:`_inputs`'s tensors.
#: The masks are the key mask with causal, or (the ``*_window_documents`` cases) a window with document ids.


def _masks(t: dict, kind: str = "key_mask_causal") -> tuple:
    """The mask arguments of an operator: ``(key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window_left,
    window_right)``."""
    if kind == "key_mask":
        return t["key_mask"], None, None, None, None, False, None, None
    if kind == "window_documents":
        return None, t["q_ids"], t["k_ids"], None, None, False, 2, 1
    return t["key_mask"], None, None, None, None, True, None, None


CASES = {
    "forward": ("forward", lambda t: (t["q"], t["k"], t["v"], None, None, None, None, None, True, None, None, 0.5)),
    "forward_key_mask": ("forward", lambda t: (t["q"], t["k"], t["v"], *_masks(t, "key_mask"), 0.5)),
    "forward_window_documents": ("forward", lambda t: (t["q"], t["k"], t["v"], *_masks(t, "window_documents"),
                                                       0.5)),
    "backward": ("backward", lambda t: (t["q"], t["k"], t["v"], t["o"], t["stats"], t["do"], *_masks(t), 0.5)),
    "bob": ("bob", lambda t: (t["q"], t["k"], t["v"], t["do"], t["o"], t["stats"], t["delta"], t["dq_bar"],
                              t["dk_bar"], t["dv_bar"], *_masks(t), 0.5)),
    "bob_window_documents": ("bob", lambda t: (t["q"], t["k"], t["v"], t["do"], t["o"], t["stats"], t["delta"],
                                               t["dq_bar"], t["dk_bar"], t["dv_bar"], *_masks(t, "window_documents"),
                                               0.5)),
    "bob_dv_bar": ("bob", lambda t: (t["q"], t["k"], t["v"], t["do"], t["o"], t["stats"], t["delta"], None, None,
                                     t["dv_bar"], *_masks(t), 0.5)),
    "bob_no_cotangents": ("bob", lambda t: (t["q"], t["k"], t["v"], t["do"], t["o"], t["stats"], t["delta"], None,
                                            None, None, *_masks(t), 0.5)),
    "forward_jvp": ("forward_jvp", lambda t: (t["q"], t["k"], t["v"], t["o"], t["stats"], t["dq_bar"], None,
                                              t["dv_bar"], *_masks(t), 0.5)),
    "backward_jvp": ("backward_jvp", lambda t: (t["q"], t["k"], t["v"], t["do"], t["o"], t["stats"], t["delta"],
                                                t["dq_bar"], t["dk_bar"], None, t["do"], None, None, *_masks(t),
                                                0.5)),
    "backward_jvp_forward_tangents": ("backward_jvp", lambda t: (t["q"], t["k"], t["v"], t["do"], t["o"], t["stats"],
                                                                 t["delta"], t["dq_bar"], t["dk_bar"], None, t["do"],
                                                                 t["o_dot"], t["stats_dot"], *_masks(t), 0.5)),
    "backward_jvp_window_documents": ("backward_jvp", lambda t: (t["q"], t["k"], t["v"], t["do"], t["o"],
                                                                 t["stats"], t["delta"], t["dq_bar"], t["dk_bar"],
                                                                 t["dv_bar"], t["do"], None, None,
                                                                 *_masks(t, "window_documents"), 0.5)),
}


def _inputs(gen, ops: dict, options: tuple, device, dtype) -> dict:
    """Small random attention inputs (2 query heads on 1 kv head, a key mask, document ids) and the passes' outputs
    on them."""
    shapes = {"q": (1, 2, 5, 4), "do": (1, 2, 5, 4), "dq_bar": (1, 2, 5, 4), "k": (1, 1, 4, 4), "v": (1, 1, 4, 4),
              "dk_bar": (1, 1, 4, 4), "dv_bar": (1, 1, 4, 4)}
    t = {name: torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)
         for name, shape in shapes.items()}
    t["key_mask"] = torch.tensor([[True, True, False, True]], device=device)
    t["q_ids"] = torch.tensor([[0, 0, 1, 1, 1]], device=device)
    t["k_ids"] = torch.tensor([[0, 1, 1, 0]], device=device)
    t["o"], t["stats"] = ops["forward"](t["q"], t["k"], t["v"], *_masks(t), 0.5, *options)
    *_, t["delta"] = ops["backward"](t["q"], t["k"], t["v"], t["o"], t["stats"], t["do"], *_masks(t), 0.5, *options)
    t["o_dot"], t["stats_dot"] = ops["forward_jvp"](t["q"], t["k"], t["v"], t["o"], t["stats"], t["dq_bar"],
                                                    t["dk_bar"], None, *_masks(t), 0.5, *options)
    return t


@pytest.mark.parametrize("case", CASES)
def test_blocked_operators_pass_opcheck(gen, case):
    name, args = CASES[case]
    torch.library.opcheck(operators.BLOCKED[name], args(_inputs(gen, operators.BLOCKED, (), "cpu", torch.float64)))


@needs_kernels
@pytest.mark.parametrize("case", CASES)
def test_kernel_operators_pass_opcheck(gen, case):
    name, args = CASES[case]
    t = _inputs(gen, operators.KERNELS, (False,), KERNEL_DEVICE, KERNEL_EXACT_DTYPE)
    torch.library.opcheck(operators.KERNELS[name], (*args(t), False))


def test_the_forward_operator_is_differentiable_once(gen):
    """The forward operator's gradient (what torch.compile differentiates) is the backward operator's."""
    t = _inputs(gen, operators.BLOCKED, (), "cpu", torch.float64)
    q, k, v = (t[name].clone().requires_grad_() for name in ("q", "k", "v"))
    o, _ = operators.blocked_forward(q, k, v, *_masks(t), 0.5)
    grads = torch.autograd.grad(o, (q, k, v), t["do"])
    dq, dk, dv, _ = operators.blocked_backward(q, k, v, o, t["stats"], t["do"], *_masks(t), 0.5)
    for got, want in zip(grads, (dq, dk, dv), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    forward = lambda q, k, v: operators.blocked_forward(q, k, v, *_masks(t), 0.5)[0]  # noqa: E731
    assert torch.autograd.gradcheck(forward, (q, k, v))


def test_windows_and_documents_stay_in_one_graph(gen):
    """window= and document_ids= under torch.compile (fullgraph, aot_eager and inductor): one graph, the output
    and gradients of eager; a block mask compiles too (its tiles are made outside the graph)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = (torch.randn(1, 2, 37, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ids = torch.arange(37)[None] // 10
    block_mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < 8), None, None, 37, 37, device="cpu",
                                   BLOCK_SIZE=16)
    cases = {"window_documents": (lambda q, k, v: flashbob.attention(q, k, v, causal=True, window=(5, 0),
                                                                     document_ids=ids), True),
             "block_mask": (lambda q, k, v: flashbob.attention(q, k, v, block_mask=block_mask), False)}
    for name, (attend, fullgraph) in cases.items():
        want = attend(q, k, v)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        for compiler in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            got = torch.compile(attend, backend=compiler, fullgraph=fullgraph)(q, k, v)
            grads = torch.autograd.grad(got.square().sum(), (q, k, v))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{name} {compiler}")
            for a, b in zip(grads, want_grads):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name} {compiler}")
