"""optim.checkpoint: the recipe GPT with each block checkpointed gives the products of the plain model (gradient,
both Hessian-vector product modes, forward-mode Gauss-Newton products) in float64, with dropout and under autocast,
and leaves the random-number generator as the plain model does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import optim
from optim.curvature import CrossEntropyHessian, GGNOperator, active_dropout
from recipes.lm.model import GPT, cross_entropy

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
