"""Optimizer state checkpointed on one device and loaded on another: saved on the GPU and loaded on
the CPU (``map_location="cpu"``), and the reverse.

The GPU tests need CUDA and the compiled Triton kernels; on a GPU machine run::

    TRITON_INTERPRET=0 python -m pytest tests/test_checkpoint_devices.py

(``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` unless told otherwise, and CI has no GPU: there
they are skipped). For every optimizer of ``optim`` and ``torch.optim.AdamW`` a tiny float32
transformer whose attention is ``flashbob.attention`` (Triton kernels on the GPU, the blocked
backend on the CPU) trains a few steps on one device; model and optimizer ``state_dict`` go through
``torch.save``/``torch.load``, are loaded into a fresh model and optimizer on the other device, and
one more step there must match one more step on the first device from the same state, to float32
rounding. No state tensor may stay behind on the other device.

The CPU tests check what can be checked without a GPU: every optimizer's state follows its
parameters to another device on load ('meta' stands in for CUDA), and the recipes' resume copes
with generator states of another device type (a CUDA generator's state does not fit a CPU
generator) and with checkpoints written on a machine with more GPUs.
"""

from __future__ import annotations

import copy
import io
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import optim
from optim import AdaHessian, NewtonCG, SophiaG, SophiaH
from recipes.common.transformer import Transformer

GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA and TRITON_INTERPRET=0 (tests/conftest.py sets 1 on a machine without CUDA)",
)
FACTORIES = {
    "NewtonCG": lambda p: NewtonCG(p, preconditioner="hutchinson", max_cg_iters=5),
    "NewtonCG-hessian": lambda p: NewtonCG(p, curvature="hessian", preconditioner="squared_gradients", max_cg_iters=5),
    "SophiaH": lambda p: SophiaH(p, lr=1e-2, update_period=3),
    "SophiaG": lambda p: SophiaG(p, lr=1e-2, update_period=3),
    "AdaHessian": lambda p: AdaHessian(p, lr=1e-2),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
}
# Sophia refreshes its estimate at steps 0 and 3 (update_period 3); the compared step, the 5th, uses
# the state that travelled (a refresh there would draw labels from the device's own generator).
STEPS = 4


class Probes:
    """Hutchinson probes drawn on the CPU from one generator and moved to the parameters' device, so
    that both devices take the same probes (CPU and CUDA generators draw different streams)."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def __call__(self, params, distribution, generator):
        return tuple((torch.randint(0, 2, p.shape, generator=self.generator).to(p.dtype) * 2 - 1).to(p.device)
                     for p in params)


@pytest.fixture
def probes(monkeypatch) -> Probes:
    probes = Probes()
    monkeypatch.setattr(optim.diagonal, "_probe", probes)
    # Not what is tested here, and slow: tuning compiles and times every candidate launch config.
    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "0")
    return probes


def lm_problem(device):
    gen = torch.Generator().manual_seed(3)
    start = torch.randint(0, 16, (6, 1), generator=gen)
    tokens = (start + torch.arange(13) * torch.randint(1, 3, (6, 1), generator=gen)) % 16
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def new_model(device) -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab_size=16, n_outputs=16, d_model=16, n_heads=2, n_kv_heads=1, n_layers=2).to(device)


def train_step(opt, model, x, y) -> None:
    def closure():
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits

    if isinstance(opt, torch.optim.AdamW):
        opt.zero_grad()
        closure()[0].backward()
        opt.step()
    else:
        opt.step(closure)


def tensors(tree):
    """Every tensor in a nested dict/list/tuple, with its path."""
    if isinstance(tree, torch.Tensor):
        yield "", tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            for path, tensor in tensors(value):
                yield f"/{key}{path}", tensor
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            for path, tensor in tensors(value):
                yield f"/{index}{path}", tensor


def assert_state_on(opt, device_type: str) -> None:
    """Every optimizer state tensor is on ``device_type`` (AdamW's ``step`` counter stays on the CPU
    by torch's design, unless capturable or fused)."""
    state = opt.state_dict()["state"]
    stray = [f"{path} on {t.device}" for path, t in tensors(state)
             if t.device.type != device_type and not (path.endswith("/step") and t.device.type == "cpu")]
    assert not stray, f"state tensors off {device_type}: {stray}"


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def continue_on_both(name, probes, source: str, target: str, load) -> None:
    """Train on ``source``, checkpoint, ``load`` the bytes for ``target``; then one step on each
    device from that state, which must agree."""
    x, y = lm_problem(source)
    model = new_model(source)
    opt = FACTORIES[name](model.parameters())
    probes.reseed(1)
    for _ in range(STEPS):
        train_step(opt, model, x, y)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = load(buffer)

    moved = new_model(target)
    moved.load_state_dict(saved["model"])
    moved_opt = FACTORIES[name](moved.parameters())
    moved_opt.load_state_dict(saved["optimizer"])
    assert_state_on(moved_opt, target)
    assert torch.equal(flat(moved), flat(model))

    before = flat(model)
    probes.reseed(2)
    train_step(moved_opt, moved, *lm_problem(target))
    probes.reseed(2)
    train_step(opt, model, x, y)
    assert_state_on(moved_opt, target)
    assert_state_on(opt, source)
    on_target, on_source = flat(moved), flat(model)
    update = on_source - before
    assert update.abs().max() > 0, "the step moved nothing"
    assert (on_target - before - update).norm() <= 1e-3 * update.norm(), f"{name}: the two devices' steps differ"
    torch.testing.assert_close(on_target, on_source, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- GPU


@GPU
@pytest.mark.parametrize("name", FACTORIES)
def test_saved_on_gpu_loaded_on_cpu_continues_like_the_gpu(name, probes):
    def load(buffer):
        saved = torch.load(buffer, map_location="cpu")
        stray = [path for path, t in tensors(saved) if t.device.type != "cpu"]
        assert not stray, f"map_location='cpu' left tensors on another device: {stray}"
        return saved

    continue_on_both(name, probes, "cuda", "cpu", load)


@GPU
@pytest.mark.parametrize("name", FACTORIES)
def test_saved_on_cpu_loaded_on_gpu_continues_like_the_cpu(name, probes):
    continue_on_both(name, probes, "cpu", "cuda", torch.load)


@GPU
def test_lm_checkpoint_written_on_gpu_resumes_on_cpu(tmp_path, probes):
    """The recipes' checkpoint module: a checkpoint of CUDA state loads with every tensor on
    the CPU, into a CPU model and optimizer, and its random-number states restore there."""
    from recipes.common import checkpoint

    x, y = lm_problem("cuda")
    model = new_model("cuda")
    opt = SophiaH(model.parameters(), lr=1e-2, update_period=3)
    for _ in range(STEPS):
        train_step(opt, model, x, y)
    rng = checkpoint.rng_state()
    assert rng["cuda"], "a CUDA machine records its CUDA generator states"
    path = checkpoint.save(tmp_path, STEPS, {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng})
    state = checkpoint.load(path)
    assert all(t.device.type == "cpu" for _, t in tensors(state))
    moved = new_model("cpu")
    moved.load_state_dict(state["model"])
    moved_opt = SophiaH(moved.parameters(), lr=1e-2, update_period=3)
    moved_opt.load_state_dict(state["optimizer"])
    assert_state_on(moved_opt, "cpu")
    checkpoint.set_rng_state(state["rng"])
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    assert torch.equal(torch.cuda.get_rng_state(), state["rng"]["cuda"][0])
    train_step(moved_opt, moved, *lm_problem("cpu"))
    assert torch.isfinite(flat(moved)).all()


@GPU
def test_lm_resume_with_a_gpu_generator_state_on_cpu_warns_and_goes_on():
    """A second-order optimizer's probe generator (data parallel runs have one) saved on the GPU
    cannot continue on the CPU: a warning, and a fresh generator."""
    from recipes.common import checkpoint

    cuda_generator = torch.Generator("cuda").manual_seed(5)
    cpu_generator = torch.Generator().manual_seed(6)
    rng = checkpoint.rng_states(cuda_generator)
    assert rng["optimizer_device"] == "cuda"
    fresh = cpu_generator.get_state()
    with pytest.warns(RuntimeWarning, match="does not fit"):
        checkpoint.restore_rng({"rng": rng, "rng_ranks": [rng]}, cpu_generator)
    assert torch.equal(cpu_generator.get_state(), fresh)
    assert torch.equal(torch.get_rng_state(), rng["torch"]), "the global generators are restored all the same"
    checkpoint.set_rng_state(rng)


# ----------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("name", FACTORIES)
def test_optimizer_state_follows_the_parameters_to_another_device(name, probes):
    """Loaded into parameters on another device ('meta' standing in for CUDA), every state tensor
    moves there: none of the optimizers keeps state that ``load_state_dict`` would not move."""
    x, y = lm_problem("cpu")
    model = new_model("cpu")
    opt = FACTORIES[name](model.parameters())
    for _ in range(2):
        train_step(opt, model, x, y)
    saved = opt.state_dict()
    assert any(True for _ in tensors(saved["state"])), "the optimizer has tensor state"
    assert not list(tensors(saved["param_groups"])), "tensors in param_groups would not follow the parameters"
    on_meta = copy.deepcopy(model).to("meta")
    moved = FACTORIES[name](on_meta.parameters())
    moved.load_state_dict(saved)
    assert_state_on(moved, "meta")


def test_lm_resume_with_another_devices_generator_state_warns_and_keeps_a_fresh_one():
    from recipes.common import checkpoint

    generator = torch.Generator().manual_seed(6)
    rng = checkpoint.rng_states(generator)
    assert rng["optimizer_device"] == "cpu"
    cuda_like = {**rng, "optimizer": torch.zeros(16, dtype=torch.uint8), "optimizer_device": "cuda"}  # Philox: seed, offset
    old_format = {key: value for key, value in cuda_like.items() if key != "optimizer_device"}
    for saved in (cuda_like, old_format):  # recorded device type, or (older checkpoints) set_state refuses
        torch.manual_seed(123)
        fresh = generator.get_state()
        with pytest.warns(RuntimeWarning, match="does not fit this run's cpu generator"):
            checkpoint.restore_rng({"rng": saved, "rng_ranks": [saved]}, generator)
        assert torch.equal(generator.get_state(), fresh), "the generator is left as it was"
        assert torch.equal(torch.get_rng_state(), rng["torch"]), "the global generators are restored"
    checkpoint.set_rng_state(rng)


def test_lm_resume_restores_a_same_device_generator_exactly():
    from recipes.common import checkpoint

    generator = torch.Generator().manual_seed(6)
    rng = checkpoint.rng_states(generator)
    expected = torch.rand(4, generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.restore_rng({"rng": rng, "rng_ranks": [rng]}, generator)
    assert torch.equal(torch.rand(4, generator=generator), expected)


def test_cuda_rng_states_are_cut_to_the_gpus_there_are(monkeypatch):
    """A checkpoint written on a machine with more GPUs restores the first ones (before: an
    invalid-device error); without CUDA, CUDA states are skipped."""
    from recipes.common import checkpoint

    rng = checkpoint.rng_state()
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    states = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]
    checkpoint.set_rng_state({**rng, "cuda": states})
    assert len(restored) == 1 and torch.equal(restored[0], states[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    restored.clear()
    checkpoint.set_rng_state({**rng, "cuda": states})
    assert restored == []


def test_rng_state_round_trip_restores_python_numpy_and_torch_generators():
    """set_rng_state(rng_state()) puts each global generator back where it was: the draws after a restore repeat the
    draws after the save. No test looked at Python's generator: not restoring it (random.setstate dropped) went
    unnoticed, the resume tests comparing only what torch draws."""
    import random

    import numpy as np

    from recipes.common import checkpoint

    saved = checkpoint.rng_state()

    def draws():
        return random.random(), float(np.random.random()), float(torch.rand(()))

    first = draws()
    draws()  # move every generator on
    checkpoint.set_rng_state(saved)
    assert draws() == first
