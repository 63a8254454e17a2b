"""What the three recipes share, on each at micro scale on the CPU: a bad setting is rejected naming
its key (the command line exits with the message), a resumed run continues exactly,
``--resume auto`` continues the metrics log and the same offline W&B run, the progress bar shows the
last validation loss, and the end of a run says where its outputs are and how long it took."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from recipes.common import checkpoint, cli, progress
from recipes.common.config import ConfigError
from tests.runs import RECIPES, ROOT, read_jsonl

NAME_ERROR = "name must be a relative folder name inside out_dir, without '..'; got "
# The rules of recipes/common, which every recipe applies: overrides, what the error says.
EVERY_RECIPE = [
    (["model.d_model=30"], "model.d_model (30) must be model.n_heads (4) times an even head_dim"),
    (["model.attention_backend=blocked"], "model.attention_backend is now model.attention (auto, triton or "
                                          "blocked: flashbob's backend; or eager)"),
    (["model.backend=triton"], "model.backend is now part of model.attention (auto, triton or blocked"),
    # a section given a value: the message was "bad config: None"
    (["model=3"], "bad config: Merge error: int is not a subclass of "),
    # numpy's generators (task and data order) take no negative seed: it failed inside the run, naming no key
    (["train.seed=-1"], "train.seed must be >= 0, got -1"),
    (["name=${oc.env:FLASHBOB_UNSET_VARIABLE}"], ("bad config key 'name': KeyError raised while resolving "
                                                  "interpolation: \"Environment variable "
                                                  "'FLASHBOB_UNSET_VARIABLE' not found\"")),
    *((["name=" + name], NAME_ERROR + repr(resolved)) for name, resolved in [
        ("../../up", "../../up"), ("a/../../b", "a/../../b"), ("runs/../..", "runs/../.."), (".", "."),
        ("/tmp/x", "/tmp/x"), ("${oc.env:HOME}", str(Path.home()))]),
]
# The attention each recipe takes: flashbob's backends and eager; the LM recipe also torch SDPA (flashbob on
# the passes an optimizer differentiates twice).
ATTENTION_CHOICES = {"lm": "auto, triton, blocked, eager, sdpa", "meta": "auto, triton, blocked, eager",
                     "ttt": "auto, triton, blocked, eager"}
# Each recipe's own settings: an unknown key or a value of the wrong type is rejected naming the key ...
MISSPELLED_OR_MISTYPED = {"lm": ["model.widht=3"], "meta": ["maml.inner_stesp=3", "task.n_way=abc"],
                          "ttt": ["ttt.inner_step=2", "ttt.inner_lr=fast"]}
# ... and these values are rejected as the message says: recipe, overrides, what the error says.
ONE_RECIPE = [
    ("lm", ["data.context_length=0"], "data.context_length must be > 0"),
    ("lm", ["optimizer.name=sgd"], "choose one of adahessian, adamw, newtoncg, sophiag, sophiah"),
    ("lm", ["model.norm=batchnorm"], "model.norm must be one of rmsnorm, layernorm"),
    ("lm", ["data.val_fraction=1.5"], "data.val_fraction must be in (0, 1)"),
    ("lm", ["data.source=text", "data.path=/nonexistent/*.txt"], "data.path '/nonexistent/*.txt' matches no files"),
    ("lm", ["data.source=binary", "data.path=/nonexistent.bin"], "data.path '/nonexistent.bin' is not a file"),
    # settings that were accepted and then ignored or misused without a word
    ("lm", ["optimizer.min_lr_ratio=3"], "optimizer.min_lr_ratio must be in [0, 1]"),
    ("lm", ["optimizer.kwargs={weight_decay: 0.5}"], "optimizer.kwargs.weight_decay would be ignored or clash: it is "
                                                     "set by optimizer.weight_decay (per parameter group)"),
    ("lm", ["optimizer.kwargs={distributed: true}"], "optimizer.kwargs.distributed would be ignored or clash"),
    ("lm", ["model.dropout=0.3", "optimizer.name=newtoncg", "optimizer.kwargs={mode: forward}"],
     "model.dropout=0.3 with newtoncg's optimizer.kwargs.mode=forward"),
    ("lm", ["model.mlp_ratio=0.02"], "model.mlp_ratio 0.02 gives the swiglu MLP of d_model 32 a hidden width of 0"),
    ("lm", ["model.checkpoint_activations=true", "model.attention=sdpa", "optimizer.name=sophiah"],
     "model.checkpoint_activations with model.attention=sdpa and the second-order optimizer sophiah"),
    ("meta", ["maml.inner_optimizer=rmsprop"], "maml.inner_optimizer must be one of sgd, adam"),
    ("meta", ["task.family=omniglot"], "task.family must be one of prototype, motif"),
    ("meta", ["maml.inner_steps=0"], "maml.inner_steps must be > 0"),
    ("meta", ["task.noise=1.5"], "task.noise must be in [0, 1]"),
    ("ttt", ["ttt.weights=norms"], "ttt.weights must be one of mlp, attn, block"),
    ("ttt", ["ttt.layers=3"], "ttt.layers (3) must be <= model.n_layers (2)"),
    ("ttt", ["ttt.inner_steps=-1"], "ttt.inner_steps must be >= 0"),
    ("ttt", ["data.continuation_length=0"], "data.continuation_length must be > 0"),
    ("ttt", ["data.source=text", "data.path=/nonexistent/**/*.txt"], "data.path '/nonexistent/**/*.txt' matches "
                                                                     "no files"),
]
BAD_CONFIGS = [
    *ONE_RECIPE,
    *((recipe, [setting], repr(setting.split("=")[0])) for recipe, settings in MISSPELLED_OR_MISTYPED.items()
      for setting in settings),
    *((recipe, overrides, message) for recipe in ("lm", "meta", "ttt") for overrides, message in EVERY_RECIPE),
    *((recipe, [f"model.attention={name}"], f"model.attention must be one of {choices}; got '{name}'")
      for recipe, choices in ATTENTION_CHOICES.items() for name in ("flashbob", "sdpa") if name not in choices),
]
# Each recipe's resumed run: its steps (cut at half) and settings. The LM's dropout draws from the
# global generator, so its states must be restored exactly too.
RESUMED = {"lm": (16, "model.dropout=0.1"), "meta": (6, "train.eval_interval=3"), "ttt": (6, "train.eval_interval=3")}
MEASURED = ("time", "train/tokens_per_s", "train/max_memory_gib", "meta_train/step_s")  # differ from run to run
# Each recipe's --resume auto run: MetaAdam's moments and first-order TTT go through a resume as well.
COMMAND_LINE = {"lm": (), "meta": ("maml.first_order=true", "maml.inner_optimizer=adam", "maml.inner_lr=0.01"),
                "ttt": ("ttt.first_order=true",)}


@pytest.mark.parametrize(("recipe", "overrides", "message"), BAD_CONFIGS)
def test_bad_config_is_rejected_naming_the_key(tmp_path, recipe, overrides, message):
    with pytest.raises(ConfigError) as error:
        RECIPES[recipe].config(tmp_path, *overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bad_config_on_the_command_line_exits_with_the_message(tmp_path, capsys, recipe):
    with pytest.raises(SystemExit) as exit_:
        RECIPES[recipe].main(RECIPES[recipe].arguments(tmp_path, "train.stpes=5"))
    assert exit_.value.code == 2
    assert "'train.stpes'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--config", "run.yaml", "a=1", "--resume", "auto", "b=2"],
    ["a=1", "--config", "run.yaml", "b=2", "--resume=auto"],
    ["--resume", "auto", "a=1", "b=2", "--config", "run.yaml"],
])
def test_options_may_stand_anywhere_among_the_overrides(argv, tmp_path):
    loaded = []
    config = OmegaConf.create({"name": "run", "out_dir": str(tmp_path), "train": {"resume": "auto"}})
    cli.run("lm", "", lambda path, overrides: loaded.append((path, overrides)) or config, lambda cfg: {},
            lambda key: True, argv)
    assert loaded == [("run.yaml", ["a=1", "b=2", "train.resume=auto"])]


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_continues_exactly(tmp_path, recipe):
    """2N uninterrupted steps vs N steps then a resumed process: the same logged metrics (but the
    measured times and memory) and the same final weights, bit for bit."""
    run = RECIPES[recipe]
    steps, setting = RESUMED[recipe]
    settings = (f"train.steps={steps}", f"train.checkpoint_interval={steps // 2}", "train.keep_checkpoints=0", setting)
    run.train(run.config(tmp_path, "name=whole", *settings))
    halfway = tmp_path / "whole" / "checkpoints" / f"step_{steps // 2:08d}.pt"
    run.train(run.config(tmp_path, "name=resumed", f"train.resume={halfway}", *settings))
    whole, resumed = ([{k: v for k, v in row.items() if k not in MEASURED}
                       for row in read_jsonl(tmp_path / name / "metrics.jsonl")] for name in ("whole", "resumed"))
    assert [row["step"] for row in resumed] == list(range(steps // 2 + 1, steps + 1))
    assert whole[steps // 2 :] == resumed
    final = [checkpoint.load(tmp_path / name / "checkpoints" / f"step_{steps:08d}.pt")["model"]
             for name in ("whole", "resumed")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


@pytest.mark.parametrize("recipe", RECIPES)
def test_command_line_resume_auto_and_wandb_offline(tmp_path, capsys, recipe):
    """``--resume auto`` runs only the remaining steps, prints the summary, and continues the same W&B run."""
    run = RECIPES[recipe]
    arguments = run.arguments(tmp_path, "logger.kind=wandb", *COMMAND_LINE[recipe])
    run.main([*arguments, "train.steps=2"])
    run.main([*arguments, "train.steps=4", "--resume", "auto"])
    assert [row["step"] for row in read_jsonl(tmp_path / run.run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert f"{run.printed}=" in capsys.readouterr().err
    run_files = list((tmp_path / run.run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2 and all(run.printed.encode() in f.read_bytes() for f in run_files)
    run_id = (tmp_path / run.run / "wandb_run_id").read_text().strip()
    assert all(f.name == f"run-{run_id}.wandb" for f in run_files), "the resumed process continues the same W&B run"


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_progress_bar_shows_the_last_validation_loss(tmp_path, recipe):
    """Drawn at every step (``TQDM_MININTERVAL=0``, which tqdm reads when imported: a process of its own), the
    bar shows ``val=`` from the first evaluation on, with the value of the latest one."""
    run = RECIPES[recipe]
    done = subprocess.run([sys.executable, "-m", f"recipes.{recipe}", *run.arguments(tmp_path, "train.progress=true")],
                          cwd=ROOT, env={**os.environ, "TQDM_MININTERVAL": "0"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = {}  # step: the bar's last drawing at that step
    for drawing in re.split(r"[\r\n]", done.stderr):
        counted = re.search(r"\| (\d+)/\d+ \[", drawing)
        if counted:
            shown[int(counted[1])] = drawing
    evaluated = {row["step"]: row[run.val_loss] for row in read_jsonl(tmp_path / run.run / "metrics.jsonl")
                 if run.val_loss in row}
    assert len(evaluated) >= 2 and sorted(shown) == list(range(max(shown) + 1))
    latest = None
    for step in range(1, max(shown) + 1):
        latest = evaluated.get(step, latest)
        assert "loss=" in shown[step]
        assert ("val=" in shown[step]) == (latest is not None), shown[step]
        assert latest is None or f"val={latest:.3f}" in shown[step], shown[step]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_end_of_a_run_says_where_its_outputs_are_and_how_long_it_took(tmp_path, capsys, recipe):
    """After the last step the command line prints the steps trained and the wall time, then the run folder,
    config, metrics log, last checkpoint and offline W&B folder (with the command that uploads it), each of
    which exists; then the summary metrics."""
    run = RECIPES[recipe]
    start = time.perf_counter()
    run.main(run.arguments(tmp_path, "train.steps=3", "logger.kind=wandb"))
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.splitlines()
    run_dir = tmp_path / run.run
    (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
    places = [f"  run folder   {run_dir}", f"  config       {run_dir / 'config.yaml'}",
              f"  metrics      {run_dir / 'metrics.jsonl'}",
              f"  checkpoint   {run_dir / 'checkpoints' / 'step_00000003.pt'}",
              f"  W&B offline  {wandb_dir}", f"  upload       wandb sync {wandb_dir}"]
    assert err[-len(places) - 1 : -1] == places
    assert all(Path(line.split()[-1]).exists() for line in places)
    heading = re.fullmatch(rf"{run.run}: trained steps 1-3 of 3; wall time (\d+\.\d) s", err[-len(places) - 2])
    assert heading and 0 < float(heading[1]) <= elapsed + 0.05
    assert f"{run.printed}=" in err[-1]


def test_durations_and_a_stopped_run_read_as_a_person_says_them(tmp_path):
    assert [progress.duration(s) for s in (0.04, 8.24, 59.94, 59.96, 185, 3599.4, 3599.6, 7620, 90_000)] == [
        "0.0 s", "8.2 s", "59.9 s", "1 min 00 s", "3 min 05 s", "59 min 59 s", "1 h 00 min", "2 h 07 min",
        "25 h 00 min"]
    lines = progress.report("tiny", tmp_path, 11, 12, 20, 75.0, None, {}).splitlines()
    assert lines[0] == "tiny: trained steps 11-12 of 20 (stopped by train.max_seconds); wall time 1 min 15 s"
    assert [line.split()[0] for line in lines[1:]] == ["run", "config", "metrics"], "no checkpoint, no W&B: not named"
