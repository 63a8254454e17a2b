"""Byte-level token streams for the LM recipe and the random windows that batch them.

Tokens are bytes (vocabulary 256), so nothing is downloaded: the built-in corpus is the Python
standard library's own ``.py`` source, read from the running interpreter's installation. Text
files (a glob) or a pre-tokenised binary file (``uint8``/``uint16``) can be used instead.
Documents are joined with a NUL byte, which never occurs in text, as the separator.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 256
SEPARATOR = b"\0"
BINARY_DTYPES = {"uint8": np.uint8, "uint16": np.uint16}


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as ``uint8`` tokens."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens) -> str:
    """Text of byte tokens; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """Training and validation token streams, 1-D arrays of token ids."""

    train: np.ndarray
    val: np.ndarray


def stdlib_sources() -> list[tuple[str, Path]]:
    """``(relative name, path)`` of every ``.py`` file of the standard library, sorted by name.

    Third-party packages installed inside the standard library folder (``site-packages``,
    ``dist-packages``) are left out, so the corpus depends only on the Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        name = path.relative_to(root).as_posix()
        if not {"site-packages", "dist-packages"} & set(name.split("/")) and path.is_file():
            files.append((name, path))
    return sorted(files)


def text_sources(pattern: str) -> list[tuple[str, Path]]:
    """Files matching the (recursive) glob ``pattern``, sorted by path."""
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"data.path {pattern!r} matches no files")
    return [(p, Path(p)) for p in paths]


def is_validation(name: str, val_fraction: float) -> bool:
    """Whether the document ``name`` belongs to the validation split: its SHA-256 falls below ``val_fraction``."""
    digest = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return digest < val_fraction * 2**64


def split_documents(sources: list[tuple[str, Path]], max_bytes: int, val_fraction: float) -> Corpus:
    """Read documents in order into the split their name hashes to, until each split holds its share.

    The validation split gets ``val_fraction * max_bytes`` bytes and training the rest; each is cut
    to exactly its share. Which split a document lands in depends only on its name, so the splits
    are disjoint and the same on every run.
    """
    budget = {True: int(max_bytes * val_fraction), False: max_bytes - int(max_bytes * val_fraction)}
    chunks: dict[bool, list[bytes]] = {True: [], False: []}
    filled = {True: 0, False: 0}
    for name, path in sources:
        if all(filled[s] >= budget[s] for s in budget):
            break
        split = is_validation(name, val_fraction)
        if filled[split] >= budget[split]:
            continue
        data = path.read_bytes() + SEPARATOR
        chunks[split].append(data)
        filled[split] += len(data)
    train, val = (np.frombuffer(b"".join(chunks[s]), dtype=np.uint8)[: budget[s]] for s in (False, True))
    return Corpus(train=train, val=val)


def binary_corpus(path: str, dtype: str, val_fraction: float) -> Corpus:
    """A pre-tokenised file read through ``np.memmap``; its last ``val_fraction`` is the validation split."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"data.path {path!r} is not a file")
    tokens = np.memmap(path, dtype=BINARY_DTYPES[dtype], mode="r")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return Corpus(train=tokens[:cut], val=tokens[cut:])


def load_corpus(source: str, path: str | None, max_bytes: int, val_fraction: float, binary_dtype: str) -> Corpus:
    """The corpus named by ``source``: ``"stdlib"``, ``"text"`` (glob ``path``) or ``"binary"`` (file ``path``)."""
    if source == "stdlib":
        return split_documents(stdlib_sources(), max_bytes, val_fraction)
    if source == "text":
        return split_documents(text_sources(path), max_bytes, val_fraction)
    if source == "binary":
        return binary_corpus(path, binary_dtype, val_fraction)
    raise ValueError(f"data.source must be 'stdlib', 'text' or 'binary', got {source!r}")


class Batches:
    """Random windows of ``context_length + 1`` tokens, ``batch_size`` at a time.

    Batch ``i`` is drawn by a generator seeded with ``(seed, i)``, so a batch depends only on its
    index and the position saved by :meth:`state_dict` restores the stream exactly.
    """

    def __init__(self, tokens: np.ndarray, context_length: int, batch_size: int, seed: int, split: str):
        if len(tokens) < context_length + 1:
            raise ValueError(
                f"the {split} split has {len(tokens)} tokens, fewer than data.context_length + 1 = "
                f"{context_length + 1}; raise data.max_bytes or data.val_fraction, or shorten the context"
            )
        self.tokens, self.context_length, self.batch_size, self.seed = tokens, context_length, batch_size, seed
        self.index = 0

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets ``(batch_size, context_length)`` of batch ``index``, int64."""
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.tokens) - self.context_length, size=self.batch_size)
        windows = np.stack([self.tokens[s : s + self.context_length + 1] for s in starts]).astype(np.int64)
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the current position; advances the position by one."""
        batch = self.get(self.index)
        self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint data seed {state['seed']} differs from this run's {self.seed}")
        self.index = state["index"]
