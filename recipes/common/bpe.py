"""Byte-level BPE tokenizers trained offline on a recipe's own corpus (with the ``tokenizers`` library), and
the token ids they give, cached on disk.

The byte corpus of :mod:`recipes.common.data` (documents joined by a NUL byte) is split into its
documents; a byte-level BPE of ``vocab_size`` tokens is trained on the training split's documents,
and each split is encoded document by document, the separator token ``<|endoftext|>`` standing where
the byte stream had its NUL. Nothing is downloaded. Text is read as UTF-8; bytes that are not valid
UTF-8 (e.g. a character cut at ``data.max_bytes``) become U+FFFD.

The cache, in one folder: ``bpe_<vocab_size>_<digest>.json`` (the tokenizer) and
``bpe_<vocab_size>_<digest>.{train,val}.npy`` (the ids, ``uint16``, or ``uint32`` above 65,536
tokens), where ``digest`` is the SHA-256 of both splits' bytes and of :data:`FORMAT`. So the same
corpus loads what an earlier run wrote, and another corpus (other files, ``max_bytes`` or
``val_fraction``) trains anew. Beside them, ``bpe_<vocab_size>_<digest>.sha256`` records the SHA-256 of
each of the three files (``sha256sum`` format: check them by hand with ``sha256sum -c``); it is written
after the files it lists, so the ids listed there are their split's, encoded by the tokenizer listed
with them. Files are written under a temporary name and renamed, so a process never reads a partial
file, even while another writes the same one; a cache file that cannot be read, or whose SHA-256 is not
the recorded one (damaged, edited, another split's ids), is rebuilt, with a warning naming it. A folder
where a cache file belongs is a :class:`~recipes.common.config.ConfigError` naming it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from recipes.common.checkpoint import sha256_of
from recipes.common.config import ConfigError
from recipes.common.data import SEPARATOR, Corpus

FORMAT = b"flashbob-bpe-2"  # part of the digest: a change to how tokenizers are trained or ids stored retrains
# (2: the text "<|endoftext|>" inside a document is encoded as text, not as the separator)
SEPARATOR_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # the 256 bytes and the separator
RECORD_LINE = re.compile(r"([0-9a-f]{64})  (.+)")  # a line of the record: SHA-256, two spaces, file name


class BPE:
    """A byte-level BPE tokenizer whose token 0 is the document separator ``<|endoftext|>``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        separator = tokenizer.token_to_id(SEPARATOR_TOKEN)
        if separator is None:
            raise ValueError(f"the tokenizer has no separator token {SEPARATOR_TOKEN!r}")
        self.separator = separator
        # The text "<|endoftext|>" in a document (tokenizer code quotes it) is encoded as text; only
        # encode_stream puts the separator token, where the byte stream has a NUL. Not saved in the JSON.
        tokenizer.encode_special_tokens = True

    @classmethod
    def train(cls, documents: Sequence[str], vocab_size: int) -> BPE:
        """Train on ``documents`` up to ``vocab_size`` tokens (fewer if the text has no more merges to make).

        Raises:
            ValueError: ``vocab_size`` is below :data:`MIN_VOCAB_SIZE`.
        """
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"a byte-level BPE needs vocab_size >= {MIN_VOCAB_SIZE} (256 bytes and the separator), "
                             f"got {vocab_size}")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(documents, trainer, length=len(documents))
        return cls(tokenizer)

    @classmethod
    def load(cls, path: Path) -> BPE:
        """The tokenizer saved at ``path`` (any error of the file is raised as it comes)."""
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        """Write the tokenizer to ``path`` atomically."""
        _write_atomically(path, lambda temporary: self.tokenizer.save(str(temporary)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        """The smallest unsigned type that holds every id."""
        return np.uint16 if self.vocab_size <= 2**16 else np.uint32

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text`` (one document: a NUL in it is an ordinary byte)."""
        return np.asarray(self.tokenizer.encode(text).ids, dtype=self.dtype)

    def encode_stream(self, stream: np.ndarray) -> np.ndarray:
        """The ids of a byte stream (``uint8``) of documents joined by NUL: each document's ids, separated by
        the separator token."""
        documents = split_documents(stream)
        pieces = []
        for i, encoding in enumerate(self.tokenizer.encode_batch(documents)):
            if i:
                pieces.append(np.array([self.separator], dtype=self.dtype))
            pieces.append(np.asarray(encoding.ids, dtype=self.dtype))
        return np.concatenate(pieces)

    def decode(self, ids) -> str:
        """The text of ``ids``, a NUL where a separator token stands (the inverse of :meth:`encode_stream`
        for valid UTF-8)."""
        ids = np.asarray(ids)
        cuts = np.flatnonzero(ids == self.separator)
        pieces = np.split(ids, cuts)
        texts = [self.tokenizer.decode((piece[1:] if i else piece).tolist()) for i, piece in enumerate(pieces)]
        return SEPARATOR.decode().join(texts)


def split_documents(stream: np.ndarray) -> list[str]:
    """The documents of a NUL-joined byte stream, as text (invalid UTF-8 becomes U+FFFD)."""
    return [document.decode("utf-8", errors="replace") for document in stream.tobytes().split(SEPARATOR)]


def corpus_digest(corpus: Corpus) -> str:
    """A hex SHA-256 of :data:`FORMAT` and both splits' bytes (16 characters)."""
    digest = hashlib.sha256(FORMAT)
    for split in (corpus.train, corpus.val):
        digest.update(len(split).to_bytes(8, "little"))
        digest.update(np.ascontiguousarray(split).tobytes())
    return digest.hexdigest()[:16]


def tokenized(corpus: Corpus, vocab_size: int, cache_dir: str | Path) -> tuple[Corpus, BPE]:
    """``corpus`` (bytes) as BPE token ids, and the tokenizer, from ``cache_dir`` where an earlier run left them.

    Otherwise the tokenizer is trained on the training split and written, and both splits are
    encoded and written (a tokenizer trained now always encodes anew). The ids are memory-mapped.

    Raises:
        ConfigError: a folder is where a cache file belongs.
    """
    stem = Path(cache_dir) / f"bpe_{vocab_size}_{corpus_digest(corpus)}"
    tokenizer_path, record_path = stem.with_suffix(".json"), stem.with_suffix(".sha256")
    ids_paths = {name: stem.with_suffix(f".{name}.npy") for name in ("train", "val")}
    _refuse_folders([tokenizer_path, record_path, *ids_paths.values()])
    record = _Record(record_path)
    tokenizer = record.cached(tokenizer_path, BPE.load, "training the tokenizer again")
    fresh = tokenizer is None
    if fresh:
        tokenizer = BPE.train(split_documents(corpus.train), vocab_size)
        tokenizer.save(tokenizer_path)
        record.written(tokenizer_path)
    train, val = (_ids(path, tokenizer, getattr(corpus, name), record, fresh) for name, path in ids_paths.items())
    record.save()
    return Corpus(train=train, val=val), tokenizer


def _ids(path: Path, tokenizer: BPE, stream: np.ndarray, record: _Record, fresh: bool) -> np.ndarray:
    """The ids of ``stream`` cached at ``path`` (unless the tokenizer is ``fresh``), else encoded and written."""
    ids = None if fresh else record.cached(path, lambda p: _load_ids(p, tokenizer), "encoding the corpus again")
    if ids is None:
        encoded = tokenizer.encode_stream(stream)
        _write_atomically(path, lambda temporary: np.save(temporary, encoded))
        record.written(path)
        ids = _load_ids(path, tokenizer)
    return ids


def _refuse_folders(paths: Sequence[Path]) -> None:
    """Raise :class:`ConfigError` naming the first of ``paths`` that is a folder (a cache file can be neither
    read nor replaced there)."""
    for path in paths:
        if path.is_dir():
            raise ConfigError(f"{path} is a folder, where the BPE cache keeps a file; move it away or choose "
                              "another data.cache_dir")


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``."""
    with open(path, "rb") as file:
        return sha256_of(file, os.fstat(file.fileno()).st_size)


class _Record:
    """The SHA-256 of each file of one cache entry, by file name, kept in a ``sha256sum``-format file beside them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.digests = self._read() if path.is_file() else {}
        self.changed = False

    def _read(self) -> dict[str, str]:
        """The digests the record file lists (a line that is not ``<64 hex digits>  <name>`` lists none)."""
        lines = self.path.read_bytes().decode("utf-8", errors="replace").splitlines()
        return {match[2]: match[1] for match in map(RECORD_LINE.fullmatch, lines) if match}

    def cached(self, path: Path, load: Callable[[Path], object], remedy: str):
        """``load(path)``; ``None`` if there is no such file, or, with a warning naming it, if it cannot be read
        or its SHA-256 is not the one recorded for it."""
        if not path.is_file():
            return None
        try:
            loaded = load(path)
        except Exception as error:  # noqa: BLE001  (tokenizers raises plain Exception for a malformed file)
            problem = f"cannot be read ({type(error).__name__}: {error})"
        else:
            if path.name not in self.digests:
                problem = f"has no SHA-256 in {self.path}"
            elif file_sha256(path) != self.digests[path.name]:
                problem = f"does not match its SHA-256 in {self.path}"
            else:
                return loaded
        warnings.warn(f"cache file {path} {problem}; {remedy}", RuntimeWarning, stacklevel=3)
        return None

    def written(self, path: Path) -> None:
        """Record the SHA-256 of ``path``, which was just written."""
        self.digests[path.name] = file_sha256(path)
        self.changed = True

    def save(self) -> None:
        """Write the record file atomically, if a file was recorded since it was read."""
        if self.changed:
            text = "".join(f"{digest}  {name}\n" for name, digest in sorted(self.digests.items()))
            _write_atomically(self.path, lambda temporary: temporary.write_text(text))


def _load_ids(path: Path, tokenizer: BPE) -> np.ndarray:
    """The ids saved at ``path``, memory-mapped, checked to be a 1-D array of ``tokenizer``'s ids.

    Raises:
        ValueError: the file is not such an array.
    """
    ids = np.load(path, mmap_mode="r", allow_pickle=False)
    if ids.ndim != 1 or ids.dtype != tokenizer.dtype:
        raise ValueError(f"expected a 1-D {np.dtype(tokenizer.dtype)} array, got {ids.ndim}-D {ids.dtype}")
    if len(ids) and int(ids.max()) >= tokenizer.vocab_size:
        raise ValueError(f"it holds id {int(ids.max())}, outside the tokenizer's {tokenizer.vocab_size} tokens")
    return ids


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` a temporary file in ``path``'s folder, then rename it to ``path`` (atomic on one file system)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
