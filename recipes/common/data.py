"""Byte-level token streams for the LM and TTT recipes and the random windows that batch them.

Tokens are bytes (vocabulary 256), so nothing is downloaded: the built-in corpus is the Python
standard library's own ``.py`` source, read from the running interpreter's installation, or, larger,
the ``.py`` source of its installed packages (``site-packages``). Text files (a glob) or a
pre-tokenised binary file (``uint8``/``uint16``/``uint32``) can be used instead.
Documents are joined with a NUL byte, which never occurs in text, as the separator.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 256
SEPARATOR = b"\0"
#: The order of the validation windows, the same for every train.seed: a fixed held-out set, so runs of other seeds
#: compare (the LM recipe's seed 0 used train.seed + 1 before it was fixed)
VALIDATION_SEED = 1
BINARY_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}  # uint32: vocabularies above 65,536


#: The separator's token id: the NUL byte, and token 0 of the BPE tokenizer (recipes.common.bpe)
SEPARATOR_ID = 0


def document_ids(tokens: torch.Tensor, separator: int = SEPARATOR_ID) -> torch.Tensor:
    """The document of each token of ``tokens`` ``(batch, seq)``, counted from 0 in each row: a document ends with
    its separator token (so the separator belongs to the document it closes)."""
    ends = (tokens == separator).long()
    return ends.cumsum(dim=-1) - ends


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


def package_sources() -> list[tuple[str, Path]]:
    """``(relative name, path)`` of every ``.py`` file of the interpreter's installed packages (``sysconfig``'s
    ``purelib``, its ``site-packages``), sorted by name: a corpus that depends on what is installed."""
    root = Path(sysconfig.get_paths()["purelib"])
    return sorted((path.relative_to(root).as_posix(), path) for path in root.rglob("*.py") if path.is_file())


def glob_root(pattern: str) -> Path:
    """The folder of ``pattern`` above its first wildcard (``/data/corpus`` of ``/data/corpus/**/*.txt``)."""
    root = []
    for part in Path(pattern).parts[:-1]:
        if glob.has_magic(part):
            break
        root.append(part)
    return Path(*root) if root else Path(".")


def text_sources(pattern: str) -> list[tuple[str, Path]]:
    """Files matching the (recursive) glob ``pattern``, sorted by name: the path relative to the pattern's
    folder above its first wildcard, so that the split does not depend on where the corpus lies or on how
    the pattern spells that folder (absolute, relative, ``./``)."""
    root = glob_root(pattern)
    paths = [p for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
    if not paths:
        raise FileNotFoundError(f"data.path {pattern!r} matches no files")
    return sorted((Path(os.path.relpath(p, root)).as_posix(), Path(p)) for p in paths)


def is_validation(name: str, val_fraction: float) -> bool:
    """Whether the document ``name`` belongs to the validation split: the SHA-256 of its bytes (``os.fsencode``:
    a file name that is not UTF-8 has them too) falls below ``val_fraction``."""
    digest = int.from_bytes(hashlib.sha256(os.fsencode(name)).digest()[:8], "big")
    return digest < val_fraction * 2**64


def split_documents(sources: list[tuple[str, Path]], max_bytes: int, val_fraction: float) -> Corpus:
    """Read documents in order into the split their name hashes to, until each split holds its share.

    The validation split gets ``val_fraction * max_bytes`` bytes and training the rest; each is cut
    to exactly its share. Which split a document lands in depends only on its name, so the splits
    are disjoint and the same on every run. If every name hashes to the same split (one file, or a
    few), that would leave the other empty: the documents are cut by position instead
    (:func:`split_by_position`).
    """
    if len({is_validation(name, val_fraction) for name, _ in sources}) == 1:
        return split_by_position(sources, max_bytes, val_fraction)
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


def split_by_position(sources: list[tuple[str, Path]], max_bytes: int, val_fraction: float) -> Corpus:
    """The documents read in order, each followed by the separator, up to ``max_bytes`` bytes; the last
    ``val_fraction`` of them is the validation split."""
    chunks, size = [], 0
    for _, path in sources:
        if size >= max_bytes:
            break
        with open(path, "rb") as file:
            chunks.append(file.read(max_bytes - size) + SEPARATOR)
        size += len(chunks[-1])
    stream = np.frombuffer(b"".join(chunks), dtype=np.uint8)[:max_bytes]
    cut = len(stream) - int(len(stream) * val_fraction)
    return Corpus(train=stream[:cut], val=stream[cut:])


def binary_file(path: str) -> Path:
    """``path`` as a ``Path``, checked to be a file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"data.path {path!r} is not a file")
    return Path(path)


def binary_corpus(path: str, dtype: str, val_fraction: float) -> Corpus:
    """A pre-tokenised file read through ``np.memmap``; its last ``val_fraction`` is the validation split."""
    tokens = np.memmap(binary_file(path), dtype=BINARY_DTYPES[dtype], mode="r")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return Corpus(train=tokens[:cut], val=tokens[cut:])


def load_corpus(source: str, path: str | None, max_bytes: int, val_fraction: float, binary_dtype: str) -> Corpus:
    """The corpus named by ``source``: ``"stdlib"``, ``"packages"``, ``"text"`` (glob ``path``) or ``"binary"``
    (file ``path``)."""
    if source == "stdlib":
        return split_documents(stdlib_sources(), max_bytes, val_fraction)
    if source == "packages":
        return split_documents(package_sources(), max_bytes, val_fraction)
    if source == "text":
        return split_documents(text_sources(path), max_bytes, val_fraction)
    if source == "binary":
        return binary_corpus(path, binary_dtype, val_fraction)
    raise ValueError(f"data.source must be 'stdlib', 'packages', 'text' or 'binary', got {source!r}")


class Batches:
    r"""Disjoint windows of ``context_length + 1`` tokens, shuffled once per epoch, ``batch_size`` per rank at a time.

    The split is cut into :math:`W = \lfloor (T - 1) / \text{context\_length} \rfloor` windows;
    window :math:`j` holds tokens :math:`[jL, (j + 1)L]` (neighbours share one boundary token, the
    last target of one and the first input of the next). Epoch :math:`e` visits all :math:`W` in
    the order of a permutation drawn from ``(seed, e)``, and global batch :math:`i` is positions
    :math:`iG, \dots, (i + 1)G - 1` of that endless sequence, :math:`G = \text{batch\_size}
    \cdot \text{world\_size}`; rank :math:`r` takes the :math:`r`-th run of ``batch_size`` of
    them. So the ranks never share a window, together they cover the split once per epoch, and
    rank :math:`r`'s rows of a batch are rows :math:`[rB, (r + 1)B)` of the same batch drawn in
    one process with ``batch_size * world_size``. A batch depends only on its index, so the index
    saved by :meth:`state_dict` restores the stream exactly.
    """

    def __init__(self, tokens: np.ndarray, context_length: int, batch_size: int, seed: int, split: str,
                 *, rank: int = 0, world_size: int = 1):
        if len(tokens) < context_length + 1:
            raise ValueError(
                f"the {split} split has {len(tokens)} tokens, fewer than data.context_length + 1 = "
                f"{context_length + 1}; raise data.max_bytes or data.val_fraction, or shorten the context"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.tokens, self.context_length, self.batch_size, self.seed = tokens, context_length, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.windows = (len(tokens) - 1) // context_length
        self.index = 0
        self._order: tuple[int, np.ndarray] | None = None
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """A digest of the windows' tokens and ``context_length`` (the length and 64 evenly spaced runs of 4,096
        tokens: cheap on a large memory-mapped file, and changed by any other corpus, split or tokenizer)."""
        if self._fingerprint is None:
            tokens = self.tokens
            digest = hashlib.sha256(f"{len(tokens)}:{self.context_length}:{tokens.dtype}".encode())
            for start in np.linspace(0, max(len(tokens) - 4096, 0), 64).astype(np.int64):
                digest.update(np.ascontiguousarray(tokens[start : start + 4096]).tobytes())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of the window indices that epoch ``epoch`` visits."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows))
        return self._order[1]

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and next-token targets ``(batch_size, context_length)`` of batch ``index``, int64."""
        first = (index * self.world_size + self.rank) * self.batch_size
        starts = [self.order(p // self.windows)[p % self.windows] * self.context_length
                  for p in range(first, first + self.batch_size)]
        windows = np.stack([self.tokens[s : s + self.context_length + 1] for s in starts]).astype(np.int64)
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the current position; advances the position by one."""
        batch = self.get(self.index)
        self.index += 1
        return batch

    @property
    def epoch(self) -> float:
        """Passes over the split so far (windows drawn by all ranks / windows in the split)."""
        return self.index * self.batch_size * self.world_size / self.windows

    def state_dict(self) -> dict:
        return {"index": self.index, "seed": self.seed, "global_batch": self.batch_size * self.world_size,
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` left off; with another global batch size, at the same window position.

        Raises:
            ValueError: another seed, or other windows (another corpus, split, tokenizer or context length:
                the saved position would point elsewhere, and held-out documents could be trained on).
        """
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint data seed {state['seed']} differs from this run's {self.seed}")
        if state.get("fingerprint", self.fingerprint()) != self.fingerprint():
            raise ValueError(
                f"the checkpoint's training windows (fingerprint {state['fingerprint']}) differ from this run's "
                f"({self.fingerprint()}): another corpus, data.max_bytes, data.val_fraction, tokenizer or "
                "data.context_length; resume with the same data, or start a new run"
            )
        consumed = state["index"] * state.get("global_batch", self.batch_size * self.world_size)
        global_batch = self.batch_size * self.world_size
        if consumed % global_batch:
            raise ValueError(
                f"the checkpoint has drawn {consumed} windows, not a multiple of this run's global batch "
                f"(data.batch_size {self.batch_size} x {self.world_size} processes = {global_batch})"
            )
        self.index = consumed // global_batch
