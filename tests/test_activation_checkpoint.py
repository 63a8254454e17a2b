"""optim.checkpoint: the recipe GPT with each block checkpointed gives the products of the plain model (gradient,
both Hessian-vector product modes, forward-mode Gauss-Newton products) in float64, with dropout and under autocast,
and leaves the random-number generator as the plain model does."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import warnings
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

import flashbob
import optim
from flashbob import blocked, kept
from optim import CrossEntropyHessian, GGNOperator
from optim.forward_mode_checks import active_dropout
from recipes.lm.model import GPT, cross_entropy
from tests.helpers import BACKENDS, OperationRecorder, exact_tolerance, on_backend

ATTENTION_MODULE = importlib.import_module("flashbob.attention")  # the package's ``attention`` is the function

VOCAB = 64


def products(model: GPT, tokens: torch.Tensor, vec: list[torch.Tensor], seed: int) -> dict[str, list[torch.Tensor]]:
    """Gradient and reverse-mode Hessian product of the next-token loss, each pass starting from random-number state
    ``seed``, and without dropout (which forward mode refuses) the forward-mode Hessian and GGN products."""
    params = list(model.parameters())

    def logits() -> torch.Tensor:
        torch.manual_seed(seed)
        return model(tokens[:, :-1])

    def loss() -> torch.Tensor:
        return cross_entropy(logits(), tokens[:, 1:])

    result = {"gradient": list(torch.autograd.grad(loss(), params)),
              "hvp reverse": list(optim.hvp(loss(), params, vec))}
    if active_dropout(model) is None:
        ggn = GGNOperator(optim.functional(model, logits, params), params, CrossEntropyHessian(tokens[:, 1:]),
                          mode="forward")
        result["hvp forward"] = list(optim.hvp(optim.functional(model, loss, params), params, vec, mode="forward"))
        result["ggn forward"] = list(ggn.matvec(vec))
    return result


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_checkpointed_blocks_give_the_products_of_the_plain_model(dropout: float) -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp="gelu", dropout=dropout,
                attention="blocked").double()
    tokens = torch.randint(0, VOCAB, (2, 19))
    vec = [torch.randn_like(p) for p in model.parameters()]
    model.checkpoint_activations = False
    plain = products(model, tokens, vec, seed=5)
    model.checkpoint_activations = True
    checkpointed = products(model, tokens, vec, seed=5)
    for name in plain:
        for a, b in zip(plain[name], checkpointed[name], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)
    assert all(p.abs().sum() > 0 for p in plain["hvp reverse"])
    assert len(plain) == (2 if dropout else 4)


def test_recomputation_repeats_the_autocast_of_the_first_run() -> None:
    """The backward runs outside the caller's autocast; the recomputation must run in bfloat16 as the first did."""
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, mlp="gelu", attention="blocked")
    tokens = torch.randint(0, VOCAB, (2, 17))
    grads = []
    for recompute in (False, True):
        model.checkpoint_activations = recompute
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_random_state_advances_as_without_checkpointing() -> None:
    """The first run draws the block's random numbers from the caller's generator (so blocks after it draw new
    ones); recomputations replay them and leave the generator where it was."""
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(8, 4, requires_grad=True)
    states = []
    for run in (block, lambda x: optim.checkpoint(block, x)):
        torch.manual_seed(1)
        y = run(x)
        after_forward = torch.rand(3)
        torch.manual_seed(2)
        y.sum().backward()
        states.append((y.detach(), after_forward, torch.rand(3)))
    for a, b in zip(*states, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_only_what_requires_grad_gets_a_gradient() -> None:
    block = nn.Linear(3, 3)
    block.bias.requires_grad_(False)
    x = torch.randn(2, 3)
    (weight,) = torch.autograd.grad(optim.checkpoint(block, x).square().sum(), [block.weight])
    torch.testing.assert_close(weight, torch.autograd.grad(block(x).square().sum(), [block.weight])[0])
    assert block.bias.grad is None


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_inputs_and_outputs_that_are_not_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match=r"checkpoint: inputs\[1\] must be a tensor, got float"):
        optim.checkpoint(nn.Bilinear(2, 2, 1), torch.randn(1, 2), 0.5)
    with pytest.raises(TypeError, match="checkpoint: inputs must hold at least one tensor"):
        optim.checkpoint(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="checkpoint: the module must return one tensor, got tuple"):
        optim.checkpoint(TwoOutputs(), torch.randn(2, requires_grad=True))



def four_products(model: nn.Module, loss, vec: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Gradient (plain and under ``create_graph``) and both Hessian-vector products of ``loss()``, a scalar function
    of ``model``'s parameters."""
    params = list(model.parameters())
    return {"gradient": list(torch.autograd.grad(loss(), params)),
            "gradient under create_graph": [g.detach() for g in torch.autograd.grad(loss(), params, create_graph=True)],
            "hvp reverse": list(optim.hvp(loss(), params, vec)),
            "hvp forward": list(optim.hvp(optim.functional(model, loss, params), params, vec, mode="forward"))}


def assert_same_products(model: nn.Module, plain, checkpointed, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    vec = [torch.randn_like(p) for p in model.parameters()]
    want, got = four_products(model, plain, vec), four_products(model, checkpointed, vec)
    for name in want:
        for a, b in zip(want[name], got[name], strict=True):
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=name)


class Product(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b.sin()


def test_shared_blocks_and_tied_inputs_are_counted_once() -> None:
    """Under create_graph the recomputation joins the graph; a saved tensor that another was computed from must not
    pass its gradient twice (the first version did: gradient and reverse-mode HVP wrong, forward mode right). One
    block applied twice, then a block given one tensor twice and a view of it."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"block": nn.Sequential(nn.Linear(3, 3), nn.Tanh()), "product": Product()}).double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss(call) -> torch.Tensor:
        h = call(model["block"], call(model["block"], x))
        return (call(model["product"], h, h) + call(model["product"], h, h[:, :1])).square().sum()

    assert_same_products(model, lambda: loss(lambda module, *inputs: module(*inputs)), lambda: loss(optim.checkpoint))


class ViewOfInput(nn.Module):
    """A block whose output is its input reshaped (the first half of a residual, an identity in place of a
    dropped layer), with a buffer it updates."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.view(x.shape)


@pytest.mark.parametrize("change", ["add_", "relu_inplace", "mul_"])
def test_the_output_can_be_modified_in_place(change: str) -> None:
    """``h = checkpoint(block, x); h += x`` (or an in-place ReLU) in every mode, also forward-over-reverse, where the
    output's tangent was a view that could not be modified in place."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"block": nn.Sequential(nn.Linear(3, 3), nn.GELU()), "head": nn.Linear(3, 2)}).double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss(call) -> torch.Tensor:
        h = call(model["block"], x * model["head"].bias.sum())
        if change == "add_":
            h += x
        elif change == "relu_inplace":
            h = F.relu(h, inplace=True)
        else:
            h.mul_(x)
        return model["head"](h).square().sum()

    assert_same_products(model, lambda: loss(lambda module, *inputs: module(*inputs)), lambda: loss(optim.checkpoint))


def test_an_output_that_is_a_view_of_the_input_stays_one() -> None:
    """The output keeps aliasing the input, as without checkpointing: an in-place change of it changes the input
    (checkpointing had copied it, so the loss and every derivative were silently those of another function). The
    module's buffers are updated once."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"view": ViewOfInput(), "head": nn.Linear(3, 3)}).double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss(call) -> torch.Tensor:
        inner = x * model["head"].weight.sum()
        h = call(model["view"], inner)
        h.mul_(3)
        return (model["head"](h) * inner).square().sum()

    assert_same_products(model, lambda: loss(lambda module, *inputs: module(*inputs)), lambda: loss(optim.checkpoint))
    calls = model["view"].calls.item()
    loss(optim.checkpoint).backward()
    assert model["view"].calls.item() == calls + 1


def test_buffers_are_updated_once_and_restored_for_the_recomputation() -> None:
    """Batch norm in training mode updates its running statistics inside the kernel (no new tensor version); the
    recomputations must neither update them again nor see the updated values."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, dtype=torch.float64)
    states = []
    for recompute in (False, True):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh()).double()
        products = four_products(model, lambda: (optim.checkpoint(model, x) if recompute else model(x)).square().sum(),
                                 [torch.ones_like(p) for p in model.parameters()])
        states.append((products, {k: v.clone() for k, v in model.state_dict().items()}))
    (want, want_state), (got, got_state) = states
    assert want_state["1.num_batches_tracked"] == 4  # one forward per product
    for name in want_state:
        torch.testing.assert_close(got_state[name], want_state[name], rtol=0, atol=0, msg=name)
    for name in want:
        for a, b in zip(want[name], got[name], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def test_a_captured_tensor_that_requires_grad_is_refused() -> None:
    """Its gradient would be lost: only inputs and parameters are differentiated in the recomputation."""
    encoder = nn.Linear(3, 3)
    memory = encoder(torch.randn(2, 3))

    class Attend(nn.Module):
        def forward(self, x):
            return x @ memory

    loss = optim.checkpoint(Attend(), torch.randn(2, 2, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="neither one of its inputs nor one of its parameters.*pass it to checkpoint"):
        loss.backward()


def test_a_module_that_modifies_its_input_in_place_is_refused() -> None:
    for requires_grad in (False, True):
        x = torch.randn(4, 3, requires_grad=requires_grad)
        x = x * 1 if requires_grad else x  # not a leaf: in-place is allowed on it
        block = nn.Sequential(nn.LeakyReLU(inplace=True), nn.Linear(3, 3))
        with pytest.raises(RuntimeError, match=r"checkpoint: the module modified inputs\[0\] in place"):
            optim.checkpoint(block, x)


def test_reverse_over_forward_is_refused() -> None:
    """The output's tangent is computed without a graph: differentiating it must raise, not return a wrong Hv."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    params = list(block.parameters())
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p.detach().requires_grad_(), torch.randn_like(p)) for p in params]
        loss = optim.functional(block, lambda: optim.checkpoint(block, x).square().sum(), params)(duals)
        with pytest.raises(RuntimeError, match="reverse-over-forward"):
            torch.autograd.grad(fwAD.unpack_dual(loss).tangent, duals)


def test_a_backward_after_the_forward_mode_level_ended_carries_no_tangents() -> None:
    """As without checkpointing: the first run's tangents belong to a level that is gone."""
    block = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    params = list(block.parameters())
    results = []
    for recompute in (False, True):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p.detach().requires_grad_(), torch.ones_like(p)) for p in params]
            loss = optim.functional(block, lambda: (optim.checkpoint(block, x) if recompute else block(x)).sum(),
                                    params)(duals)
        with fwAD.dual_level():
            grads = torch.autograd.grad(loss, duals)
            results.append([(g.detach().clone(), fwAD.unpack_dual(g).tangent) for g in grads])
    for (a, a_tangent), (b, b_tangent) in zip(*results, strict=True):
        torch.testing.assert_close(b, a)
        assert a_tangent is None and b_tangent is None


def test_an_output_that_needs_no_gradient_gets_none() -> None:
    class Detached(nn.Module):
        def forward(self, x):
            return x.detach() * 2

    x = torch.randn(3, requires_grad=True)
    out = optim.checkpoint(Detached(), x)
    (grad,) = torch.autograd.grad(out.sum(), [x], allow_unused=True)
    assert grad is None


# Attention outputs kept from the first run (flashbob.KeptAttention) and reused by the recomputation.


def checkpoint(module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """``optim.checkpoint`` keeping the module's flashbob attention outputs for the recomputation, as the recipe
    GPT's blocks do."""
    return optim.checkpoint(module, *inputs, kept=flashbob.KeptAttention())


class Attend(nn.Module):
    """Self-attention of ``x`` ``(batch, heads, n, 3 * head_dim)`` split into q, k, v, through flashbob."""

    def __init__(self, backend: str = "blocked", causal: bool = True):
        super().__init__()
        self.backend, self.causal = backend, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = x.chunk(3, dim=-1)
        return flashbob.attention(q, k, v, causal=self.causal, backend=self.backend)


@pytest.fixture
def attention_calls(monkeypatch) -> dict[str, int]:
    """How often the blocked backend's attention forward and forward tangent run (counted, then run)."""
    calls = {"forward": 0, "forward_jvp": 0}

    def counted(name: str):
        def run(*args, **kwargs):
            calls[name] += 1
            return getattr(blocked, name)(*args, **kwargs)
        return run

    monkeypatch.setattr(ATTENTION_MODULE, "BLOCKED",
                        dataclasses.replace(ATTENTION_MODULE.BLOCKED, forward=counted("forward"),
                                            forward_jvp=counted("forward_jvp")))
    return calls


@pytest.mark.parametrize("save_attention", [True, False])
def test_the_recomputation_reuses_the_attention_outputs(attention_calls, save_attention: bool) -> None:
    """The recipe GPT (3 blocks) gives the plain model's products either way; with save_attention the backend runs
    attention's forward and forward tangent as often as without checkpointing, without it more often."""
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp="gelu",
                attention="blocked", save_attention=save_attention).double()
    tokens = torch.randint(0, VOCAB, (2, 19))
    vec = [torch.randn_like(p) for p in model.parameters()]
    counts = {}
    for recompute in (False, True):
        model.checkpoint_activations = recompute
        attention_calls.update(forward=0, forward_jvp=0)
        counts[recompute] = products(model, tokens, vec, seed=5), dict(attention_calls)
    (plain, plain_calls), (checkpointed, checkpointed_calls) = counts[False], counts[True]
    for name in plain:
        for a, b in zip(plain[name], checkpointed[name], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)
    assert plain_calls["forward"] > 0 and plain_calls["forward_jvp"] > 0
    if save_attention:  # the recomputations ran no attention forward and no forward tangent
        assert checkpointed_calls == plain_calls
    else:
        assert all(checkpointed_calls[name] > plain_calls[name] for name in plain_calls)


class Remembering(Attend):
    """Keeps a reference to its last output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = super().forward(x)
        return self.last * 1


def test_a_kept_output_modified_in_place_is_computed_again(attention_calls) -> None:
    """A kept O changed in place after the first run (here through a reference the module kept) is not reused:
    the recomputation computes it again (without checkpointing the backward would refuse the changed O)."""
    x = torch.randn(1, 2, 7, 12, dtype=torch.float64, requires_grad=True)
    block = Remembering()
    y = checkpoint(block, x)
    with torch.no_grad():
        block.last.mul_(3)
    got = torch.autograd.grad(y.square().sum(), [x])[0]
    want = torch.autograd.grad(Attend()(x).square().sum(), [x])[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert attention_calls["forward"] == 3  # the first run, the recomputation, the plain block


def test_a_backward_twice_reuses_the_outputs_twice(attention_calls) -> None:
    x = torch.randn(2, 2, 9, 12, dtype=torch.float64, requires_grad=True)
    y = checkpoint(Attend(), x).sin().sum()
    first = torch.autograd.grad(y, [x], retain_graph=True)[0]
    second = torch.autograd.grad(y, [x])[0]
    want = torch.autograd.grad(Attend()(x).sin().sum(), [x])[0]
    torch.testing.assert_close(first, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second, want, rtol=1e-12, atol=1e-12)
    assert attention_calls["forward"] == 2  # the first run and the plain one


def test_a_recomputation_that_calls_attention_differently_runs_again_without_the_kept_outputs() -> None:
    """A block whose attention changed between the forward and the backward (here its causal flag; in practice its
    mode or attention implementation) gets, with a warning, what save_attention=False gives: a recomputation without
    the kept outputs."""
    x = torch.randn(1, 2, 5, 12, dtype=torch.float64, requires_grad=True)
    grads = []
    for save_attention in (False, True):
        block = Attend(causal=True)
        y = optim.checkpoint(block, x, kept=flashbob.KeptAttention() if save_attention else None).sum()
        block.causal = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads.append(torch.autograd.grad(y, [x])[0])
        assert [str(w.message)[:70] for w in caught] == ([] if not save_attention else [
            "checkpoint: the recomputation of a block called attention's forward di"])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


class TwoAttentions(nn.Module):
    """Two attention calls of one signature; the first through torch's SDPA instead of flashbob once ``switched``."""

    switched = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = x.chunk(3, dim=-1)
        first = F.scaled_dot_product_attention if self.switched else flashbob.attention
        o = first(q.contiguous(), k, v)
        return flashbob.attention(o.sin(), k, v)


def test_a_recomputation_that_takes_fewer_kept_outputs_runs_again_without_them() -> None:
    """Once switched, the recomputation's only flashbob call would take the first call's kept O (same signature);
    the count of kept outputs taken shows it, and the block runs again without them."""
    x = torch.randn(1, 2, 5, 12, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(TwoAttentions()(x).sum(), [x])[0]
    block = TwoAttentions()
    y = checkpoint(block, x).sum()
    block.switched = True
    with pytest.warns(RuntimeWarning, match="took fewer of the first run's attention outputs than it kept"):
        got = torch.autograd.grad(y, [x])[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class SelfAttention(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.proj = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).chunk(3, dim=-1)
        return x + flashbob.attention(q, k, v, causal=True, backend="blocked")


class CheckpointsWithGradOnly(nn.Module):
    """Checkpoints its first block only when grad is enabled (the recipe GPT's pattern), then runs a second."""

    def __init__(self):
        super().__init__()
        self.inner, self.own = SelfAttention(), SelfAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(checkpoint(self.inner, x) if torch.is_grad_enabled() else self.inner(x))


class LearnableKeyBias(nn.Module):
    """flashbob.sdpa with a float mask made from a parameter (it takes the exact fallback when the mask requires
    grad, the kernels when not), then with a plain key-padding mask."""

    def __init__(self, width: int = 8, keys: int = 7):
        super().__init__()
        self.first, self.second = nn.Linear(width, 3 * width), nn.Linear(width, 3 * width)
        self.bias = nn.Parameter(torch.zeros(keys))
        self.register_buffer("padding", torch.arange(keys) >= keys - 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.first(x).chunk(3, dim=-1)
        bias = torch.where(self.padding, float("-inf"), self.bias)
        x = x + flashbob.sdpa(q, k, v, attn_mask=bias[None, None, None, :], backend="blocked")
        q, k, v = self.second(x).chunk(3, dim=-1)
        return x + flashbob.sdpa(q, k, v, attn_mask=~self.padding, backend="blocked")


@pytest.mark.parametrize("make", [CheckpointsWithGradOnly, LearnableKeyBias])
def test_blocks_that_branch_on_grad_mode_or_requires_grad(make) -> None:
    """The first run used to run without grad and the recomputation with it: a block that branches on that made
    different attention calls, and a later call took an earlier call's kept O (gradient off by 40 and 20 in the
    two blocks here, HVPs by 2e3). The first run now runs under the recomputation's conditions."""
    torch.manual_seed(0)
    block = make().double()
    x = torch.randn(2, 2, 7, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flashbob.FallbackWarning)
        warnings.simplefilter("error", RuntimeWarning)  # no second recomputation either
        assert_same_products(block, lambda: block(x).square().sum(),
                             lambda: checkpoint(block, x).square().sum())


def test_an_encoder_layer_in_eval_mode_under_patch_sdpa() -> None:
    """In eval mode nn.TransformerEncoderLayer takes torch's fused fast path when no grad is needed: the first
    run, then without grad, kept nothing and the recomputation (through flashbob.sdpa) raised."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with flashbob.patch_sdpa(backend="blocked"):
        assert_same_products(layer, lambda: layer(x).square().sum(), lambda: checkpoint(layer, x).square().sum())


def test_the_backward_frees_the_kept_outputs(monkeypatch) -> None:
    """They hung on the graph's node: alive as long as the loss was (the next step's forward, a logged history)."""
    stores = []
    keep = kept.KeptOutputs.keep
    monkeypatch.setattr(kept.KeptOutputs, "keep",
                        lambda self, *args: (stores.append(weakref.ref(self)), keep(self, *args))[1])
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, attention="blocked",
                checkpoint_activations=True).double()
    tokens = torch.randint(0, VOCAB, (2, 9))
    for retain in (True, False):
        stores.clear()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward(retain_graph=retain)
        gc.collect()
        assert len(stores) >= 2 and all((ref() is None) != retain for ref in stores)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_outputs_through_both_backends_in_both_modes(backend: str) -> None:
    """Gradient (also under create_graph) and both HVP modes through a checkpointed linear + attention block equal
    the plain block's."""
    block = nn.Sequential(nn.Linear(12, 12), Attend(backend, causal=False)).double()
    x, = on_backend(backend, torch.randn(1, 2, 11, 12, dtype=torch.float64))
    block = block.to(x)

    assert_same_products(block, lambda: block(x).square().sum(), lambda: checkpoint(block, x).square().sum(),
                         rtol=exact_tolerance(x), atol=exact_tolerance(x))


class AliveStorages(OperationRecorder):
    """Records every tensor the operations inside it produce; :meth:`bytes` counts the storages still alive."""

    def __init__(self):
        super().__init__()
        self.produced = []

    def record(self, func, outputs: list[torch.Tensor]) -> None:
        self.produced += [weakref.ref(t) for t in outputs]

    def bytes(self, excluding: list[torch.Tensor]) -> int:
        gc.collect()
        known = {t.untyped_storage().data_ptr() for t in excluding}
        alive = {}
        for t in (r() for r in self.produced):
            try:
                storage = t.untyped_storage()
                alive[storage.data_ptr()] = storage.nbytes()
            except (AttributeError, RuntimeError):  # gone, or a wrapper without storage of its own
                continue
        return sum(size for pointer, size in alive.items() if pointer not in known)


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_the_first_run_keeps_no_activations(mode: str) -> None:
    """The first run records a graph (grad enabled, as the recomputation) that must go at the block's end; in
    forward mode such a graph held itself (outputs saved with their tangents) and kept every activation."""
    torch.manual_seed(0)
    block = GPT(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=4, mlp="gelu", attention="blocked").blocks[0]
    x = torch.randn(1, 512, 64, requires_grad=True)
    alive = {}
    for model in (block, Checkpointed(block)):
        params = dict(model.named_parameters())
        with fwAD.dual_level():
            if mode == "forward":
                params = {name: fwAD.make_dual(p, torch.randn_like(p)) for name, p in params.items()}
            tracked = AliveStorages()
            with tracked:
                y = torch.func.functional_call(model, params, (x,))
            alive[model is block] = tracked.bytes(excluding=[x, *block.parameters()])
            del y
    activation = x.numel() * x.element_size()
    assert alive[True] >= 20 * activation  # the plain forward keeps its activations (the measure sees them)
    # the output, the kept O and its statistics, in forward mode their tangents too (the leak kept 23 activations)
    assert alive[False] < (3 if mode == "reverse" else 5) * activation, alive


def test_the_recomputation_runs_in_the_attention_mode_of_the_first_run() -> None:
    """With attention="sdpa" the recipe GPT attends through torch's SDPA outside for_curvature and through flashbob
    inside; the optimizers take the backward outside it. The recomputation ran torch's SDPA, so it took none of the
    kept flashbob outputs (and a second-order backward on the GPU would differentiate SDPA twice): it now runs in the
    mode of the first run."""
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, mlp="gelu", attention="sdpa").double()
    tokens = torch.randint(0, VOCAB, (2, 17))
    params = list(model.parameters())
    vec = [torch.randn_like(p) for p in params]
    products = []
    for recompute in (False, True):
        model.checkpoint_activations = recompute
        with model.attention.for_curvature():
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            products.append(optim.hvp(loss, params, vec))
    for a, b in zip(*products, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_torch_func_transforms_run_the_module_plainly_with_a_warning() -> None:
    """They raised PyTorch's "must override the setup_context staticmethod" (the Function is not functorch's)."""
    block = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="under torch.func transforms"):
        got = torch.func.grad(lambda x: checkpoint(block, x).sum())(x)
    torch.testing.assert_close(got, torch.func.grad(lambda x: block(x).sum())(x), rtol=0, atol=0)
