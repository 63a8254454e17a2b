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
``val_fraction``) trains anew. Files are written under a temporary name and renamed, so a process never
reads a partial file, even while another writes the same one; a cache file that cannot be read is
rebuilt, with a warning naming it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from recipes.common.data import SEPARATOR, Corpus

FORMAT = b"flashbob-bpe-2"  # part of the digest: a change to how tokenizers are trained or ids stored retrains
# (2: the text "<|endoftext|>" inside a document is encoded as text, not as the separator)
SEPARATOR_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # the 256 bytes and the separator


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
    """
    stem = Path(cache_dir) / f"bpe_{vocab_size}_{corpus_digest(corpus)}"
    tokenizer_path = stem.with_suffix(".json")
    tokenizer = _cached(tokenizer_path, BPE.load, "training the tokenizer again")
    fresh = tokenizer is None
    if fresh:
        tokenizer = BPE.train(split_documents(corpus.train), vocab_size)
        tokenizer.save(tokenizer_path)
    train, val = (_ids(stem.with_suffix(f".{name}.npy"), tokenizer, getattr(corpus, name), fresh)
                  for name in ("train", "val"))
    return Corpus(train=train, val=val), tokenizer


def _ids(path: Path, tokenizer: BPE, stream: np.ndarray, fresh: bool) -> np.ndarray:
    """The ids of ``stream`` cached at ``path`` (unless the tokenizer is ``fresh``), else encoded and written."""
    ids = None if fresh else _cached(path, lambda p: _load_ids(p, tokenizer), "encoding the corpus again")
    if ids is None:
        encoded = tokenizer.encode_stream(stream)
        _write_atomically(path, lambda temporary: np.save(temporary, encoded))
        ids = _load_ids(path, tokenizer)
    return ids


def _cached(path: Path, load: Callable[[Path], object], remedy: str):
    """``load(path)``; ``None`` if there is no such file, or, with a warning, if it cannot be read."""
    if not path.is_file():
        return None
    try:
        return load(path)
    except Exception as error:  # noqa: BLE001  (tokenizers raises plain Exception for a malformed file)
        warnings.warn(f"cache file {path} cannot be read ({type(error).__name__}: {error}); {remedy}", RuntimeWarning,
                      stacklevel=3)
        return None


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
