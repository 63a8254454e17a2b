"""The long-context LM recipe at micro scale on the CPU: training, resume, logs, configs, data."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from wandb.proto import wandb_internal_pb2

from recipes.common import run_folder
from recipes.lm import checkpoint, data, optimizers
from recipes.lm.__main__ import main
from recipes.lm.model import GPT, cross_entropy
from recipes.lm.train import ConfigError, load_config, train
from recipes.meta.train import train as train_meta
from tests.test_meta import micro_config as meta_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "lm"
MICRO = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "data.max_bytes=200000", "data.val_fraction=0.1", "data.context_length=64", "data.batch_size=4",
    "optimizer.lr=1e-2", "optimizer.warmup_steps=4", "train.steps=20", "train.eval_interval=10",
    "train.eval_batches=2", "train.log_interval=1", "train.progress=false", "logger.kind=none",
]


def micro_config(tmp_path: Path, *overrides: str):
    return load_config(str(CONFIGS / "tiny.yaml"), [*MICRO, f"out_dir={tmp_path}", *overrides])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in row}


def wandb_records(path: Path):
    """Records of an offline ``run-*.wandb`` file: a 7-byte header, then a LevelDB-style log of
    32 KiB blocks whose chunks (CRC32C, length, kind: 1 full, 2 first, 3 middle, 4 last) carry
    serialised ``Record`` protobufs."""
    blob, block = path.read_bytes(), 1 << 15
    assert blob[:4] == b":W&B"
    position, pieces = 7, []
    while position + 7 <= len(blob):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", blob[position : position + 7])
        if kind == 0:
            break
        pieces.append(blob[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def test_adamw_loss_falls(tmp_path):
    summary = train(micro_config(tmp_path, "train.steps=30"))
    curve = losses(tmp_path / "tiny")
    assert sorted(curve) == list(range(1, 31))
    assert np.mean([curve[s] for s in (28, 29, 30)]) < np.mean([curve[s] for s in (1, 2, 3)]) - 1.0
    assert summary["val/loss"] < curve[1]


def test_resume_continues_exactly(tmp_path):
    """2N uninterrupted steps vs N steps then a resumed process: the same losses and weights, bit for bit."""
    settings = ("train.steps=16", "train.checkpoint_interval=8", "train.keep_checkpoints=0", "model.dropout=0.1")
    train(micro_config(tmp_path, "name=whole", *settings))
    halfway = tmp_path / "whole" / "checkpoints" / "step_00000008.pt"
    train(micro_config(tmp_path, "name=resumed", f"train.resume={halfway}", *settings))
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(9, 17))
    assert all(resumed[s] == whole[s] for s in resumed)
    final = [checkpoint.load(tmp_path / run / "checkpoints" / "step_00000016.pt")["model"]
             for run in ("whole", "resumed")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_resume_auto_and_command_line(tmp_path, capsys):
    """``--resume auto`` picks up the run's newest checkpoint and runs only the remaining steps."""
    args = ["--config", str(CONFIGS / "tiny.yaml"), *MICRO, f"out_dir={tmp_path}", "train.steps=6"]
    main(args)
    main([*args[:-1], "train.steps=10", "--resume", "auto"])
    steps = [row["step"] for row in read_jsonl(tmp_path / "tiny" / "metrics.jsonl") if "train/loss" in row]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert "val/loss=" in capsys.readouterr().err


def test_jsonl_log_holds_the_metrics(tmp_path):
    train(micro_config(tmp_path, "train.steps=10", "train.log_interval=5"))
    rows = read_jsonl(tmp_path / "tiny" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 5, 10]
    for key in ("train/loss", "train/perplexity", "train/tokens_per_s", "train/lr", "optimizer/grad_norm"):
        assert all(key in row for row in rows)
    assert rows[-1]["val/perplexity"] == pytest.approx(np.exp(rows[-1]["val/loss"]))
    assert (tmp_path / "tiny" / "config.yaml").is_file()


def test_wandb_offline_run_holds_the_logged_keys(tmp_path):
    train(micro_config(tmp_path, "train.steps=10", "logger.kind=wandb"))
    (run_file,) = (tmp_path / "tiny" / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.HasField("history")]
    assert [h["_step"] for h in history] == list(range(1, 11))
    for key in ("train/loss", "train/perplexity", "train/tokens_per_s", "train/lr", "optimizer/grad_norm"):
        assert all(key in h for h in history)
    assert "val/loss" in history[-1]
    (run,) = [r.run for r in records if r.HasField("run")]
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["d_model"] == 32 and config["data"]["context_length"] == 64


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.context_length=0"], "data.context_length must be > 0"),
        (["model.d_model=abc"], "'model.d_model'"),
        (["model.widht=3"], "'model.widht'"),
        (["optimizer.name=sgd"], "choose one of adahessian, adamw, newtoncg, sophiag, sophiah"),
        (["model.norm=batchnorm"], "model.norm must be one of rmsnorm, layernorm"),
        (["model.d_model=30"], "model.d_model (30) must be model.n_heads (4) times an even head_dim"),
        (["data.val_fraction=1.5"], "data.val_fraction must be in (0, 1)"),
        (["data.source=text", "data.path=/nonexistent/*.txt"], "data.path '/nonexistent/*.txt' matches no files"),
        (["data.source=binary", "data.path=/nonexistent.bin"], "data.path '/nonexistent.bin' is not a file"),
        (["name=../../escape"], "name must be a relative folder name inside out_dir, without '..'; got '../../escape'"),
        (["name=a/../../b"], "name must be a relative folder name inside out_dir, without '..'; got 'a/../../b'"),
        (["name=${oc.env:HOME}"], (f"name must be a relative folder name inside out_dir, without '..'; got "
                                   f"{str(Path.home())!r}")),
        (["name=."], "name must be a relative folder name inside out_dir, without '..'; got '.'"),
        (["name=${oc.env:FLASHBOB_UNSET_VARIABLE}"], ("bad config key 'name': KeyError raised while resolving "
                                                      "interpolation: \"Environment variable 'FLASHBOB_UNSET_VARIABLE' "
                                                      "not found\"")),
    ],
)
def test_bad_config_is_rejected_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as error:
        micro_config(tmp_path, *overrides)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nmodel: {d_model: 32\n", "is not valid YAML at line 3, column 1: did not find expected ',' or '}'"),
        ("train:\n  steps: 5\n    eval_interval: 2\n", ("is not valid YAML at line 3, column 18: mapping values are "
                                                        "not allowed in this context")),
        ("- name\n- tiny\n", "must hold a mapping of settings (key: value), not a list"),
    ],
)
def test_malformed_yaml_is_one_line_naming_the_file(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^config file {path} {re.escape(message)}$"):
        load_config(str(path))
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m recipes.lm: error: config file {path} {message}"


MISMATCHES = [
    (["optimizer.name=sophiah"], "holds AdamW optimizer state; this run's optimizer is SophiaH"),
    (["model.d_model=64"], ("does not fit this run's model: size mismatch for embed.weight: copying a param with "
                            "shape torch.Size([256, 32]) from checkpoint, the shape in current model is "
                            "torch.Size([256, 64]). (and 16 more)")),
    (["train.seed=1"], "does not fit this run's data: checkpoint data seed 0 differs from this run's 1"),
]


def test_resuming_a_checkpoint_of_another_model_or_optimizer_is_one_line(tmp_path, capsys):
    """Before: ``KeyError: 'update_period'`` (AdamW state into SophiaH), torch's multi-line size
    mismatch or Batches' ValueError, each with a traceback."""
    args = ["--config", str(CONFIGS / "tiny.yaml"), *MICRO, f"out_dir={tmp_path}", "train.steps=2"]
    main(args)
    source = tmp_path / "tiny" / "checkpoints" / "step_00000002.pt"
    for overrides, message in MISMATCHES:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main([*args[:-1], "train.steps=4", *overrides, "--resume", "auto"])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (f"python -m recipes.lm: error: train.resume: checkpoint "
                                                            f"{source} {message}")
    kept = OmegaConf.load(tmp_path / "tiny" / "config.yaml")
    assert (kept.optimizer.name, kept.model.d_model, kept.train.seed) == ("adamw", 32, 0), "config.yaml is untouched"


def test_resuming_another_recipes_checkpoint_is_one_line(tmp_path):
    train_meta(meta_config(tmp_path, "train.steps=1"))
    source = tmp_path / "meta_tiny" / "checkpoints" / "step_00000001.pt"
    with pytest.raises(ConfigError, match=f"^train.resume: checkpoint {source} holds Transformer model state; this "
                                          "run's model is GPT$"):
        train(micro_config(tmp_path, f"train.resume={source}"))


def test_bad_config_on_the_command_line_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(CONFIGS / "tiny.yaml"), "train.stpes=5"])
    assert exit_.value.code == 2
    assert "'train.stpes'" in capsys.readouterr().err


def test_logger_none_shorthand(tmp_path):
    assert micro_config(tmp_path, "logger=none").logger.kind == "none"


@pytest.mark.parametrize("name", ["gpu_8k", "gpu_32k", "gpu_64k"])
def test_gpu_configs_validate_and_build(name, tmp_path):
    """Each GPU config validates as written, and its model runs at its full size on a short sequence."""
    cfg = load_config(str(CONFIGS / f"{name}.yaml"))
    assert cfg.data.context_length == {"gpu_8k": 8192, "gpu_32k": 32768, "gpu_64k": 65536}[name]
    assert cfg.train.dtype == "bfloat16" and cfg.train.device == "cuda"
    model = GPT(**{**dict(cfg.model), "attention_backend": "blocked"})
    tokens = torch.randint(0, 256, (1, 17))
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    assert torch.isfinite(loss)


def test_corpus_split_is_deterministic_and_disjoint():
    first = data.load_corpus("stdlib", None, 300_000, 0.1, "uint8")
    second = data.load_corpus("stdlib", None, 300_000, 0.1, "uint8")
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert (len(first.train), len(first.val)) == (270_000, 30_000)
    train_bytes = first.train.tobytes()
    whole_val_documents = first.val.tobytes().split(data.SEPARATOR)[:-1]
    distinctive = [doc for doc in whole_val_documents if len(doc) > 2000]
    assert distinctive and not any(doc in train_bytes for doc in distinctive)


def test_text_and_binary_sources(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    text = data.load_corpus("text", str(tmp_path / "*.txt"), 100_000, 0.2, "uint8")
    assert data.decode(text.train[:9]) == "document "
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    binary = data.load_corpus("binary", str(tmp_path / "tokens.bin"), 0, 0.1, "uint16")
    assert list(binary.val[:2]) == [900, 901] and len(binary.train) == 900


def test_data_position_is_restored():
    tokens = data.encode("the quick brown fox jumps over the lazy dog. " * 40)
    batches = data.Batches(tokens, 16, 3, seed=7, split="train")
    for _ in range(5):
        batches.next()
    restored = data.Batches(tokens, 16, 3, seed=7, split="train")
    restored.load_state_dict(batches.state_dict())
    (x, y), (x2, y2) = batches.next(), restored.next()
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_partial_temporary_checkpoint_is_ignored(tmp_path):
    """A write killed before its rename leaves only a temporary file, which loading never sees."""
    directory = tmp_path / "tiny" / "checkpoints"
    good = checkpoint.save(directory, 5, {"step": 5, "weights": torch.arange(3.0)})
    (directory / ".step_00000010.pt.tmp-4242").write_bytes(b"PK\x03\x04 truncated mid-write")
    assert checkpoint.latest(directory) == good
    assert run_folder.resume("auto", tmp_path / "tiny")[0] == good
    assert checkpoint.load(good)["step"] == 5


def test_checkpoint_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, {"step": step}, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000002.pt", "step_00000003.pt"]


def test_model_is_twice_differentiable_with_activation_checkpointing():
    """Hessian-vector products agree with and without recomputation (what second-order optimizers need)."""
    tokens = torch.randint(0, 256, (2, 33))
    products = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp="gelu", norm="layernorm",
                    checkpoint_activations=recompute).double()
        params = list(model.parameters())
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        grads = torch.autograd.grad(loss, params, create_graph=True)
        vec = [torch.ones_like(p) for p in params]
        products.append(torch.autograd.grad(grads, params, vec))
    assert all(torch.allclose(a, b) for a, b in zip(*products))


class ClosureNewton(torch.optim.Optimizer):
    """A stand-in second-order optimizer: evaluates the closure, takes a gradient step, and reports
    the curvature ``g^T H g / |g|^2`` along it (an exact HVP through the model) in ``stats``."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})
        self.stats = {}

    @torch.no_grad()
    def step(self, closure):
        params = [p for group in self.param_groups for p in group["params"]]
        with torch.enable_grad():
            loss, logits = closure()
            grads = torch.autograd.grad(loss, params, create_graph=True)
            hg = torch.autograd.grad(grads, params, [g.detach() for g in grads])
        norm2 = sum(g.square().sum() for g in grads)
        self.stats = {"curvature": sum((g * h).sum() for g, h in zip(grads, hg)) / norm2, "logits_seen": logits.numel()}
        for p, g in zip(params, grads):
            p.sub_(self.param_groups[0]["lr"] * g)
        return loss


def test_second_order_step_through_a_closure(tmp_path, monkeypatch):
    """The recipe's closure path: no backward by the recipe, ``(loss, logits)`` returned, stats logged."""
    spec = optimizers.OptimizerSpec(__name__, "ClosureNewton", second_order=True, closure_returns_logits=True)
    monkeypatch.setitem(optimizers.REGISTRY, "closure_newton", spec)
    train(micro_config(tmp_path, "optimizer.name=closure_newton", "optimizer.lr=0.5", "train.steps=3"))
    rows = [row for row in read_jsonl(tmp_path / "tiny" / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == 3 and all(np.isfinite(row["optimizer/curvature"]) for row in rows)
    assert rows[0]["optimizer/logits_seen"] == 4 * 64 * 256


FEW_CG_ITERATIONS = {"newtoncg": ["optimizer.kwargs={max_cg_iters: 3}"]}


@pytest.mark.parametrize("name", sorted(n for n, s in optimizers.REGISTRY.items() if s.second_order))
def test_second_order_optimizers_train(name, tmp_path):
    """Each second-order optimizer of the registry trains the model a few steps and reports its stats."""
    try:
        optimizers.spec(name).load()
    except NotImplementedError as error:
        pytest.skip(str(error))
    train(micro_config(tmp_path, f"optimizer.name={name}", "optimizer.lr=1e-3", "train.steps=3",
                       *FEW_CG_ITERATIONS.get(name, [])))
    rows = [row for row in read_jsonl(tmp_path / "tiny" / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == 3 and all(np.isfinite(row["train/loss"]) for row in rows)
    assert any(key.startswith("optimizer/") for key in rows[-1])
