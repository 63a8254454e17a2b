"""optim with ``torch.compile``'d models: torch.compile cannot differentiate a compiled graph twice, so the
optimizers run their second-order passes eagerly and their first-order ones compiled, optim.functional runs
eagerly, and a reverse-mode product of a loss computed through a compiled model raises an error naming
torch.compile. Float64 on CPU, AOTAutograd backends (the ones that refuse double backward)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import optim

DTYPE = torch.float64
CLASSES = 5


class CountingBackend:
    """An AOTAutograd backend (as inductor and aot_eager are) that counts the runs of its compiled forwards."""

    def __init__(self) -> None:
        self.runs = 0

        def forward_compiler(graph, example_inputs):
            def run(*args):
                self.runs += 1
                return graph(*args)
            return make_boxed_func(run)

        self.backend = aot_autograd(fw_compiler=forward_compiler)


@pytest.fixture
def compiled(gen):
    """A small MLP (float64), its compiled form, data, and the counting backend."""
    torch._dynamo.reset()
    torch.manual_seed(int(torch.randint(2**31, (), generator=gen)))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, CLASSES)).to(DTYPE)
    counting = CountingBackend()
    x = torch.randn(6, 4, dtype=DTYPE, generator=gen)
    y = torch.randint(CLASSES, (6,), generator=gen)
    yield model, torch.compile(model, backend=counting.backend), x, y, counting
    torch._dynamo.reset()


def test_a_reverse_mode_product_of_a_compiled_loss_names_torch_compile(compiled):
    model, compiled_model, x, y, _ = compiled
    params = list(model.parameters())
    vec = [torch.randn_like(p) for p in params]
    with pytest.raises(RuntimeError, match="torch.compile'd model.*set_stance"):
        optim.hvp(F.cross_entropy(compiled_model(x), y), params, vec)
    with pytest.raises(RuntimeError, match="torch.compile'd model"):
        optim.ggnvp(None, compiled_model(x), params, vec, optim.CrossEntropyHessian(y))
    with torch.compiler.set_stance("force_eager"):  # the way out the message gives
        loss = F.cross_entropy(compiled_model(x), y)
    eager = optim.hvp(F.cross_entropy(model(x), y), params, vec)
    torch.testing.assert_close(optim.hvp(loss, params, vec), eager, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_functional_runs_a_compiled_model_eagerly(compiled, mode):
    model, compiled_model, x, y, _ = compiled
    params = list(model.parameters())
    vec = [torch.randn_like(p) for p in params]
    through_compiled = optim.functional(model, lambda: F.cross_entropy(compiled_model(x), y), params)
    plain = optim.functional(model, lambda: F.cross_entropy(model(x), y), params)
    torch.testing.assert_close(optim.hvp(through_compiled, params, vec, mode=mode),
                               optim.hvp(plain, params, vec, mode=mode), rtol=1e-12, atol=1e-14)


OPTIMIZERS = {
    "SophiaH reverse": lambda p, m: optim.SophiaH(p, lr=1e-2, update_period=2, generator=torch.Generator().manual_seed(0)),
    "SophiaH forward": lambda p, m: optim.SophiaH(p, lr=1e-2, update_period=2, mode="forward", module=m,
                                                  generator=torch.Generator().manual_seed(0)),
    "SophiaG": lambda p, m: optim.SophiaG(p, lr=1e-2, update_period=2, generator=torch.Generator().manual_seed(0)),
    "AdaHessian": lambda p, m: optim.AdaHessian(p, lr=1e-2, generator=torch.Generator().manual_seed(0)),
    "NewtonCG reverse": lambda p, m: optim.NewtonCG(p, lr=0.5, max_cg_iters=3),
    "NewtonCG forward": lambda p, m: optim.NewtonCG(p, lr=0.5, max_cg_iters=3, mode="forward", module=m),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_step_a_compiled_model_as_the_eager_one(compiled, name):
    """The same steps as with the eager model (to rounding), the first-order evaluations compiled: SophiaH's
    non-refresh steps and SophiaG's steps run the compiled forward."""
    model, compiled_model, x, y, counting = compiled
    initial = [p.detach().clone() for p in model.parameters()]
    finals = []
    for run in (model, compiled_model):
        with torch.no_grad():
            for p, value in zip(model.parameters(), initial):
                p.copy_(value)
        opt = OPTIMIZERS[name](list(model.parameters()), model)

        def closure(run=run):
            logits = run(x)
            return {"loss": F.cross_entropy(logits, y), "outputs": logits, "targets": y}

        for _ in range(4):
            opt.step(closure)
        finals.append([p.detach().clone() for p in model.parameters()])
    torch.testing.assert_close(finals[1], finals[0], rtol=1e-10, atol=1e-12)
    if name.startswith(("SophiaH", "SophiaG")):
        assert counting.runs > 0, "no first-order evaluation ran the compiled forward"
