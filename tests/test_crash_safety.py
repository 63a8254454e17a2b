"""Crash safety of the LM recipe's checkpoints: a run killed mid-write, a disk that fills up, a
rename that is refused, a checkpoint folder that cannot be made and a corrupt checkpoint file."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recipes.lm import checkpoint
from recipes.lm.train import train
from tests.test_lm_recipe import CONFIGS, MICRO, micro_config

ROOT = Path(__file__).resolve().parent.parent
# A model whose checkpoint (weights and AdamW moments, ~40 MB) takes far longer to write than the
# poll below takes to notice its temporary file, and a checkpoint after every step.
SLOW_WRITES = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4", "model.n_layers=4",
               "data.context_length=16", "data.batch_size=1", "train.checkpoint_interval=1",
               "train.keep_checkpoints=2", "train.eval_interval=100000"]


def run_recipe(tmp_path: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "recipes.lm", "--config", str(CONFIGS / "tiny.yaml"), *MICRO,
               f"out_dir={tmp_path}", "train.threads=1", *SLOW_WRITES, *extra]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def kill_mid_write(tmp_path: Path, directory: Path, timeout: float = 120.0) -> Path:
    """Start a run and SIGKILL it the moment a checkpoint's temporary file appears, once at least
    one checkpoint is finished; return the temporary file it left (proof the kill hit mid-write)."""
    process = run_recipe(tmp_path, "train.steps=100000")
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
    cfg = micro_config(tmp_path, "train.steps=4", "train.checkpoint_interval=2")
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            return real_save(obj, FillsUp(f, room=5000), *args, **kwargs)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    directory = tmp_path / "tiny" / "checkpoints"
    with pytest.raises(checkpoint.CheckpointWriteError, match="step_00000004.pt: No space left on device") as info:
        train(cfg)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(directory) == ["step_00000002.pt"]
    assert checkpoint.load(directory / "step_00000002.pt")["step"] == 2
    monkeypatch.setattr(torch, "save", real_save)
    train(micro_config(tmp_path, "train.steps=4", "train.checkpoint_interval=2", "train.resume=auto"))
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
