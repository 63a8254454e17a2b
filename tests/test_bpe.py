"""The LM recipe's BPE vocabulary: a byte-level BPE trained offline on the shipped corpus (the standard
library's source), its round trip, the cache of tokenizer and ids (reused, retrained for another corpus,
rebuilt when unreadable), the config checks and a few training steps on BPE tokens."""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest
from omegaconf import OmegaConf

from recipes.common import bpe, data, distributed
from recipes.common.config import ConfigError
from recipes.lm.train import load_config, train
from tests.runs import LM, read_jsonl

VOCAB = 384


@pytest.fixture(scope="module")
def corpus() -> data.Corpus:
    return data.load_corpus("stdlib", None, 150_000, 0.1, "uint8")


def cache_files(folder) -> dict[str, float]:
    """The cache folder's files and their modification times (ns)."""
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir())}


def test_bpe_of_the_standard_library_round_trips_and_compresses(corpus, tmp_path):
    tokens, tokenizer = bpe.tokenized(corpus, VOCAB, tmp_path)
    assert bpe.MIN_VOCAB_SIZE < tokenizer.vocab_size <= VOCAB and tokenizer.separator == 0
    for split, stream in ((tokens.train, corpus.train), (tokens.val, corpus.val)):
        assert split.dtype == np.uint16 and split.max() < tokenizer.vocab_size
        assert tokenizer.decode(split) == stream.tobytes().decode("utf-8", errors="replace")
        assert np.count_nonzero(split == tokenizer.separator) == np.count_nonzero(stream == 0)
    assert len(tokens.train) < 0.6 * len(corpus.train)  # merges learnt from the text: under 0.6 tokens per byte
    text = "def f(x):\n\treturn x ** 2  # ünïcode ∑ 😀\r\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode_stream(data.encode("a\0\0b\0"))) == "a\0\0b\0"


def test_bpe_cache_is_reused_and_another_corpus_trains_anew(corpus, tmp_path, monkeypatch):
    first, tokenizer = bpe.tokenized(corpus, VOCAB, tmp_path)
    written = cache_files(tmp_path)
    stem = f"bpe_{VOCAB}_{bpe.corpus_digest(corpus)}"
    assert sorted(written) == [f"{stem}.json", f"{stem}.sha256", f"{stem}.train.npy", f"{stem}.val.npy"]
    listed = [f"{hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}  {name}"  # as sha256sum writes it
              for name in (f"{stem}.json", f"{stem}.train.npy", f"{stem}.val.npy")]
    assert (tmp_path / f"{stem}.sha256").read_text().splitlines() == listed
    trained = []
    monkeypatch.setattr(bpe.BPE, "train", classmethod(lambda cls, *args: trained.append(args) or pytest.fail()))
    monkeypatch.setattr(bpe.BPE, "encode_stream", lambda self, stream: pytest.fail("encoded again"))
    again, loaded = bpe.tokenized(corpus, VOCAB, tmp_path)
    assert cache_files(tmp_path) == written and not trained
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    assert loaded.tokenizer.get_vocab() == tokenizer.tokenizer.get_vocab()
    monkeypatch.undo()
    other = data.Corpus(train=corpus.train[:-1000], val=corpus.val)
    bpe.tokenized(other, VOCAB, tmp_path)
    assert len(cache_files(tmp_path)) == 8, "another corpus, another digest"
    (tmp_path / f"{stem}.sha256").unlink()
    with pytest.warns(RuntimeWarning, match=f"cache file {tmp_path / stem}.json has no SHA-256 in "
                                            f"{tmp_path / stem}.sha256; training the tokenizer again"):
        rebuilt, _ = bpe.tokenized(corpus, VOCAB, tmp_path)
    assert np.array_equal(rebuilt.train, first.train)
    assert (tmp_path / f"{stem}.sha256").read_text().splitlines() == listed


def test_unreadable_cache_files_are_rebuilt_with_a_warning(corpus, tmp_path):
    tokens = bpe.tokenized(corpus, VOCAB, tmp_path)[0]
    tokens = data.Corpus(train=np.array(tokens.train), val=np.array(tokens.val))  # copies: the files change below
    stem = tmp_path / f"bpe_{VOCAB}_{bpe.corpus_digest(corpus)}"
    ids = stem.with_suffix(".train.npy")
    ids.write_bytes(ids.read_bytes()[:200])  # cut short, as by a full disk
    with pytest.warns(RuntimeWarning, match=f"cache file {ids} cannot be read .*; encoding the corpus again"):
        rebuilt, _ = bpe.tokenized(corpus, VOCAB, tmp_path)
    assert np.array_equal(rebuilt.train, tokens.train)
    stem.with_suffix(".json").write_text('{"version": "1.0", "model": ')
    with pytest.warns(RuntimeWarning, match="cannot be read .*; training the tokenizer again"):
        retrained, tokenizer = bpe.tokenized(corpus, VOCAB, tmp_path)
    assert np.array_equal(retrained.val, tokens.val) and tokenizer.vocab_size > bpe.MIN_VOCAB_SIZE
    np.save(stem.with_suffix(".val.npy"), np.full(5, 65535, dtype=np.uint16))  # readable, but not this tokenizer's
    with pytest.warns(RuntimeWarning, match="holds id 65535, outside the tokenizer's"):
        bpe.tokenized(corpus, VOCAB, tmp_path)
    assert not list(tmp_path.glob(".*.tmp*")), "no temporary file is left behind"


def zero_a_block(stem):
    """Zero 4 KiB of the training ids (ids 0: in the vocabulary)."""
    ids = stem.with_suffix(".train.npy")
    content = bytearray(ids.read_bytes())
    assert any(content[8192:12288])
    content[8192:12288] = bytes(4096)
    ids.write_bytes(content)
    return [ids]


def flip_a_bit(stem):
    """Flip the lowest bit of one training id (an id below the even vocabulary size stays below it)."""
    ids = stem.with_suffix(".train.npy")
    content = bytearray(ids.read_bytes())
    content[len(content) // 2 & ~1] ^= 1  # little-endian uint16: the even byte holds the low bits
    ids.write_bytes(content)
    return [ids]


def keep_half_the_ids(stem):
    """Write a valid ids file holding the first half of the training ids."""
    ids = stem.with_suffix(".train.npy")
    np.save(ids, np.load(ids)[: len(np.load(ids)) // 2])
    return [ids]


def swap_train_and_val(stem):
    train, val = stem.with_suffix(".train.npy"), stem.with_suffix(".val.npy")
    content = train.read_bytes()
    train.write_bytes(val.read_bytes())
    val.write_bytes(content)
    return [train, val]


def edit_the_tokenizer(stem):
    """Drop the tokenizer's first merge: still a valid tokenizer, which encodes the corpus otherwise."""
    tokenizer = stem.with_suffix(".json")
    content = json.loads(tokenizer.read_text())
    del content["model"]["merges"][0]
    tokenizer.write_text(json.dumps(content))
    return [tokenizer]


@pytest.mark.parametrize("damage", [zero_a_block, flip_a_bit, keep_half_the_ids, swap_train_and_val,
                                    edit_the_tokenizer])
def test_damaged_or_swapped_cache_files_are_rebuilt_with_a_warning_naming_them(corpus, tmp_path, damage):
    """Files that still load but are not what was written: each is rebuilt, named in a warning, and the ids are
    those of a fresh cache; the record lists the rebuilt files, so the next run loads them without a word."""
    tokens = bpe.tokenized(corpus, VOCAB, tmp_path)[0]
    tokens = data.Corpus(train=np.array(tokens.train), val=np.array(tokens.val))  # copies: the files change below
    stem = tmp_path / f"bpe_{VOCAB}_{bpe.corpus_digest(corpus)}"
    damaged = damage(stem)
    with pytest.warns(RuntimeWarning) as caught:
        rebuilt, _ = bpe.tokenized(corpus, VOCAB, tmp_path)
    messages = [str(warning.message) for warning in caught]
    assert messages == [f"cache file {path} does not match its SHA-256 in {stem}.sha256; "
                        + ("training the tokenizer again" if path.suffix == ".json" else "encoding the corpus again")
                        for path in damaged]
    assert np.array_equal(rebuilt.train, tokens.train) and np.array_equal(rebuilt.val, tokens.val)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bpe.tokenized(corpus, VOCAB, tmp_path)


def test_a_folder_where_a_cache_file_belongs_is_named(corpus, tmp_path):
    stem = tmp_path / f"bpe_{VOCAB}_{bpe.corpus_digest(corpus)}"
    stem.with_suffix(".train.npy").mkdir()
    with pytest.raises(ConfigError, match=f"^{stem}.train.npy is a folder, where the BPE cache keeps a file; move it "
                                          "away or choose another data.cache_dir$"):
        bpe.tokenized(corpus, VOCAB, tmp_path)


def test_a_failed_write_leaves_neither_the_file_nor_a_temporary(tmp_path):
    def fail(temporary):
        temporary.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        bpe._write_atomically(tmp_path / "ids.npy", fail)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("rank", "order"), [(0, ["fn", "barrier"]), (1, ["barrier", "fn"])])
def test_rank_zero_runs_first_and_the_others_after_the_barrier(monkeypatch, rank, order):
    """What lets rank 0 alone train and write the tokenizer while the other ranks wait, then load it."""
    events = []
    monkeypatch.setattr(distributed, "barrier", lambda ctx: events.append("barrier"))
    ctx = distributed.Context(rank=rank, world_size=2)
    assert distributed.main_first(lambda: events.append("fn") or rank, ctx) == rank
    assert events == order


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.tokenizer=bpe", "data.vocab_size=256"], "data.vocab_size must be >= 257 for data.tokenizer=bpe"),
        (["data.tokenizer=bpe", "data.source=binary", "data.path=pyproject.toml"],
         "data.tokenizer=bpe trains a tokenizer on text: data.source must be stdlib, packages or text, not binary"),
        (["data.tokenizer=words"], "data.tokenizer must be one of bytes, bpe; got 'words'"),
        (["model.vocab_size=0"], "model.vocab_size must be > 0 or null"),
    ],
)
def test_bad_vocabulary_settings_are_rejected_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        LM.config(tmp_path, *overrides)


def test_lm_recipe_trains_on_bpe_tokens_and_reuses_the_cached_tokenizer(tmp_path, monkeypatch):
    bpe_settings = ("data.tokenizer=bpe", f"data.vocab_size={VOCAB}", "data.max_bytes=120000", "train.steps=3",
                    "train.eval_interval=3")
    summary = train(LM.config(tmp_path, *bpe_settings))
    assert np.isfinite(summary["val/loss"])
    vocab_size = OmegaConf.load(tmp_path / "tiny" / "config.yaml").model.vocab_size
    (tokenizer_file,) = (tmp_path / "cache").glob("*.json")
    assert vocab_size == bpe.BPE.load(tokenizer_file).vocab_size <= VOCAB
    rows = [row for row in read_jsonl(tmp_path / "tiny" / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == 3 and rows[0]["train/loss"] == pytest.approx(np.log(vocab_size), rel=0.1)
    monkeypatch.setattr(bpe.BPE, "train", classmethod(lambda cls, *args: pytest.fail("trained again")))
    train(LM.config(tmp_path, *bpe_settings, "name=second", "train.steps=1"))
    with pytest.raises(ConfigError, match=f"model.vocab_size 300 is smaller than the data's vocabulary of {vocab_size} "
                                          "tokens \\(data.tokenizer=bpe\\)"):
        train(LM.config(tmp_path, *bpe_settings, "name=third", "model.vocab_size=300"))


def test_the_bpe_config_validates_and_names_a_real_vocabulary():
    cfg = load_config(str(LM.configs / "bpe_32k.yaml"))
    assert (cfg.data.tokenizer, cfg.data.vocab_size, cfg.data.context_length) == ("bpe", 32768, 8192)
    assert cfg.model.vocab_size is None and cfg.train.device == "cuda"


def test_the_separator_text_inside_a_document_is_text(tmp_path):
    """Tokenizer code quotes "<|endoftext|>" (15 files of this venv's site-packages): it is encoded as text and
    round-trips; only a NUL of the byte stream becomes the separator token."""
    tokenizer = bpe.BPE.train(["print('hello world')\n" * 50, "eos = '<|endoftext|>'\n"], 300)
    for t in (tokenizer, bpe.BPE.load(tokenizer.save(tmp_path / "t.json") or tmp_path / "t.json")):
        ids = t.encode_stream(data.encode("a<|endoftext|>b\0c"))
        assert np.count_nonzero(ids == t.separator) == 1 and t.decode(ids) == "a<|endoftext|>b\0c"
