"""The long-context LM recipe at micro scale on the CPU: training, logs, configs, checkpoints of another
model, data, the model, the optimizers (what all three recipes share is tested in test_recipes.py)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from wandb.proto import wandb_internal_pb2

from optim import functional, hvp
from recipes.common import checkpoint, data, run_folder
from recipes.common.config import ConfigError
from recipes.common.transformer import Transformer, silu
from recipes.lm import optimizers
from recipes.lm.__main__ import main
from recipes.lm.model import GPT, cross_entropy
from recipes.lm.train import load_config, train
from tests.runs import LM, META, read_jsonl


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
    summary = train(LM.config(tmp_path, "train.steps=30"))
    curve = losses(tmp_path / "tiny")
    assert sorted(curve) == list(range(1, 31))
    assert np.mean([curve[s] for s in (28, 29, 30)]) < np.mean([curve[s] for s in (1, 2, 3)]) - 1.0
    assert summary["val/loss"] < curve[1]


def test_jsonl_log_holds_the_metrics(tmp_path):
    train(LM.config(tmp_path, "train.steps=10", "train.log_interval=5"))
    rows = read_jsonl(tmp_path / "tiny" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 5, 10]
    for key in ("train/loss", "train/perplexity", "train/tokens_per_s", "train/lr", "optimizer/grad_norm"):
        assert all(key in row for row in rows)
    assert rows[-1]["val/perplexity"] == pytest.approx(np.exp(rows[-1]["val/loss"]))
    assert (tmp_path / "tiny" / "config.yaml").is_file()


def test_wandb_offline_run_holds_the_logged_keys(tmp_path):
    train(LM.config(tmp_path, "train.steps=10", "logger.kind=wandb"))
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
    # the optimizer state and the scheduler's base lr would bring the saved values back, silently
    (["optimizer.lr=0.05"], ("ran with optimizer.lr=0.01, this run asks for 0.05; the resumed optimizer state "
                             "would keep the saved value: drop the change, or start a new run")),
    (["optimizer.weight_decay=0.3"], "ran with optimizer.weight_decay=0.1, this run asks for 0.3;"),
    (["optimizer.kwargs={amsgrad: true}"], "ran with optimizer.kwargs={}, this run asks for {'amsgrad': True};"),
]


def test_resuming_a_checkpoint_of_another_model_or_optimizer_is_one_line(tmp_path, capsys):
    """Before: ``KeyError: 'update_period'`` (AdamW state into SophiaH), torch's multi-line size
    mismatch or Batches' ValueError, each with a traceback."""
    args = LM.arguments(tmp_path, "train.steps=2")
    main(args)
    source = tmp_path / "tiny" / "checkpoints" / "step_00000002.pt"
    for overrides, message in MISMATCHES:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main([*args[:-1], "train.steps=4", *overrides, "--resume", "auto"])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"python -m recipes.lm: error: train.resume: checkpoint {source} {message}"
        )
    kept = OmegaConf.load(tmp_path / "tiny" / "config.yaml")
    assert (kept.optimizer.name, kept.model.d_model, kept.train.seed) == ("adamw", 32, 0), "config.yaml is untouched"


def test_resuming_another_recipes_checkpoint_is_one_line(tmp_path):
    META.train(META.config(tmp_path, "train.steps=1"))
    source = tmp_path / "meta_tiny" / "checkpoints" / "step_00000001.pt"
    with pytest.raises(ConfigError, match=f"^train.resume: checkpoint {source} holds Transformer model state; this "
                                          "run's model is GPT$"):
        train(LM.config(tmp_path, f"train.resume={source}"))


def test_logger_none_shorthand(tmp_path):
    assert LM.config(tmp_path, "logger=none").logger.kind == "none"


@pytest.mark.parametrize("name", ["gpu_8k", "gpu_32k", "gpu_64k", "bpe_32k"])
def test_gpu_configs_validate_and_build(name, tmp_path):
    """Each GPU config validates as written, and its model runs at its full size (its vocabulary: bytes, or
    the 32,768 BPE tokens it asks for) on a short sequence."""
    cfg = load_config(str(LM.configs / f"{name}.yaml"))
    assert cfg.data.context_length == {"gpu_8k": 8192, "gpu_32k": 32768, "gpu_64k": 65536, "bpe_32k": 8192}[name]
    assert cfg.train.dtype == "bfloat16" and cfg.train.device == "cuda"
    vocab_size = cfg.data.vocab_size if cfg.data.tokenizer == "bpe" else 256
    model = GPT(**{**dict(cfg.model), "vocab_size": vocab_size, "attention": "blocked"})
    tokens = torch.randint(0, vocab_size, (1, 17))
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


def test_attention_setting_picks_flashbob_or_eager_attention():
    """``model.attention``: flashbob's blocked backend and naive eager attention give the same logits."""
    tokens = torch.randint(0, 256, (2, 17))
    logits = {}
    for attention in ("blocked", "eager"):
        torch.manual_seed(0)
        logits[attention] = GPT(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention).double()(tokens)
    torch.testing.assert_close(logits["blocked"], logits["eager"], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="attention must be one of auto, triton, blocked, eager, sdpa, got 'flashbob'"):
        GPT(attention="flashbob")


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


def test_swiglu_model_takes_forward_over_reverse_hessian_products():
    """The default GPT (SwiGLU, RMSNorm, flashbob) takes ``optim.hvp(..., mode="forward")``: its silu has a
    forward-mode rule of its backward (``F.silu``'s has none in torch 2.13), and the product equals
    reverse-over-reverse's in float64; first-order passes keep ``F.silu``."""
    tokens = torch.randint(0, 256, (2, 17))
    torch.manual_seed(0)
    model = GPT(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention="blocked").double()
    params = list(model.parameters())
    vec = [torch.randn_like(p) for p in params]
    loss = functional(model, lambda: cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]), params)
    forward = hvp(loss, params, vec, mode="forward")
    reverse = hvp(loss, params, vec, mode="reverse")
    for a, b in zip(forward, reverse, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.autograd.forward_ad.dual_level():
        gate = torch.autograd.forward_ad.make_dual(torch.randn(3), torch.ones(3))
        assert type(silu(gate).grad_fn).__name__ != "SiluBackward0"
    assert type(silu(torch.randn(3, requires_grad=True)).grad_fn).__name__ == "SiluBackward0"


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
    monkeypatch.setitem(optimizers.OPTIMIZERS, "closure_newton", ClosureNewton)
    train(LM.config(tmp_path, "optimizer.name=closure_newton", "optimizer.lr=0.5", "train.steps=3"))
    rows = [row for row in read_jsonl(tmp_path / "tiny" / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == 3 and all(np.isfinite(row["optimizer/curvature"]) for row in rows)
    assert rows[0]["optimizer/logits_seen"] == 4 * 64 * 256


FEW_CG_ITERATIONS = {"newtoncg": ["optimizer.kwargs={max_cg_iters: 3}"]}


@pytest.mark.parametrize("name", sorted(n for n, c in optimizers.OPTIMIZERS.items() if optimizers.is_second_order(c)))
def test_second_order_optimizers_train(name, tmp_path):
    """Each second-order optimizer of the registry trains the model a few steps and reports its stats."""
    train(LM.config(tmp_path, f"optimizer.name={name}", "optimizer.lr=1e-3", "train.steps=3",
                       *FEW_CG_ITERATIONS.get(name, [])))
    rows = [row for row in read_jsonl(tmp_path / "tiny" / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == 3 and all(np.isfinite(row["train/loss"]) for row in rows)
    assert any(key.startswith("optimizer/") for key in rows[-1])
    assert "NaN" not in (tmp_path / "tiny" / "metrics.jsonl").read_text()


@pytest.mark.parametrize(("name", "statistic", "settings"), [
    ("sophiah", "hessian_rows", ["optimizer.kwargs={update_period: 2}"]),
    ("newtoncg", "reduction_ratio", ["optimizer.kwargs={max_cg_iters: 3, backtrack: false, line_search: false, "
                                     "adapt_damping: false}"]),
])
def test_an_optimizer_statistic_without_a_value_is_left_out_of_the_log(name, statistic, settings, tmp_path):
    """The optimizers write NaN where a statistic has no value at a step: SophiaH's ``hessian_rows`` on the steps
    between refreshes, NewtonCG's ``reduction_ratio`` without a line search. The log leaves it out of those rows
    (so the comparison's CSV cell is empty), and has it on the others."""
    train(LM.config(tmp_path, f"optimizer.name={name}", "optimizer.lr=1e-3", "train.steps=3", *settings))
    rows = [row for row in read_jsonl(tmp_path / "tiny" / "metrics.jsonl") if "train/loss" in row]
    has = [f"optimizer/{statistic}" in row for row in rows]
    assert has == ([True, False, True] if name == "sophiah" else [False] * 3)
    assert all("optimizer/step_skipped" in row for row in rows)
    assert "NaN" not in (tmp_path / "tiny" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("name", ["adamw", "sophiah"])
def test_a_compiled_model_trains_as_the_eager_one(name, tmp_path):
    """``train.compile=true``: the first-order passes run the compiled model and SophiaH's refresh steps run it
    eagerly (torch.compile cannot differentiate twice); the losses are those of the eager model."""
    runs = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        train(LM.config(out, f"optimizer.name={name}", "optimizer.lr=1e-3", "train.steps=3", "model.n_layers=1",
                        f"train.compile={str(compiled).lower()}", "optimizer.kwargs={update_period: 2}"
                        if name == "sophiah" else "train.eval_interval=3"))
        runs[compiled] = [row["train/loss"] for row in read_jsonl(out / "tiny" / "metrics.jsonl")
                          if "train/loss" in row]
    assert len(runs[True]) == 3
    np.testing.assert_allclose(runs[True], runs[False], rtol=1e-4)


def test_optimizer_weight_decay_in_kwargs_and_a_zero_width_mlp_are_refused():
    """A weight_decay among the constructor's kwargs was stored as its default and then overridden by the
    recipe's parameter groups (0.1 and 0.0), so it had no effect; an mlp_ratio that rounds the hidden width to 0
    built MLPs that always output 0 (both accepted without a word)."""
    model = GPT(vocab_size=16, d_model=8, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match="build_optimizer: weight_decay goes in its weight_decay argument"):
        optimizers.build_optimizer(model, "sophiah", {}, {"weight_decay": 0.5}, 0.1, False)
    with pytest.raises(ValueError, match="optimizer.kwargs: newtoncg .* takes no argument update_period; it takes lr"):
        optimizers.build_optimizer(model, "newtoncg", {}, {"update_period": 3}, 0.1, False)  # was a raw TypeError
    groups = optimizers.build_optimizer(model, "sophiah", {}, {}, 0.5, False).param_groups
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    for make in (lambda: GPT(vocab_size=16, d_model=8, n_layers=1, n_heads=2, mlp="gelu", mlp_ratio=0.05),
                 lambda: Transformer(vocab_size=16, n_outputs=16, d_model=8, n_heads=2, mlp_ratio=0.05)):
        with pytest.raises(ValueError, match=r"mlp_ratio 0.05 gives the (gelu )?MLP of d_model 8 a hidden width of 0"):
            make()


def test_text_split_does_not_depend_on_where_the_corpus_lies_or_how_the_glob_spells_it(tmp_path, monkeypatch):
    """The split hashes each file's name below the glob's folder, not the path as spelled: a moved corpus, an
    absolute or a ./ pattern keep their held-out documents (else a resume trains on them)."""
    for where in ("a", "b"):
        for i in range(40):
            (tmp_path / where / "sub").mkdir(parents=True, exist_ok=True)
            (tmp_path / where / "sub" / f"doc{i}.txt").write_text(f"document {i} " * 50)
    monkeypatch.chdir(tmp_path)
    splits = [data.load_corpus("text", pattern, 10**6, 0.2, "uint8")
              for pattern in (str(tmp_path / "a/**/*.txt"), "a/**/*.txt", "./a/**/*.txt", str(tmp_path / "b/**/*.txt"))]
    assert len(splits[0].val) and all(np.array_equal(s.val, splits[0].val) for s in splits)
    assert data.text_sources("a/**/*.txt")[0][0] == "sub/doc0.txt"


def test_a_file_name_that_is_not_utf8_is_split_by_its_bytes(tmp_path):
    """A name's bytes (``os.fsencode``) decide its split, so a name that is not UTF-8 (Latin-1) is read like any."""
    for i in range(20):
        (tmp_path / f"doc{i}.py").write_text(f"x = {i}\n" * 100)
    name = b"caf\xe9.py"
    (tmp_path / os.fsdecode(name)).write_text("latin_one_name = True\n" * 100)
    corpus = data.load_corpus("text", str(tmp_path / "*.py"), 10**6, 0.2, "uint8")
    held_out = int.from_bytes(hashlib.sha256(name).digest()[:8], "big") < 0.2 * 2**64
    assert b"latin_one_name" in (corpus.val if held_out else corpus.train).tobytes()


@pytest.mark.parametrize("names", [["only.txt"], ["b.txt", "c.txt", "part1.txt"]])
def test_files_whose_names_all_hash_to_one_split_are_cut_by_position(tmp_path, names):
    """A glob of one file (or of a few, all hashing to one split) would leave a split empty: the files are joined
    and their last data.val_fraction held out. Data too short for a window still says what to raise."""
    assert len({data.is_validation(name, 0.1) for name in names}) == 1
    text = "".join(f"line {i} of the text\n" for i in range(2000))
    for name in names:
        (tmp_path / name).write_text(text)
    stream = (text.encode() + data.SEPARATOR) * len(names)
    cut = len(stream) - int(len(stream) * 0.1)
    corpus = data.load_corpus("text", str(tmp_path / "*.txt"), 10**6, 0.1, "uint8")
    assert corpus.train.tobytes() == stream[:cut] and corpus.val.tobytes() == stream[cut:]
    text_data = ("data.source=text", f"data.path={tmp_path / '*.txt'}", "train.steps=1", "train.eval_interval=1")
    assert np.isfinite(train(LM.config(tmp_path, *text_data))["val/loss"])
    with pytest.raises(ValueError, match=r"^the validation split has 50 tokens, fewer than data.context_length \+ 1 = "
                                         r"65; raise data.max_bytes or data.val_fraction, or shorten the context$"):
        train(LM.config(tmp_path, *text_data, "name=short", "data.max_bytes=1000", "data.val_fraction=0.05"))


def test_resume_refuses_other_training_windows():
    """A checkpoint's data position only means something for the same windows: another corpus, split
    (data.val_fraction, data.max_bytes), tokenizer or context length is refused, not silently resumed."""
    tokens = data.encode("the quick brown fox jumps over the lazy dog. " * 40)
    state = data.Batches(tokens, 16, 3, seed=7, split="train").state_dict()
    data.Batches(tokens, 16, 4, seed=7, split="train").load_state_dict({**state, "index": 4, "global_batch": 4})
    for other in (data.Batches(tokens[:-50], 16, 3, seed=7, split="train"),
                  data.Batches(tokens, 8, 3, seed=7, split="train"),
                  data.Batches(tokens.astype(np.uint16), 16, 3, seed=7, split="train")):
        with pytest.raises(ValueError, match="training windows .* differ from this run's"):
            other.load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "fingerprint"}  # checkpoints written before the check
    data.Batches(tokens[:-50], 16, 3, seed=7, split="train").load_state_dict(old)


def test_validation_counts_each_window_at_most_once():
    """train.eval_batches beyond the validation windows (a small split, many processes) is cut to one pass."""
    from recipes.lm.train import validation_batches

    assert validation_batches(8, 220, 8) == 8
    with pytest.warns(RuntimeWarning, match="exceed the validation split's 220 windows; evaluating 6"):
        assert validation_batches(8, 220, 32) == 6
    with pytest.warns(RuntimeWarning):
        assert validation_batches(8, 5, 8) == 1


def test_binary_uint32_tokens_hold_vocabularies_above_65536(tmp_path):
    tokens = np.array([0, 70_000, 128_255] * 100, dtype=np.uint32)
    tokens.tofile(tmp_path / "tokens.bin")
    corpus = data.load_corpus("binary", str(tmp_path / "tokens.bin"), 0, 0.1, "uint32")
    assert int(corpus.train.max()) == 128_255 and len(corpus.train) + len(corpus.val) == 300


@pytest.mark.parametrize(("warmup", "steps"), [(3, 10), (0, 6), (20, 200)])
def test_lr_schedule_warms_up_and_ends_at_min_lr_ratio_on_the_last_step(warmup, steps):
    """optimizer.warmup_steps / min_lr_ratio: linear warm-up to the peak, then a cosine that ends at min_lr_ratio * lr
    on the last step (the lr it ran was 0.145 lr there for 10 steps with 3 of warm-up: the floor was reached only by
    the scheduler's step after the last optimizer step)."""
    from recipes.common.schedule import build_scheduler

    weight = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([weight], lr=2.0)
    scheduler, lrs = build_scheduler(opt, warmup, steps, 0.1), []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(2.0 / warmup if warmup else 2.0)
    if warmup:
        assert lrs[warmup - 1] == pytest.approx(2.0)
    assert lrs[warmup] == pytest.approx(2.0) and max(lrs) == pytest.approx(2.0)
    assert lrs[-1] == pytest.approx(0.2) and min(lrs[warmup:]) == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))


def test_resume_with_more_steps_runs_the_new_schedule_from_its_first_step():
    """README: on a resume train.steps and the warm-up may change. The scheduler restored only its step count, and the
    optimizer state brought back the lr the saved schedule had set, so the first resumed step ran the old schedule's
    lr (0.65 lr here instead of the new 0.998 lr) and only the next ones the new schedule's."""
    from recipes.common.schedule import build_scheduler, warmup_cosine

    def built(steps):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        return opt, build_scheduler(opt, 2, steps, 0.1)

    opt, scheduler = built(10)
    for _ in range(5):
        opt.step()
        scheduler.step()
    state = run_folder.snapshot(optimizer=opt, scheduler=scheduler)
    resumed, resumed_scheduler = built(100)
    run_folder.restore(Path("step_5.pt"), state, optimizer=resumed, scheduler=resumed_scheduler)
    assert resumed.param_groups[0]["lr"] == pytest.approx(2.0 * warmup_cosine(2, 100, 0.1)(5))
    assert resumed_scheduler.get_last_lr() == [resumed.param_groups[0]["lr"]]
    resumed.step()
    resumed_scheduler.step()
    assert resumed.param_groups[0]["lr"] == pytest.approx(2.0 * warmup_cosine(2, 100, 0.1)(6))


@pytest.mark.parametrize(("override", "message"), [
    ("model.dropout=1.0", r"model.dropout must be in \[0, 1\)"), ("model.dropout=1.5", r"model.dropout must be in \[0, 1\)"),
    ("model.rope_base=0", "model.rope_base must be > 0"), ("model.rope_base=-10000", "model.rope_base must be > 0")])
def test_dropout_of_one_and_a_non_positive_rope_base_are_refused(override, message):
    """model.dropout=1 zeroed every attention and MLP output in training (the blocks did nothing, the run went on),
    1.5 failed only when the model was built, in torch's words; rope_base 0 or below gave NaN rotary angles, seen
    only as a non-finite loss at step 1. All were accepted by the config, against 'bad values are rejected with an
    error naming the key'."""
    with pytest.raises(ConfigError, match=message):
        load_config(str(LM.configs / "tiny.yaml"), [override])
    load_config(str(LM.configs / "tiny.yaml"), ["model.dropout=0.5", "model.rope_base=1"])


def test_zero_or_negative_kv_heads_are_refused():
    """n_kv_heads=0 was read as None (n_heads key/value heads: the model silently ran without grouped-query attention)
    and -2 failed in torch with 'negative dimension'."""
    for n_kv_heads in (0, -2):
        with pytest.raises(ValueError, match=rf"n_heads \(4\) must be a positive multiple of n_kv_heads \({n_kv_heads}\)"):
            GPT(vocab_size=16, d_model=16, n_layers=1, n_heads=4, n_kv_heads=n_kv_heads)
    assert GPT(vocab_size=16, d_model=16, n_layers=1, n_heads=4).blocks[0].attn.n_kv_heads == 4


@pytest.mark.parametrize("betas", ["[0.9]", "[0.9,0.99,0.5]", "[0.9,1.0]"])
def test_betas_other_than_two_numbers_in_0_1_are_refused(betas):
    """optimizer.betas with three numbers ran AdamW on the first two without a word; one number failed at the build
    with torch's 'tuple index out of range'."""
    with pytest.raises(ConfigError, match=r"optimizer.betas must be two numbers in \[0, 1\) or null"):
        load_config(str(LM.configs / "tiny.yaml"), [f"optimizer.betas={betas}"])
    assert load_config(str(LM.configs / "tiny.yaml"), ["optimizer.betas=[0.9,0.95]"]).optimizer.betas == [0.9, 0.95]


def test_document_ids_end_each_document_with_its_separator():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    assert data.document_ids(tokens).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]


def test_window_and_packed_documents_are_the_dense_masks_of_eager_attention():
    """model.window and packed documents: the GPT on flashbob equals the GPT on naive attention with the same
    dense mask, and a token's logits do not depend on tokens outside its window or its document."""
    torch.manual_seed(0)
    tokens = torch.randint(1, 256, (2, 24))
    tokens[0, 9] = tokens[1, 3] = 0  # separators: documents end there
    ids = data.document_ids(tokens)
    models = {name: GPT(vocab_size=256, d_model=32, n_layers=2, n_heads=4, attention=name, window=6).double()
              for name in ("auto", "eager")}
    models["eager"].load_state_dict(models["auto"].state_dict())
    logits = {name: model(tokens, ids) for name, model in models.items()}
    torch.testing.assert_close(logits["auto"], logits["eager"], rtol=1e-10, atol=1e-10)
    changed = tokens.clone()
    changed[0, 3] = (changed[0, 3] + 1) % 255 + 1  # in document 0 (positions 0-9)
    moved = models["auto"](changed, ids)
    torch.testing.assert_close(moved[0, 10:], logits["auto"][0, 10:], rtol=0, atol=0)  # document 1 never sees it
    assert (moved[0, 3:10] - logits["auto"][0, 3:10]).abs().max() > 0


def test_the_recipe_trains_with_a_window_and_packed_documents(tmp_path):
    summary = train(LM.config(tmp_path, "train.steps=3", "model.window=16", "data.pack_documents=true",
                              "optimizer.name=sophiah", "optimizer.lr=1e-3", "optimizer.kwargs={update_period: 2}"))
    assert np.isfinite(summary["val/loss"])
    with pytest.raises(ConfigError, match="model.window must be a positive number"):
        load_config(None, ["model.window=0"])
