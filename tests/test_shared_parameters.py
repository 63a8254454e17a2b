"""Modules that hold one parameter in several places: a block registered more than once (a universal or
weight-tied transformer, ``nn.ModuleList([block] * 3)``), a block shared by two parents, and a weight tied across
modules (embedding and output head). Every path of optim that swaps a module's parameters (``optim.functional``,
``optim.checkpoint``, the optimizers' ``module=``) must compute the plain model's values and leave the module
holding its own Parameters.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import optim
from optim.swap import swapped

DTYPE = torch.float64
VOCAB, WIDTH, LENGTH = 7, 6, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, dtype=DTYPE)
        self.norm = nn.LayerNorm(WIDTH, dtype=DTYPE)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Model(nn.Module):
    """An embedding, some blocks, a head; ``checkpointed`` runs every block through optim.checkpoint."""

    def __init__(self, layout: str, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype=DTYPE)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=DTYPE)
        block = Block()
        if layout == "repeated":  # one block registered three times
            self.blocks = nn.ModuleList([block] * 3)
        elif layout == "shared":  # one block in two parents
            self.blocks = nn.ModuleList([block, Block()])
            self.refine = nn.Sequential(block)
        elif layout == "tied":  # embedding and head hold one weight
            self.blocks = nn.ModuleList([block])
            self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in [*self.blocks, *getattr(self, "refine", [])]:
            h = optim.checkpoint(block, h) if self.checkpointed else block(h)
        return self.head(h)


class Whole(nn.Module):
    """``model`` checkpointed as one block."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return optim.checkpoint(self.model, tokens)


LAYOUTS = ["repeated", "shared", "tied"]


def problem(layout: str, gen: torch.Generator, checkpointed: bool = False):
    torch.manual_seed(int(torch.randint(2**31, (), generator=gen)))
    model = Model(layout, checkpointed)
    tokens = torch.randint(VOCAB, (2, LENGTH), generator=gen)
    targets = torch.randint(VOCAB, (2, LENGTH), generator=gen)
    return model, tokens, targets


def loss_of(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def slots(module: nn.Module) -> list[tuple[int, str, int]]:
    """What each parameter slot holds, by identity, reached under every name."""
    return [(id(m), name, id(p)) for _, m in module.named_modules(remove_duplicate=False)
            for name, p in m._parameters.items()]


def assert_unchanged(model: nn.Module, before: list, params: list[nn.Parameter]) -> None:
    assert slots(model) == before, "the module's parameter slots hold other tensors than before"
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]


def reference_hvp(layout, gen_seed, vec):
    """The Hessian-vector product of the plain model by reverse-over-reverse autograd."""
    model, tokens, targets = problem(layout, torch.Generator().manual_seed(gen_seed))
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model, tokens, targets), params, create_graph=True)
    return torch.autograd.grad(grads, params, vec)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swapped_restores_every_slot_and_replaces_tied_ones(layout, gen):
    model, _, _ = problem(layout, gen)
    before, params = slots(model), list(model.parameters())
    values = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    with pytest.raises(ZeroDivisionError), swapped(model, values):
        assert not any(type(p) is nn.Parameter for _, m in model.named_modules(remove_duplicate=False)
                       for p in m._parameters.values())
        assert all(float(p.abs().sum()) == 0 for p in model.parameters())
        1 / 0
    assert_unchanged(model, before, params)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_functional_hvp_is_exact_and_leaves_the_module_as_found(layout, checkpointed, mode, gen):
    seed = int(torch.randint(2**31, (), generator=gen))
    model, tokens, targets = problem(layout, torch.Generator().manual_seed(seed), checkpointed)
    params = list(model.parameters())
    before = slots(model)
    vec = [torch.randn(p.shape, dtype=DTYPE, generator=gen) for p in params]
    loss = optim.functional(model, lambda: loss_of(model, tokens, targets), params)
    for _ in range(2):  # the second call runs without the parameter watch
        hv = optim.hvp(loss, params, vec, mode=mode)
        assert_unchanged(model, before, params)
        torch.testing.assert_close(hv, reference_hvp(layout, seed, vec), rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(loss_of(model, tokens, targets), params)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointing_the_whole_model_trains_it(layout, gen):
    """SGD through optim.checkpoint around the whole model makes the same steps as without it."""
    seed = int(torch.randint(2**31, (), generator=gen))
    losses, finals = [], []
    for checkpointed in (False, True):
        model, tokens, targets = problem(layout, torch.Generator().manual_seed(seed))
        params, before = list(model.parameters()), slots(model)
        run = Whole(model) if checkpointed else model
        sgd = torch.optim.SGD(params, lr=0.5)
        history = []
        for _ in range(3):
            sgd.zero_grad()
            loss = loss_of(run, tokens, targets)
            loss.backward()
            assert all(p.grad is not None for p in params)
            sgd.step()
            history.append(loss.item())
        assert_unchanged(model, before, params)
        losses.append(history)
        finals.append([p.detach().clone() for p in params])
    assert losses[1][-1] < losses[1][0]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(finals[1], finals[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointed_blocks_give_exact_forward_hvps(layout, gen):
    """optim.checkpoint per block, forward-over-reverse through optim.functional: the plain model's product."""
    seed = int(torch.randint(2**31, (), generator=gen))
    model, tokens, targets = problem(layout, torch.Generator().manual_seed(seed), checkpointed=True)
    params, before = list(model.parameters()), slots(model)
    vec = [torch.randn(p.shape, dtype=DTYPE, generator=gen) for p in params]
    hv = optim.hvp(optim.functional(model, lambda: loss_of(model, tokens, targets), params), params, vec,
                   mode="forward")
    assert_unchanged(model, before, params)
    torch.testing.assert_close(hv, reference_hvp(layout, seed, vec), rtol=1e-10, atol=1e-12)


OPTIMIZERS = {
    "SophiaH": lambda params, model: optim.SophiaH(params, lr=1e-2, update_period=1, mode="forward", module=model,
                                                   generator=torch.Generator().manual_seed(0)),
    "NewtonCG": lambda params, model: optim.NewtonCG(params, lr=0.5, mode="forward", module=model, max_cg_iters=3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_mode_optimizers_keep_the_modules_parameters(name, layout, gen):
    """The optimizers that swap parameters (forward mode with ``module=``) step through tied models and leave
    them holding their Parameters (SophiaH used to fail on its second step)."""
    model, tokens, targets = problem(layout, gen)
    params, before = list(model.parameters()), slots(model)
    opt = OPTIMIZERS[name](params, model)
    start = [p.detach().clone() for p in params]

    def closure():
        logits = model(tokens).flatten(0, 1)
        return {"loss": F.cross_entropy(logits, targets.flatten()), "outputs": logits, "targets": targets.flatten()}

    for _ in range(3):
        opt.step(closure)
        assert_unchanged(model, before, params)
    assert all(not torch.equal(p, s) for p, s in zip(params, start))
