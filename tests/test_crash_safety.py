"""Crash safety of the recipes' checkpoints and run folders: a run killed mid-write, a disk that
fills up, a rename that is refused, a checkpoint folder that cannot be made, corrupt checkpoint
files (every flipped bit and zeroed block detected, ``--resume auto`` falling back past them), a
second run on a folder in use, a second run of a config (a numbered folder of its own), leftover
temporary files and a log that continues without repeats.
The shared machinery (``recipes.common.run_folder``) is exercised through all three recipes."""

from __future__ import annotations

import errno
import functools
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from benchmarks.environment import child_environment
from recipes.common import checkpoint, run_folder
from recipes.common.config import ConfigError
from recipes.common.logger import drop_rows_after, wandb_run_id
from tests.runs import LM, META, RECIPES, ROOT, read_jsonl

# A model whose checkpoint (weights and AdamW moments, ~40 MB) takes far longer to write than the
# poll below takes to notice its temporary file, and a checkpoint after every step.
SLOW_WRITES = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4", "model.n_layers=4",
               "data.context_length=16", "data.batch_size=1", "train.checkpoint_interval=1",
               "train.keep_checkpoints=2", "train.eval_interval=100000"]


def run_recipe(tmp_path: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "recipes.lm", *LM.arguments(tmp_path, "train.threads=1", *SLOW_WRITES, *extra)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=child_environment())


def kill_mid_write(tmp_path: Path, directory: Path, timeout: float = 120.0) -> Path:
    """Start a run and SIGKILL it the moment a checkpoint's temporary file appears, once at least
    one checkpoint is finished; return the temporary file it left (proof the kill hit mid-write)."""
    process = run_recipe(tmp_path, "train.steps=100000", "train.resume=auto")  # a retry continues the killed run
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and process.poll() is None:
            names = os.listdir(directory) if directory.is_dir() else []
            temporary = [n for n in names if n.startswith(".step_")]
            if temporary and checkpoint.checkpoints(directory):
                process.send_signal(signal.SIGKILL)
                process.wait()
                return directory / temporary[0]
            time.sleep(0.0005)
        pytest.fail(f"no checkpoint write to interrupt: {process.stderr.read().decode()[-2000:]}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_sigkill_mid_checkpoint_write_keeps_the_last_good_one_and_resumes(tmp_path):
    directory = tmp_path / "tiny" / "checkpoints"
    for _attempt in range(3):  # the kill usually lands mid-write at once; a late one is retried
        temporary = kill_mid_write(tmp_path, directory)
        if temporary.exists():
            break
    else:
        pytest.fail("the SIGKILL never landed while a checkpoint was being written")
    good = checkpoint.latest(directory)
    assert good is not None and temporary.name not in {p.name for p in checkpoint.checkpoints(directory)}
    step = checkpoint.load(good)["step"]
    assert good.name == f"step_{step:08d}.pt"

    resumed = run_recipe(tmp_path, "train.resume=auto", f"train.steps={step + 2}")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr.decode()[-2000:]
    assert checkpoint.load(checkpoint.latest(directory))["step"] == step + 2


class FillsUp(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails like a full disk."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            self.file.write(bytes(data[: self.room]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)


def test_disk_full_while_training_is_reported_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    """The second checkpoint hits a full disk half-way: a clear error names the file and the cause
    (torch.save itself would only say 'unexpected pos'), the temporary file is gone and training
    resumes from the first checkpoint."""
    cfg = LM.config(tmp_path, "train.steps=4", "train.checkpoint_interval=2")
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            return real_save(obj, FillsUp(f, room=5000), *args, **kwargs)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    directory = tmp_path / "tiny" / "checkpoints"
    with pytest.raises(checkpoint.CheckpointWriteError, match="step_00000004.pt: No space left on device") as info:
        LM.train(cfg)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(directory) == ["step_00000002.pt"]
    assert checkpoint.load(directory / "step_00000002.pt")["step"] == 2
    monkeypatch.setattr(torch, "save", real_save)
    with pytest.warns(RuntimeWarning, match="dropped 2 row\\(s\\) logged past step 2"):  # steps 3-4, logged again
        LM.train(LM.config(tmp_path, "train.steps=4", "train.checkpoint_interval=2", "train.resume=auto"))
    assert checkpoint.load(checkpoint.latest(directory))["step"] == 4


def test_refused_rename_removes_the_temporary_file(tmp_path, monkeypatch):
    first = checkpoint.save(tmp_path, 1, {"step": 1})

    def refuse(source, target):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target))

    monkeypatch.setattr(checkpoint.os, "replace", refuse)
    with pytest.raises(checkpoint.CheckpointWriteError, match="step_00000002.pt: Permission denied") as info:
        checkpoint.save(tmp_path, 2, {"step": 2})
    assert info.value.errno == errno.EACCES
    assert os.listdir(tmp_path) == [first.name] and checkpoint.load(first)["step"] == 1


def test_checkpoint_folder_that_cannot_be_made_is_named(tmp_path):
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(checkpoint.CheckpointWriteError, match=f"could not write checkpoint {blocker}/step_00000001.pt"):
        checkpoint.save(blocker, 1, {"step": 1})


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", b"not a checkpoint at all"])
def test_unreadable_checkpoint_is_named_with_the_earlier_ones(tmp_path, content):
    checkpoint.save(tmp_path, 1, {"step": 1})
    broken = tmp_path / "step_00000002.pt"
    broken.write_bytes(content)
    with pytest.raises(checkpoint.CheckpointReadError, match=r"step_00000002.pt cannot be read .*step_00000001.pt"):
        checkpoint.load(broken)


# ------------------------------------------------------------------ damaged checkpoints, run folders

def flip_bit(path: Path, bit: int) -> None:
    content = bytearray(path.read_bytes())
    content[bit // 8] ^= 1 << bit % 8
    path.write_bytes(bytes(content))


def random_damage(clean: bytes, gen: torch.Generator, flips: int, blocks: int) -> list[bytes]:
    """``flips`` copies of ``clean`` with one bit flipped and ``blocks`` with one aligned 4 KiB
    block zeroed (one that held a nonzero byte), at fresh random positions."""
    damaged = []
    for _ in range(flips):
        bit = int(torch.randint(len(clean) * 8, (1,), generator=gen))
        content = bytearray(clean)
        content[bit // 8] ^= 1 << bit % 8
        damaged.append(bytes(content))
    while len(damaged) < flips + blocks:
        start = 4096 * int(torch.randint(-(-len(clean) // 4096), (1,), generator=gen))
        content = bytearray(clean)
        content[start : start + 4096] = bytes(len(content[start : start + 4096]))
        if content != clean:
            damaged.append(bytes(content))
    return damaged


def test_every_bit_flip_and_zeroed_block_is_detected(tmp_path, gen):
    """A real checkpoint (micro LM weights, AdamW moments, data and RNG state, ~400 KB): 20 random
    single-bit flips and 20 random zeroed 4 KiB blocks, each refused naming the file; the intact
    file loads."""
    LM.train(LM.config(tmp_path, "train.steps=2"))
    path = tmp_path / "tiny" / "checkpoints" / "step_00000002.pt"
    clean = path.read_bytes()
    detected = 0
    for content in random_damage(clean, gen, flips=20, blocks=20):
        path.write_bytes(content)
        with pytest.raises(checkpoint.CheckpointReadError, match=f"^checkpoint {path} cannot be read"):
            checkpoint.load(path)
        detected += 1
    assert detected == 40
    path.write_bytes(clean)
    assert checkpoint.load(path)["step"] == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_auto_on_a_fresh_run_starts_from_scratch(tmp_path, recipe):
    run = RECIPES[recipe]
    run.train(run.config(tmp_path, "train.steps=2", "train.resume=auto"))
    assert [row["step"] for row in read_jsonl(tmp_path / run.run / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in checkpoint.checkpoints(tmp_path / run.run / "checkpoints")] == ["step_00000002.pt"]


def test_a_fresh_run_in_a_folder_with_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """Without a resume, a run folder holding checkpoints is refused, and nothing in it changes. Before:
    the fresh run's pruning (keep 2 of step 2 new, 4 and 6 earlier) deleted its own step-2 checkpoint,
    and ``--resume auto`` then continued the earlier run's step 6 as if it were this run's."""
    settings = ("train.checkpoint_interval=2", "train.keep_checkpoints=2", "train.eval_interval=100")
    META.train(META.config(tmp_path, "train.steps=6", *settings))
    run_dir = tmp_path / META.run
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    log = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError) as error:
        META.train(META.config(tmp_path, "train.steps=4", "train.seed=1", *settings))
    assert str(error.value).startswith(f"{run_dir} holds the checkpoints of an earlier run (newest: step_00000006.pt); "
                                       "continue it with --resume auto")
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before
    assert (run_dir / "metrics.jsonl").read_text() == log
    META.train(META.config(tmp_path, "train.steps=8", "train.resume=auto", *settings))  # continuing it is fine
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 9))


def test_a_second_run_of_a_config_gets_a_numbered_folder_and_resume_auto_continues_the_newest(tmp_path, capsys):
    """Run the same command twice: the second run trains in ``tiny_2`` (saying so) and leaves ``tiny`` as it was;
    ``--resume auto`` continues ``tiny_2``, the newest; run again once finished, it says so, prints the run's last
    metrics and writes nothing."""
    first, second = tmp_path / "tiny", tmp_path / "tiny_2"
    LM.main(LM.arguments(tmp_path, "train.steps=2"))
    kept = contents(first)
    capsys.readouterr()
    LM.main(LM.arguments(tmp_path, "train.steps=2"))
    assert capsys.readouterr().err.splitlines()[0] == (
        f"python -m recipes.lm: {first} holds an earlier run; this run writes to {second} (--resume auto continues "
        "the newest run, name=... chooses the folder)")
    assert [row["step"] for row in read_jsonl(second / "metrics.jsonl")] == [1, 2] and contents(first) == kept
    assert OmegaConf.load(second / "config.yaml").name == "tiny_2"

    summary = LM.main(LM.arguments(tmp_path, "train.steps=4", "--resume", "auto"))
    assert capsys.readouterr().err.splitlines()[0] == f"python -m recipes.lm: continuing {second}, the newest run of tiny"
    assert [row["step"] for row in read_jsonl(second / "metrics.jsonl")] == [1, 2, 3, 4] and contents(first) == kept
    finished = contents(second)
    assert LM.main(LM.arguments(tmp_path, "train.steps=4", "--resume", "auto")) == summary
    err = capsys.readouterr().err.splitlines()
    assert err[1:] == [f"{second} finished at step 4 (train.steps=4): nothing to train; raise train.steps to train "
                       "it further", " ".join(f"{key}={summary[key]:.4g}" for key in ("train/loss", "val/loss",
                                                                                      "val/perplexity"))]
    assert contents(second) == finished and sorted(p.name for p in tmp_path.iterdir()) == ["tiny", "tiny_2"]


def test_a_run_name_given_on_the_command_line_that_holds_a_run_is_refused(tmp_path, capsys):
    """``name=`` names the folder itself: one holding an earlier run's checkpoints is refused (status 2) with the
    ways on, and nothing in it changes."""
    LM.main(LM.arguments(tmp_path, "train.steps=2", "name=mine"))
    kept = contents(tmp_path / "mine")
    with pytest.raises(SystemExit) as exit_:
        LM.main(LM.arguments(tmp_path, "train.steps=2", "name=mine"))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m recipes.lm: error: {tmp_path / 'mine'} holds the checkpoints of an earlier run (newest: "
        "step_00000002.pt); continue it with --resume auto (train.resume=auto), or start a new run under another "
        "name= (without name= the config's runs are numbered: a new one gets a folder of its own), or delete "
        f"{tmp_path / 'mine' / 'checkpoints'} to start afresh")
    assert contents(tmp_path / "mine") == kept and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_numbered_names_follow_the_highest_run_of_the_config(tmp_path):
    """A fresh run takes the number after the highest folder that holds a run (an empty folder holds none);
    ``auto`` the highest; a resume from a checkpoint path keeps the config's name."""
    name = functools.partial(run_folder.numbered_name, tmp_path, "tiny")
    assert (name(None), name("auto")) == ("tiny", "tiny")
    (tmp_path / "tiny").mkdir()
    assert (name(None), name("auto")) == ("tiny", "tiny")
    (tmp_path / "tiny" / "metrics.jsonl").touch()
    for folder in ("tiny_3", "tiny_10", "tiny_02", "tiny_x", "tinyy_12", "tiny_11"):
        (tmp_path / folder).mkdir()
    for folder in ("tiny_3", "tiny_10", "tiny_02", "tiny_x", "tinyy_12"):
        (tmp_path / folder / "config.yaml").touch()
    assert (name(None), name("auto"), name("runs/tiny/checkpoints")) == ("tiny_11", "tiny_10", "tiny")
    (tmp_path / "group" / "tiny").mkdir(parents=True)
    (tmp_path / "group" / "tiny" / "run.lock").touch()
    assert run_folder.numbered_name(tmp_path, "group/tiny", None) == "group/tiny_2"


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_auto_falls_back_past_a_damaged_checkpoint_and_logs_each_step_once(tmp_path, recipe):
    """Steps 1-4 with checkpoints at 2 and 4; step 4's file gets one flipped bit. ``resume=auto``
    to step 6 warns naming it, resumes from step 2, drops the log rows of steps 3-4 before logging
    them again, and writes a good step-4 checkpoint over the damaged one."""
    run = RECIPES[recipe]
    settings = ("train.checkpoint_interval=2", "train.keep_checkpoints=0", "train.eval_interval=2")
    run.train(run.config(tmp_path, "train.steps=4", *settings))
    run_dir = tmp_path / run.run
    newest = run_dir / "checkpoints" / "step_00000004.pt"
    flip_bit(newest, 8 * newest.stat().st_size // 2)
    with pytest.warns(RuntimeWarning) as warned:
        run.train(run.config(tmp_path, "train.steps=6", "train.resume=auto", *settings))
    messages = [str(w.message) for w in warned]
    assert any(m.startswith(f"skipping a damaged checkpoint: checkpoint {newest} cannot be read (its SHA-256 "
                            "differs from the one written with it") for m in messages), messages
    assert f"{run_dir / 'metrics.jsonl'}: dropped 2 row(s) logged past step 2, where this run starts" in messages
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert checkpoint.load(newest)["step"] == 4 and checkpoint.load(run_dir / "checkpoints" / "step_00000006.pt")


def test_every_checkpoint_damaged_stops_with_one_line(tmp_path, capsys):
    LM.train(LM.config(tmp_path, "train.steps=2", "train.checkpoint_interval=1", "train.keep_checkpoints=0"))
    capsys.readouterr()  # the end-of-run report of that run
    directory = tmp_path / "tiny" / "checkpoints"
    for path in checkpoint.checkpoints(directory):
        flip_bit(path, 100)
    with pytest.warns(RuntimeWarning, match="skipping a damaged checkpoint"), pytest.raises(SystemExit) as exit_:
        LM.main(LM.arguments(tmp_path, "train.steps=4", "--resume", "auto"))
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (f"python -m recipes.lm: error: every checkpoint in {directory} is damaged: "
                                       "step_00000001.pt, step_00000002.pt\n")


HOLD_LOCK = ("import sys, time; from pathlib import Path; from recipes.common.run_folder import RunLock; "
             "RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(120)")


def test_a_second_run_on_a_folder_in_use_is_refused_and_a_dead_runs_lock_taken_over(tmp_path, capsys):
    """Another live process holds the run folder: the run stops with one line (status 1) and writes
    nothing. Once that process is killed, its lock file is left naming it; the next run takes it
    over with a warning and removes it at exit."""
    run_dir, args = tmp_path / "tiny", LM.arguments(tmp_path, "train.steps=2", "name=tiny")
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                              env=child_environment())
    try:
        assert holder.stdout.readline() == b"locked\n"
        with pytest.raises(SystemExit) as exit_:
            LM.main(args)
        assert exit_.value.code == 1
        assert capsys.readouterr().err == (f"python -m recipes.lm: error: {run_dir} is in use by another run (pid "
                                           f"{holder.pid} on {socket.gethostname()}); wait for it to end or choose "
                                           "another name\n")
        assert os.listdir(run_dir) == ["run.lock"]
    finally:
        holder.kill()
        holder.communicate()
    lock = run_dir / "run.lock"
    with pytest.warns(RuntimeWarning, match=f"^taking over the stale lock {lock} of process {holder.pid}, which is "
                                            "no longer running$"):
        LM.main(args)
    assert not lock.exists() and checkpoint.latest(run_dir / "checkpoints").name == "step_00000002.pt"


def test_a_leftover_lock_of_another_host_is_not_taken_over(tmp_path):
    (tmp_path / "run.lock").write_text("4242 other-host\n")
    with pytest.raises(run_folder.RunLockedError, match=f"run.lock names pid 4242 on host other-host, which cannot "
                                                        f"be checked from {socket.gethostname()}; if no run uses"):
        run_folder.RunLock(tmp_path).acquire()


def test_leftover_temporary_files_are_removed_at_the_next_start(tmp_path):
    LM.train(LM.config(tmp_path, "train.steps=2"))
    run_dir = tmp_path / "tiny"
    directory = run_dir / "checkpoints"
    (directory / ".step_00000004.pt.tmp-4242").write_bytes(bytes(3_000_000))
    (directory / ".step_00000003.pt.tmp-4343").write_bytes(bytes(2_000_000))
    (run_dir / ".metrics.jsonl.tmp-77").write_text("{}")
    with pytest.warns(RuntimeWarning) as warned:
        LM.train(LM.config(tmp_path, "train.steps=4", "train.resume=auto"))
    assert [str(w.message) for w in warned if w.category is RuntimeWarning] == [
        f"removed 1 temporary file(s) of interrupted writes from {run_dir} (0.0 MB): .metrics.jsonl.tmp-77",
        (f"removed 2 temporary file(s) of interrupted writes from {directory} (5.0 MB): .step_00000003.pt.tmp-4343, "
         ".step_00000004.pt.tmp-4242"),
    ]
    assert sorted(os.listdir(directory)) == ["step_00000002.pt", "step_00000004.pt"]


def test_log_rows_past_the_resumed_step_and_a_cut_line_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {step}, "train/loss": 1.0}}\n' for step in range(1, 6)) + '{"step": 6, "tr')
    with pytest.warns(RuntimeWarning, match=f"^{path}: dropped 3 row\\(s\\) logged past step 3, where this run starts$"):
        drop_rows_after(path, 3)
    assert [row["step"] for row in read_jsonl(path)] == [1, 2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"], "no temporary file is left"


def test_wandb_run_id_is_kept_for_a_resumed_run_and_renewed_for_a_fresh_one(tmp_path):
    first = wandb_run_id(tmp_path, fresh=True)
    assert (tmp_path / "wandb_run_id").read_text() == first + "\n" and len(first) == 16
    assert wandb_run_id(tmp_path, fresh=False) == first
    assert wandb_run_id(tmp_path, fresh=True) != first


@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_device_without_cuda_is_a_config_error(tmp_path, recipe, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = RECIPES[recipe]
    with pytest.raises(ConfigError, match="^train.device=cuda, but torch finds no CUDA device on this machine; use "
                                          "train.device=auto or cpu$"):
        run.train(run.config(tmp_path, "train.device=cuda"))
    assert not (tmp_path / run.run).exists()


def test_a_file_system_without_flock_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_folder.fcntl, "flock", no_locks)
    lock = run_folder.RunLock(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"^cannot lock {tmp_path / 'run.lock'} \\(No locks available\\): the file "
                                            "system does not support flock, so nothing stops a second run"):
        lock.acquire()
    lock.release()
    assert lock.fd is None
