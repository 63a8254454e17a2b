"""Where a launch's configuration comes from (flashbob/kernels/tuning.py, configs.pick and configs.launch): the
tuning cache on disk, the shipped tables and their nearest-bucket rule, and the tuner, with a fake clock (the
interpreter cannot time kernels) and the real candidates of configs.SPACES."""

import dataclasses
import itertools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from flashbob import kernels, reference
from flashbob.kernels import configs, tuning
from tests.helpers import (
    KERNEL_DEVICE,
    assert_matches,
    attention_inputs,
    exact_tolerance,
    needs_interpreter,
    needs_kernels,
    on_backend,
    relative_error,
)

ROOT = Path(__file__).resolve().parent.parent
GPU = "NVIDIA Test GPU 80GB"
FLAGS = {"CAUSAL": True, "HAS_DK_BAR": True, "HAS_DQ_BAR": True, "HAS_DV_BAR": True, "HAS_KEY_MASK": False,
         "PRECISION": "ieee", "SWEEP": "bob_q_bar"}


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """An empty tuning cache and an empty folder of shipped tables; no picks remembered."""
    monkeypatch.setenv("FLASHBOB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path / "tables")
    monkeypatch.setattr(configs, "_PICKS", {})
    return tmp_path


def key_at(length, kernel="bob_q_bar", head_dim=128, **flags):
    constants = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, **FLAGS, **flags}
    return configs.tuning_key(kernel, head_dim, torch.bfloat16, length, constants)


def space_of(key):
    return configs.candidates(key.kernel, key.head_dim, torch.bfloat16, key.bucket)


class FakeClock:
    """Times each candidate by a fixed ranking: the candidate at ``fastest`` in the space is quickest; records
    what it timed."""

    def __init__(self, space, fastest):
        self.times = {config: 1.0 + i for i, config in enumerate(space)}
        self.times[space[fastest]] = 0.5
        self.timed = []

    def __call__(self, run):
        run()
        self.timed.append(self.last)
        return self.times[self.last]

    def run(self, config):
        self.last = config


def test_key_holds_the_flags_but_not_the_shape_constants():
    key = key_at(1000)
    assert key.bucket == 1024 and key.dtype == "bfloat16" and key.head_dim == 128
    assert dict(key.flags) == FLAGS
    assert tuning.Key.from_json(json.loads(json.dumps(key.to_json()))) == key


def test_memoised_key_follows_every_input():
    """tuning_key is memoised on its arguments: each change of kernel, head_dim, dtype, length bucket or a flag
    gives another key, the one an unmemoised build gives; the order of the constants and the shape constants
    HEAD_DIM and BLOCK_D do not change it."""
    build = configs._tuning_key.__wrapped__
    base = ("bob_q_bar", 128, torch.bfloat16, 1000, {"HEAD_DIM": 128, "BLOCK_D": 128, **FLAGS})
    variants = [("forward", *base[1:]), (base[0], 64, *base[2:]), (*base[:2], torch.float16, *base[3:]),
                (*base[:3], 3000, base[4])]
    variants += [(*base[:4], {**base[4], name: not value if isinstance(value, bool) else value + "_other"})
                 for name, value in FLAGS.items()]
    keys = [configs.tuning_key(*args) for args in (base, *variants)]
    for args, key in zip((base, *variants), keys):
        assert key == build(*args[:4], tuple(args[4].items()))
    assert len(set(keys)) == len(keys)
    assert configs.tuning_key(*base[:4], dict(reversed(base[4].items()))) == keys[0]
    assert configs.tuning_key(*base[:4], {**base[4], "BLOCK_D": 256}) == keys[0]
    assert configs.tuning_key(*base[:3], 1024, base[4]) == keys[0]  # same bucket


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHBOB_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert tuning.cache_root() == tmp_path / "a"
    monkeypatch.delenv("FLASHBOB_CACHE_DIR")
    assert tuning.cache_root() == tmp_path / "b" / "flashbob"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_root() == tmp_path / "home" / ".cache" / "flashbob"
    path = tuning.cache_path("NVIDIA H200", key_at(4096))
    assert path.parent == tmp_path / "home" / ".cache" / "flashbob" / "tuning" / "NVIDIA_H200" / f"triton-{tuning.triton.__version__}"


def test_cache_round_trip(folders):
    key = key_at(4096)
    config = configs.config_tuple(space_of(key)[2])
    assert tuning.read_cache(GPU, key) is None
    tuning.write_cache(GPU, key, config, {config: 1.5})
    assert tuning.read_cache(GPU, key) == config
    assert tuning.read_cache(GPU, key_at(8192)) is None  # another bucket
    assert tuning.read_cache(GPU, key_at(4096, CAUSAL=False)) is None  # other flags
    assert [p.name for p in tuning.cache_path(GPU, key).parent.iterdir()] == [tuning.cache_path(GPU, key).name]


@pytest.mark.parametrize("content", ["{not json", '{"key": {"kernel": "forward"}, "config": [1, 2, 3, 4]}',
                                     '{"config": [64, 64, 4, 2]}', ""], ids=["garbage", "other key", "no key", "empty"])
def test_unreadable_cache_file_is_ignored_with_a_warning_and_rewritten(folders, content):
    key = key_at(4096)
    space = space_of(key)
    path = tuning.cache_path(GPU, key)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="ignoring the unreadable tuning cache file"):
        assert tuning.read_cache(GPU, key) is None
    clock = FakeClock(space, fastest=1)
    with pytest.warns(RuntimeWarning, match="unreadable"), tuning.timed_by(clock):
        chosen = configs.pick(key, space, GPU, "on", clock.run)
    assert chosen == configs.Pick(space[1], "tuned")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.read_cache(GPU, key) == configs.config_tuple(space[1])


def test_unwritable_cache_warns_and_keeps_the_pick(folders, monkeypatch):
    blocker = folders / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("FLASHBOB_CACHE_DIR", str(blocker))  # the cache folder cannot be made
    key = key_at(4096)
    space = space_of(key)
    clock = FakeClock(space, fastest=4)
    with pytest.warns(RuntimeWarning, match="cannot write the tuning cache file"), tuning.timed_by(clock):
        assert configs.pick(key, space, GPU, "on", clock.run) == configs.Pick(space[4], "tuned")
    assert tuning.read_cache(GPU, key) is None


WRITER = """
import json, sys
import torch
from flashbob import kernels, reference
from flashbob.kernels import configs, tuning
gpu, flags, config = sys.argv[1], json.loads(sys.argv[2]), tuple(json.loads(sys.argv[3]))
key = configs.tuning_key("bob_q_bar", 128, torch.bfloat16, 4096, {"HEAD_DIM": 128, "BLOCK_D": 128, **flags})
for _ in range(500):
    tuning.write_cache(gpu, key, config, {config: 1.0})
"""


def test_concurrent_writers_leave_a_valid_file(folders):
    """Two processes write the same key 500 times each while this one reads it: every read finds a whole
    file holding one of the two configurations, and no temporary file is left behind."""
    key = key_at(4096)
    configs_written = [configs.config_tuple(c) for c in space_of(key)[:2]]
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, GPU, json.dumps(FLAGS), json.dumps(c)], cwd=ROOT)
             for c in configs_written]
    reads = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a partial file would warn
        while any(p.poll() is None for p in procs):
            reads.append(tuning.read_cache(GPU, key))
    assert [p.returncode for p in procs] == [0, 0]
    assert set(reads) <= {None, *configs_written} and set(reads) & set(configs_written)
    assert tuning.read_cache(GPU, key) in configs_written
    assert [p.name for p in tuning.cache_path(GPU, key).parent.iterdir()] == [tuning.cache_path(GPU, key).name]


def write_table(folder, entries):
    """A shipped table for GPU holding ``entries`` (key -> BlockConfig)."""
    entries = {key: configs.config_tuple(config) for key, config in entries.items()}
    tuning.write_table(tuning.table_path(GPU), GPU, entries, triton="test")


def test_table_lookup_takes_the_exact_then_the_nearest_bucket(folders):
    space = space_of(key_at(1024))
    write_table(folders, {key_at(1024): space[0], key_at(4096): space[1], key_at(16384): space[2],
                          key_at(16384, CAUSAL=False): space[3]})
    table = tuning.load_table(tuning.table_path(GPU))
    assert len(table) == 4
    allowed = [configs.config_tuple(c) for c in space]
    as_config = lambda length, **flags: tuning.lookup(table, key_at(length, **flags), allowed)
    assert as_config(4096) == allowed[1]  # exact
    assert as_config(3000) == allowed[1]  # same bucket
    assert as_config(512) == allowed[0]  # below the table: the shortest bucket
    assert as_config(2048) == allowed[1]  # 1024 and 4096 equally near: the longer
    assert as_config(1 << 17) == allowed[2]  # above the table: the longest bucket
    assert as_config(1 << 17, CAUSAL=False) == allowed[3]  # only entries with the same flags
    assert as_config(4096, HAS_KEY_MASK=True) is None
    assert tuning.lookup(table, key_at(4096, kernel="bob_scalars", SWEEP="bob_scalars"), allowed) is None
    assert tuning.lookup(table, key_at(4096), allowed[2:]) == allowed[2]  # the nearest entry that is a candidate


def test_table_file_has_one_entry_per_line(folders):
    space = space_of(key_at(1024))
    write_table(folders, {key_at(1024): space[0], key_at(4096): space[1]})
    text = tuning.table_path(GPU).read_text()
    data = json.loads(text)
    assert data["gpu"] == GPU and data["triton"] == "test" and len(data["entries"]) == 2
    assert sum('"config"' in line for line in text.splitlines()) == 2
    assert tuning.table_path("NVIDIA H200").name == "NVIDIA_H200.json"


def test_malformed_table_is_an_error(folders):
    path = tuning.table_path(GPU)
    path.parent.mkdir(parents=True)
    path.write_text('{"entries": [{"kernel": "forward"}]}')
    with pytest.raises(ValueError, match="malformed"):
        tuning.load_table(path)


def test_pick_order_cache_table_tune_default(folders):
    key = key_at(4096)
    space = space_of(key)
    clock = FakeClock(space, fastest=3)
    with tuning.timed_by(clock):
        assert configs.pick(key, space, GPU, "off", clock.run) == configs.Pick(space[0], "default")
        assert configs.pick(key, space, None, "on", clock.run) == configs.Pick(space[0], "default")  # not a GPU
        assert clock.timed == []
        # neither table nor cache: every candidate is timed once, the fastest is stored in the cache
        assert configs.pick(key, space, GPU, "on", clock.run) == configs.Pick(space[3], "tuned")
        assert sorted(clock.timed, key=space.index) == list(space)
        assert tuning.read_cache(GPU, key) == configs.config_tuple(space[3])
        clock.timed.clear()
        assert configs.pick(key, space, GPU, "on", clock.run) == configs.Pick(space[3], "cache")
        assert configs.pick(key, space, GPU, "off", clock.run) == configs.Pick(space[3], "cache")
        # the table serves what the cache does not hold, its nearest bucket included
        write_table(folders, {key_at(16384): space[1]})
        assert configs.pick(key_at(8192), space, GPU, "on", clock.run) == configs.Pick(space[1], "table")
        assert configs.pick(key_at(8192), space, GPU, "off", clock.run) == configs.Pick(space[1], "table")
        assert clock.timed == []
        # defaults: the first candidate, whatever the cache and the table hold
        assert configs.pick(key, space, GPU, "defaults", clock.run) == configs.Pick(space[0], "default")
        assert configs.pick(key_at(8192), space, GPU, "defaults", clock.run) == configs.Pick(space[0], "default")
        # force tunes again, whatever the cache and the table hold
        clock.times[space[3]], clock.times[space[5]] = 9.0, 0.1
        assert configs.pick(key, space, GPU, "force", clock.run) == configs.Pick(space[5], "tuned")
        assert tuning.read_cache(GPU, key) == configs.config_tuple(space[5])


@pytest.mark.parametrize("kernel,other", [("forward", "base"), ("bob_cols", "tma")])
def test_table_may_name_a_variant_other_than_the_default(folders, kernel, other):
    """A table entry [block_m, block_n, num_warps, num_stages, variant] selects that variant for its key (here the
    one that is not the kernel's default); an entry of four numbers, a tuned pick and the default run the
    kernel's default variant; a variant the kernel lacks, or of a config that is no candidate, is ignored."""
    flags = {"CAUSAL": False, "HAS_KEY_MASK": False, "PRECISION": "ieee"}
    key = configs.tuning_key(kernel, 128, torch.bfloat16, 4096, {"HEAD_DIM": 128, "BLOCK_D": 128, **flags})
    space = space_of(key)
    named = dataclasses.replace(space[1], variant=other)
    write_table(folders, {key: named})
    assert json.loads(tuning.table_path(GPU).read_text())["entries"][0]["config"][-1] == other
    assert configs.pick(key, space, GPU, "off", lambda config: None) == configs.Pick(named, "table")
    write_table(folders, {key: space[1]})
    picked = configs.pick(key, space, GPU, "off", lambda config: None)
    assert picked == configs.Pick(space[1], "table") and picked.config.variant is None
    write_table(folders, {key: dataclasses.replace(space[1], variant="fast")})
    assert configs.pick(key, space, GPU, "off", lambda config: None) == configs.Pick(space[0], "default")
    clock = FakeClock(space, fastest=2)
    with tuning.timed_by(clock):
        assert configs.pick(key, space, GPU, "force", clock.run) == configs.Pick(space[2], "tuned")
    assert sorted(clock.timed, key=space.index) == list(space) and all(c.variant is None for c in clock.timed)


def test_single_candidate_is_not_timed(folders):
    key = configs.tuning_key("delta", 128, torch.bfloat16, 4096, {"HEAD_DIM": 128, "BLOCK_D": 128})
    space = configs.candidates("delta", 128, torch.bfloat16, 4096)
    clock = FakeClock(space, fastest=0)
    with tuning.timed_by(clock):
        assert configs.pick(key, space, GPU, "on", clock.run) == configs.Pick(space[0], "default")
    assert clock.timed == []


def test_tuner_skips_rejected_candidates(folders):
    from triton.runtime.errors import OutOfResources

    key = key_at(4096)
    space = space_of(key)
    clock = FakeClock(space, fastest=0)
    rejected = set(space[:2])  # the fastest among them

    def timer(run):
        run()
        if clock.last in rejected:
            raise OutOfResources(262144, 232448, "shared memory")
        return clock.times[clock.last]

    with tuning.timed_by(timer):
        assert configs.pick(key, space, GPU, "on", clock.run) == configs.Pick(space[2], "tuned")
        rejected = set(space)
        with pytest.raises(OutOfResources):
            configs.pick(key_at(8192), space, GPU, "on", clock.run)


class RecordingKernel:
    """A stand-in Triton kernel for :func:`configs.launch`: each launch appends its config to ``tried`` and then
    calls ``outcome(attempt)`` (1 for the first launch), which may raise what a compiler would."""

    def __init__(self, tried: list, outcome):
        self.tried, self.outcome = tried, outcome

    def __getitem__(self, grid):
        def run(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **constants):
            self.tried.append(configs.BlockConfig(BLOCK_M, BLOCK_N, num_warps, num_stages))
            self.outcome(len(self.tried))
        return run


def test_launch_tunes_once_then_launches_the_pick(folders, monkeypatch):
    """configs.launch on a (pretend) GPU: the first launch of a key tunes and then launches the pick; later
    launches reuse it without timing; tuned_configs reports it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "1")
    monkeypatch.setattr(configs, "_gpu", lambda args: (None, GPU, None))
    launched = []
    kernel = RecordingKernel(launched, lambda attempt: None)
    constants = {"HEAD_DIM": 128, "BLOCK_D": 128, **FLAGS}
    space = configs.candidates("bob_q_bar", 128, torch.bfloat16, 4096)
    clock = FakeClock(space, fastest=2)
    with tuning.timed_by(lambda run: (run(), clock.times[launched[-1]])[1]):
        configs.launch("bob_q_bar", kernel, (1,), head_dim=128, dtype=torch.bfloat16, length=4000, **constants)
        assert launched == [*space, space[2]]  # each candidate timed, then the pick launched
        configs.launch("bob_q_bar", kernel, (1,), head_dim=128, dtype=torch.bfloat16, length=3000, **constants)
        assert launched[-1] == space[2] and len(launched) == len(space) + 2
    (row,) = configs.tuned_configs()
    assert (row["kernel"], row["bucket"], row["source"]) == ("bob_q_bar", 4096, "tuned")
    assert configs.BlockConfig(**row["config"]) == space[2]
    assert row["flags"] == FLAGS


def test_launch_raises_when_the_compiler_rejects_every_config(monkeypatch):
    """Each candidate is tried once, the pick first; when the last one is rejected too, its error is raised."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "0")
    monkeypatch.setattr(configs, "_PICKS", {})
    tried = []

    def reject(attempt):
        raise OutOfResources(262144 + attempt, 232448, "shared memory")

    with pytest.raises(OutOfResources) as raised:
        configs.launch("bob_q_bar", RecordingKernel(tried, reject), (1,), head_dim=128, dtype=torch.float16, length=4096, HEAD_DIM=128)
    space = configs.candidates("bob_q_bar", 128, torch.float16, 4096)
    assert len(space) > 1 and tried == list(space)
    assert raised.value.required == 262144 + len(space)  # the last candidate's error


def test_tuning_mode(monkeypatch):
    """FLASHBOB_AUTOTUNE: unset or empty is 0, no tuning (the default); 1 tunes; tuning_as overrides it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("FLASHBOB_AUTOTUNE", raising=False)
    assert configs.tuning_mode() == "off" and not configs.autotune_enabled()
    for value, mode in (("", "off"), ("1", "on"), ("0", "off"), ("force", "force"), ("defaults", "defaults")):
        monkeypatch.setenv("FLASHBOB_AUTOTUNE", value)
        assert configs.tuning_mode() == mode
        with configs.tuning_as("fill"):
            assert configs.tuning_mode() == "fill"
        assert configs.tuning_mode() == mode
    with pytest.raises(ValueError, match="unknown tuning mode"), configs.tuning_as("sometimes"):
        pass
    with configs.override(block_m=16):
        assert configs.tuning_mode() == "defaults"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert configs.tuning_mode() == "defaults"
    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="FLASHBOB_AUTOTUNE must be 1, 0, force or defaults; got 'yes'"):
        configs.tuning_mode()


@needs_kernels
def test_tuned_launches_give_the_reference_results(folders, monkeypatch, gen):
    """The whole path on the real kernels (in the interpreter on a CPU): on a pretend GPU that neither table
    nor cache knows, each kernel of the forward and backward is tuned on the call's own buffers, then its pick
    (here the last candidate, not the default) is launched; the outputs match the float64 oracle."""
    monkeypatch.setattr(configs, "tuning_mode", lambda: "on")  # as on a GPU with FLASHBOB_AUTOTUNE=1
    monkeypatch.setattr(configs, "_gpu", lambda args: (None, GPU, None))
    q, k, v, do = on_backend("triton", *attention_inputs(gen, batch=1, heads=2, kv_heads=1, n=20, m=20, head_dim=16))
    ticks = itertools.count()
    with tuning.timed_by(lambda run: (run(), -next(ticks))[1]):  # the later a candidate is timed, the faster
        o, stats = kernels.forward(q, k, v, causal=True, scale=0.25)
        dq, dk, dv, _ = kernels.backward(q, k, v, o, stats, do, causal=True, scale=0.25)
    picks = {row["kernel"]: row for row in configs.tuned_configs()}
    assert {kernel: row["source"] for kernel, row in picks.items()} == {
        "forward": "tuned", "dkdv": "tuned", "dq": "tuned"}
    for kernel in ("forward", "dkdv", "dq"):
        space = configs.candidates(kernel, 16, q.dtype, 20)
        assert len(space) > 1 and configs.BlockConfig(**picks[kernel]["config"]) == space[-1] != space[0]
    expected = reference.attention(*(x.double() for x in (q, k, v)), causal=True, scale=0.25)
    grads = reference.attention_backward(*(x.double() for x in (q, k, v, do)), causal=True, scale=0.25)
    for name, actual, wanted in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (expected, *grads)):
        assert_matches(actual, wanted, exact_tolerance(actual), name)


# ----------------------------------------------------------------------------- tables written, unreadable caches, rejected configs


def test_tune_table_entries_load_back(folders):
    """benchmarks/tune_table.py's entries (the picks of tuned_configs, whose configs carry variant=None) make a
    table that loads: no `null` variant in the file (it made every launch on that GPU raise 'malformed')."""
    from benchmarks import tune_table

    key = key_at(4096)
    space = space_of(key)
    clock = FakeClock(space, fastest=2)
    with tuning.timed_by(clock):
        configs._PICKS[(key, GPU, "on")] = configs.pick(key, space, GPU, "on", clock.run)
    entries = tune_table.tuned_entries(4096)
    tuning.write_table(tuning.table_path(GPU), GPU, entries)
    assert tuning.load_table(tuning.table_path(GPU)) == {key: configs.config_tuple(space[2])}
    with pytest.raises(ValueError):  # write_table refuses what load_table would reject
        tuning.write_table(tuning.table_path(GPU), GPU, {key: (64, 64, 4, 2, None)})


def test_cache_entry_that_is_no_candidate_warns(folders):
    key = key_at(4096)
    space = space_of(key)
    tuning.write_cache(GPU, key, (256, 256, 8, 3), {})  # not a candidate: never launched
    with pytest.warns(RuntimeWarning, match="is not a candidate"):
        assert configs.pick(key, space, GPU, "off", None) == configs.Pick(space[0], "default")


def test_cache_folder_that_cannot_be_searched_warns(folders, monkeypatch):
    """A cache path whose stat fails with EACCES (another user's 0700 folder) is ignored with a warning, not raised
    from the launch (Path.exists raises PermissionError there)."""
    key = key_at(4096)
    tuning.write_cache(GPU, key, configs.config_tuple(space_of(key)[1]), {})
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self == tuning.cache_path(GPU, key):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    def stat_denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    monkeypatch.setattr(Path, "exists", stat_denied)
    with pytest.warns(RuntimeWarning, match="ignoring the unreadable tuning cache file"):
        assert tuning.read_cache(GPU, key) is None


def test_cache_files_follow_the_umask(folders):
    import os
    import stat

    key = key_at(4096)
    old = os.umask(0o022)
    try:
        tuning._umask.cache_clear()
        tuning.write_cache(GPU, key, configs.config_tuple(space_of(key)[0]), {})
    finally:
        os.umask(old)
        tuning._umask.cache_clear()
    assert stat.S_IMODE(tuning.cache_path(GPU, key).stat().st_mode) == 0o644


def test_cache_dir_expands_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FLASHBOB_CACHE_DIR", "~/fb")
    assert tuning.cache_root() == tmp_path / "fb"


def test_malformed_bucket_and_deep_json(folders):
    path = tuning.table_path(GPU)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"entries": [{**key_at(4096).to_json(), "bucket": 0, "config": [64, 64, 4, 2]}]}))
    with pytest.raises(ValueError, match="malformed"):
        tuning.load_table(path)
    key = key_at(4096)
    tuning.cache_path(GPU, key).parent.mkdir(parents=True)
    tuning.cache_path(GPU, key).write_text("[" * 100000)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert tuning.read_cache(GPU, key) is None


@pytest.mark.parametrize("error", ["ptxas", "assert"])
def test_launch_falls_back_on_every_compiler_rejection(monkeypatch, error):
    """A picked config (e.g. from a table tuned with another Triton) that ptxas or a static assert rejects gives way
    to the next candidate, as an out-of-resources one does (the tuner skips all three)."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import PTXASError

    monkeypatch.setenv("FLASHBOB_AUTOTUNE", "0")
    monkeypatch.setattr(configs, "_PICKS", {})
    tried = []

    def reject_the_first(attempt):
        if attempt == 1:
            raise PTXASError("ptxas failed") if error == "ptxas" else CompileTimeAssertionFailure(None, None, "x")

    configs.launch("bob_q_bar", RecordingKernel(tried, reject_the_first), (1,), head_dim=128, dtype=torch.float16, length=4096, HEAD_DIM=128)
    space = configs.candidates("bob_q_bar", 128, torch.float16, 4096)
    assert tried == list(space[:2])


# ----------------------------------------------------------------------------- lookup order; tuning only when asked

ARCH_GPUS = ("Arch Test GPU A", "Arch Test GPU B")  # an architecture's tables, in lookup order


def write_table_for(gpu, entries, capability="9.0"):
    """A shipped table for ``gpu`` holding ``entries`` (key -> BlockConfig), recording ``capability``."""
    tuning.write_table(tuning.table_path(gpu), gpu, {key: configs.config_tuple(c) for key, c in entries.items()},
                       capability=capability)


@pytest.fixture
def architecture(folders, monkeypatch):
    """Tables of an architecture "9.0" (A, then B) in the empty table folder of ``folders``: GPU has its own table
    for one family (causal forward), A for two, B for three; returns (keys, space) with a key of each family at
    4096 and the candidates of bob_q_bar there (the same for every key here)."""
    monkeypatch.setattr(tuning, "ARCHITECTURE_TABLES", {"9.0": ARCH_GPUS})
    keys = {name: key_at(4096, **flags) for name, flags in
            (("own", {}), ("a", {"CAUSAL": False}), ("b", {"HAS_KEY_MASK": True}), ("none", {"PRECISION": "tf32"}))}
    space = space_of(keys["own"])
    write_table_for(GPU, {keys["own"]: space[1]})
    write_table_for(ARCH_GPUS[0], {keys["own"]: space[2], keys["a"]: space[2]})
    write_table_for(ARCH_GPUS[1], {keys["own"]: space[3], keys["a"]: space[3], keys["b"]: space[3]})
    return keys, space


def test_lookup_order_exact_name_then_architecture_then_default(architecture):
    """Default settings: this GPU's own table, else its architecture's tables in ARCHITECTURE_TABLES order (the first
    that holds the key's family), else the default; another architecture, or none known, takes no other GPU's
    table. Nothing is timed."""
    keys, space = architecture
    never = lambda config: pytest.fail("a candidate was launched for timing")
    pick = lambda name, capability="9.0", gpu=GPU: configs.pick(keys[name], space, gpu, "off", never, capability)
    assert pick("own") == configs.Pick(space[1], "table")
    assert pick("a") == configs.Pick(space[2], "arch_table")
    assert pick("b") == configs.Pick(space[3], "arch_table")
    assert pick("none") == configs.Pick(space[0], "default")
    for capability in ("8.0", "9.4", None):  # an A100; a ROCm or unknown GPU
        assert pick("own", capability) == configs.Pick(space[1], "table")
        assert pick("a", capability) == configs.Pick(space[0], "default")
    # a listed GPU's own table is its "table", not consulted a second time as an architecture table
    assert [source for source, _ in tuning.tables_for(ARCH_GPUS[1], "9.0")] == ["table", "arch_table"]
    assert pick("a", gpu=ARCH_GPUS[1]) == configs.Pick(space[3], "table")
    assert pick("b", gpu=ARCH_GPUS[0]) == configs.Pick(space[3], "arch_table")
    # a length no table lists: the nearest bucket of the first table holding the family
    nearest = configs.pick(key_at(1 << 17, CAUSAL=False), space, GPU, "off", never, "9.0")
    assert nearest == configs.Pick(space[2], "arch_table")


def test_user_cache_wins_over_every_table(architecture):
    keys, space = architecture
    never = lambda config: pytest.fail("a candidate was launched for timing")
    for name in ("own", "a", "none"):
        tuning.write_cache(GPU, keys[name], configs.config_tuple(space[4]), {})
        assert configs.pick(keys[name], space, GPU, "off", never, "9.0") == configs.Pick(space[4], "cache")
        assert configs.pick(keys[name], space, GPU, "on", never, "9.0") == configs.Pick(space[4], "cache")


@pytest.mark.parametrize(("mode", "served", "held", "source", "tuned"),
                         [("on", "own", 1, "table", "a"), ("fill", "a", 4, "cache", "own")])
def test_tuning_modes_serve_what_they_hold_and_tune_the_rest(architecture, mode, served, held, source, tuned):
    """FLASHBOB_AUTOTUNE=1 (``"on"``) asks for this GPU's own configurations: its own table serves what it holds,
    the rest is tuned (the architecture's tables are what a GPU gets without tuning). flashbob.tune's mode
    (``"fill"``): the cache's configuration, else tuned and stored; no table is consulted."""
    keys, space = architecture
    clock = FakeClock(space, fastest=5)
    if mode == "fill":
        tuning.write_cache(GPU, keys["a"], configs.config_tuple(space[4]), {})
    with tuning.timed_by(clock):
        assert configs.pick(keys[served], space, GPU, mode, clock.run, "9.0") == configs.Pick(space[held], source)
        assert clock.timed == []
        assert configs.pick(keys[tuned], space, GPU, mode, clock.run, "9.0") == configs.Pick(space[5], "tuned")
    assert tuning.read_cache(GPU, keys[tuned]) == configs.config_tuple(space[5])


def test_no_architecture_tables_on_rocm(monkeypatch):
    """ROCm GPUs report capabilities of their own (an MI250's gfx90a is 9.0): none takes an NVIDIA table."""
    monkeypatch.setattr(configs, "_compute_capability", lambda index: (9, 0))
    configs._architecture.cache_clear()
    try:
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert configs._architecture(0) is None
        configs._architecture.cache_clear()
        monkeypatch.setattr(torch.version, "hip", None)
        assert configs._architecture(0) == "9.0"
    finally:
        configs._architecture.cache_clear()


def test_shipped_tables_are_listed_under_their_architecture():
    """Every table in flashbob/kernels/tuned/ is named after the GPU it records, records that GPU's compute
    capability and is listed under it in ARCHITECTURE_TABLES, so that other GPUs of its architecture use it; every
    listed table that is shipped records that capability."""
    shipped = sorted(tuning.TABLE_DIR.glob("*.json"))
    assert shipped
    for path in shipped:
        header = tuning.table_header(path)
        assert path.stem == tuning.gpu_file_name(header["gpu"]), path
        assert header["gpu"] in tuning.ARCHITECTURE_TABLES.get(header.get("capability"), ()), path
        assert tuning.load_table(path), path
    for capability, gpus in tuning.ARCHITECTURE_TABLES.items():
        for gpu in gpus:
            path = tuning.table_path(gpu)
            assert not path.exists() or tuning.table_header(path)["capability"] == capability


def test_nothing_tunes_by_default_on_an_unknown_sm90_gpu(tmp_path, monkeypatch):
    """Default settings (FLASHBOB_AUTOTUNE unset) on an sm90 GPU without a table of its own (here an "H100 PCIe" as
    the launch sees it), an empty cache, the shipped tables: no candidate is timed; each kernel whose family the
    H200's table holds launches that table's configuration (its nearest bucket at a length the table lacks), the
    others their default."""
    monkeypatch.delenv("FLASHBOB_AUTOTUNE", raising=False)
    monkeypatch.setenv("FLASHBOB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "_PICKS", {})
    monkeypatch.setattr(configs, "_in_interpreter", lambda: False)
    monkeypatch.setattr(configs, "_gpu", lambda args: (None, "NVIDIA H100 PCIe", "9.0"))
    table = tuning.load_table(tuning.table_path(tuning.ARCHITECTURE_TABLES["9.0"][0]))
    assert table, "the H200's table is shipped"
    first_order = {"HEAD_DIM": 128, "BLOCK_D": 128, "BAND": True, "DOCUMENTS": False, "HAS_KEY_MASK": False,
                   "PRECISION": "ieee"}
    bob = {**first_order, "HAS_DQ_BAR": True, "HAS_DK_BAR": True, "HAS_DV_BAR": True}
    launches = {"forward": first_order, "dq": first_order, "bob_q_bar": {**bob, "SWEEP": "bob_q_bar"}, "bob_cols": bob,
                "delta": {"HEAD_DIM": 128, "BLOCK_D": 128}}
    launched = []
    kernel = RecordingKernel(launched, lambda attempt: None)
    with tuning.timed_by(lambda run: pytest.fail("a candidate was timed")):
        for name, constants in launches.items():
            configs.launch(name, kernel, (1,), head_dim=128, dtype=torch.bfloat16, length=8192, **constants)
            key = configs.tuning_key(name, 128, torch.bfloat16, 8192, constants)
            space = configs.candidates(name, 128, torch.bfloat16, 8192)
            allowed = [configs.config_tuple(c) for c in space] + [
                configs.config_tuple(dataclasses.replace(c, variant=v)) for c in space for v in configs.VARIANTS[name]]
            listed = tuning.lookup(table, key, allowed)
            assert (listed is None) == (name == "delta"), name  # the delta kernel has one candidate, no entry
            expected = configs.BlockConfig(*listed) if listed else space[0]
            assert launched == [dataclasses.replace(expected, variant=None)], name  # launched once, not timed
            launched.clear()
            (row,) = [row for row in configs.tuned_configs() if row["kernel"] == name]
            assert row["source"] == ("arch_table" if listed else "default"), name


@needs_interpreter  # a pretend GPU launching on CPU tensors: the interpreter runs them
def test_tune_stores_the_picks_in_the_cache(folders, monkeypatch, capsys):
    """flashbob.tune on a (pretend) GPU: every kernel of the reverse and forward-mode passes at the shape is tuned
    (each candidate timed once, the fastest launched) and stored in the user's cache, whatever the shipped tables
    hold; later launches with default settings read the cache; a second call keeps the cached picks, retune=True
    tunes again; progress shows one line per kernel."""
    import flashbob

    monkeypatch.delenv("FLASHBOB_AUTOTUNE", raising=False)
    monkeypatch.setattr(configs, "_in_interpreter", lambda: False)
    monkeypatch.setattr(configs, "_gpu", lambda args: (None, GPU, "9.0"))
    timed = []
    ticks = itertools.count()

    def clock(run):  # times nothing, launches nothing: the later a candidate comes, the faster
        timed.append(run)
        return -next(ticks)

    shape = {"head_dim": 16, "dtype": torch.float32, "causal": True, "heads": 2, "device": "cpu"}
    forward = configs.tuning_key("forward", 16, torch.float32, 20, {"HEAD_DIM": 16, "BLOCK_D": 16, "BAND": True,
                                                                    "DOCUMENTS": False, "HAS_KEY_MASK": False,
                                                                    "PRECISION": "ieee"})
    write_table_for(GPU, {forward: configs.candidates("forward", 16, torch.float32, 20)[0]})  # not consulted
    with tuning.timed_by(clock):
        rows = flashbob.tune(20, **shape)
    kernels_run = {"forward", "dq", "dkdv", "bob_scalars", "bob_q_bar", "bob_do_bar", "bob_cols", "jvp_fwd", "jvp_rows",
                   "jvp_dq", "jvp_cols"}
    assert {row["kernel"] for row in rows} == kernels_run and forward in {tuning.Key.from_json(row) for row in rows}
    assert timed and capsys.readouterr().err.count("flashbob: tuning ") == len(kernels_run)
    for row in rows:
        key = tuning.Key.from_json(row)
        space = configs.candidates(row["kernel"], 16, torch.float32, 20)
        if len(space) == 1:
            assert row["source"] == "default" and tuning.read_cache(GPU, key) is None
        else:
            assert row["source"] == "tuned" and configs.BlockConfig(**row["config"]) == space[-1]
            assert tuning.read_cache(GPU, key) == configs.config_tuple(space[-1])
            assert configs.pick(key, space, GPU, "off", None, "9.0") == configs.Pick(space[-1], "cache")
    timed.clear()
    with tuning.timed_by(clock):
        again = flashbob.tune([20], **shape, progress=False)
    assert timed == [] and {row["source"] for row in again} == {"cache"} and len(again) == len(rows)
    with tuning.timed_by(clock):
        retuned = flashbob.tune(20, **shape, progress=False, forward_mode=False, retune=True)
    assert timed and {row["source"] for row in retuned} == {"tuned"}
    assert {row["kernel"] for row in retuned} == kernels_run - {"jvp_fwd", "jvp_rows", "jvp_dq", "jvp_cols"}


def test_tune_needs_a_gpu():
    import flashbob

    with pytest.raises(RuntimeError, match="flashbob.tune tunes on a CUDA GPU"):
        flashbob.tune(1024, device="cpu")


@needs_kernels
def test_first_call_on_a_gpu_without_a_table_takes_its_architectures_table(tmp_path, monkeypatch, gen):
    """The first fwd + bwd + BoB on a GPU that has no table of its own, with default settings and an empty cache:
    nothing is tuned, every kernel whose family its architecture's table holds launches that table's
    configuration, the others their default, and the results are those of the default configurations. On a GPU
    (the GPU suite; sm90 only) the launches see a pretend sm90 name and the shipped tables serve them, at a length
    no table lists (bf16, N = 2048: the nearest bucket); in the interpreter, a pretend sm90 GPU and an architecture
    table made here (float64: the last candidate of each kernel, one bucket above the call's)."""
    monkeypatch.delenv("FLASHBOB_AUTOTUNE", raising=False)
    monkeypatch.setenv("FLASHBOB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(configs, "_PICKS", {})
    monkeypatch.setattr(configs, "_in_interpreter", lambda: False)
    on_gpu = KERNEL_DEVICE == "cuda"
    real_gpu = configs._gpu
    if on_gpu:
        architecture = real_gpu((torch.empty(0, device="cuda"),))[2]
        listed = tuning.ARCHITECTURE_TABLES.get(architecture, ())
        shipped = [name for name in listed if tuning.table_path(name).exists()]
        if not shipped:
            pytest.skip(f"no shipped table for this GPU's architecture ({architecture})")
        pretend = "NVIDIA Pretend GPU without a table"
        monkeypatch.setattr(configs, "_gpu", lambda args: (*real_gpu(args)[:1], pretend, architecture))
        n, head_dim, dtype, tolerance = 2048, 128, torch.bfloat16, 2e-2  # other tiles: other rounding
    else:
        architecture, pretend = "9.0", "NVIDIA Pretend GPU without a table"
        monkeypatch.setattr(configs, "_gpu", lambda args: (None, pretend, architecture))
        monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path / "tables")
        monkeypatch.setattr(tuning, "ARCHITECTURE_TABLES", {architecture: ("Arch Test GPU",)})
        shipped, n, head_dim, dtype, tolerance = ["Arch Test GPU"], 40, 16, torch.float64, 1e-10
    q, k, v, do, *bars = (x.to(KERNEL_DEVICE, dtype) for x in (
        *attention_inputs(gen, batch=1, heads=2, kv_heads=1, n=n, m=n, head_dim=head_dim),
        *attention_inputs(gen, batch=1, heads=2, kv_heads=1, n=n, m=n, head_dim=head_dim)[:3]))

    def first_call():
        import flashbob

        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
        o = flashbob.attention(q_, k_, v_, causal=True, backend="triton")
        grads = torch.autograd.grad(o, (q_, k_, v_), do, create_graph=True)
        return (o, *grads, *torch.autograd.grad(grads, (q_, k_, v_), bars))

    with configs.tuning_as("defaults"):
        expected = [x.detach() for x in first_call()]
    if not on_gpu:  # the architecture's table: each kernel's last candidate, one bucket above the call's
        last = lambda key: configs.candidates(key.kernel, head_dim, dtype, n)[-1]
        entries = {dataclasses.replace(key, bucket=2 * key.bucket): last(key)
                   for key, gpu, mode in configs._PICKS if gpu == pretend}
        write_table_for("Arch Test GPU", entries, capability=architecture)
    configs._PICKS.clear()
    with tuning.timed_by(lambda run: pytest.fail("a candidate was timed")):
        actual = first_call()
    for name, got, wanted in zip(("o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar"), actual, expected):
        assert torch.isfinite(got).all() and relative_error(got.detach(), wanted) < tolerance, name
    tables = [tuning.load_table(tuning.table_path(name)) for name in shipped]
    rows = [row for row in configs.tuned_configs() if row["gpu"] == pretend]
    assert {row["kernel"] for row in rows} >= {"forward", "dq", "dkdv", "bob_scalars", "bob_q_bar", "bob_do_bar",
                                               "bob_cols"}
    for row in rows:
        key = tuning.Key.from_json(row)
        space = configs.candidates(key.kernel, head_dim, dtype, n)
        allowed = [configs.config_tuple(c) for c in space] + [configs.config_tuple(dataclasses.replace(c, variant=v))
                                                              for c in space for v in configs.VARIANTS[key.kernel]]
        listed = next(filter(None, (tuning.lookup(table, key, allowed) for table in tables)), None)
        assert row["source"] == ("arch_table" if listed else "default"), row
        assert configs.BlockConfig(**row["config"]) == (configs.BlockConfig(*listed) if listed else space[0]), row
    assert sum(row["source"] == "arch_table" for row in rows) >= 7
