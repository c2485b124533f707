"""Offline byte-level training data: the Python source files installed on this machine.

What it reads, exactly: the files ending in ``.py`` (``suffixes``) under the ``roots`` (by default
the standard library directory that ``sysconfig`` names), walked without following symlinks. Not
read: symlinked files, hard links to a file already listed, empty files, files over
``max_file_bytes``, ``__pycache__`` directories, and ``site-packages`` / ``dist-packages``
directories below a root (installed packages, which a root of their own can name). Nothing is
downloaded.

The default leaves installed packages out so that installing or upgrading one never changes the
data, and a run can always resume on the data it started with (its corpus fingerprint is checked
on resume). Roots that hold installed packages (``--data-root`` pointed at site-packages) move
with every ``pip install``.
``SourceCorpus.describe()`` reports the roots, the counts of files and bytes, what was skipped and
a fingerprint of the file list, for a run to record.

Tokens are bytes (ids 0-255) plus four specials (``BOS``, ``PAD``, ``KEY``, ``VALUE``:
:mod:`s2attn.training.vocab`). Every file is one document, ``BOS`` followed by its bytes. Files are
split into train and validation by a hash of their path relative to their root, so a file never
changes sides, and copies of a package in two roots fall on the same side. ``TokenStream``
concatenates the documents of one split in an order shuffled per (seed, epoch) and cuts the
stream into rows of ``seq_len + 1`` tokens; with ``needle_fraction > 0`` some rows are retrieval
samples instead (:mod:`s2attn.training.needles`: needles, keys paired with values, planted in the
stream's own text after a ``BOS``, asked for at the end).

Determinism: the same corpus and seed give the same batches, and ``state_dict`` /
``load_state_dict`` resume a stream exactly, on one machine. Two machines with different Python
versions (or roots) list different files, so their batches differ; nothing here tries to make
them agree. Files that differ in content but not in path (or are copies under different paths) are
not detected: a vendored copy of a module can sit in the other split.

Memory: the corpus is never loaded; the stream holds the listing (paths and sizes), one file and
the batch being built.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .needles import _check_positive_int, make_multi_needle_sample, needle_overhead
from .vocab import BOS

__all__ = ["SourceCorpus", "TokenStream", "default_roots", "needle_filler", "split_of"]

_SPLITS = ("train", "val")
# Installed packages under a root (a non-venv interpreter keeps its site-packages inside the stdlib
# directory) are not walked with it: they change with every install.
_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _stable_int(*parts: object) -> int:
    """A 64-bit integer from ``parts`` that does not change between processes (unlike ``hash``)."""
    text = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def _check_fraction(val_fraction: float) -> None:
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, (int, float))
        or not 0.0 <= val_fraction <= 1.0
    ):
        raise ValueError(f"val_fraction must be a number in [0, 1], got {val_fraction!r}")


def split_of(relpath: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` for the file at POSIX path ``relpath`` (relative to its root).

    The first 8 bytes of the SHA-256 of the path, as a fraction of 2**64, below ``val_fraction``
    mean validation: stable across processes and machines, and independent of the other files.
    """
    _check_fraction(val_fraction)
    return "val" if _stable_int(relpath) / 2.0**64 < val_fraction else "train"


def default_roots() -> list[Path]:
    """The standard library directory of this interpreter (``sysconfig``'s ``stdlib`` path),
    resolved: a list of one. Outside a virtual environment the site-packages directory lies
    inside it, and is not walked (see the module docstring): ``pip install`` changes no file of
    the default corpus."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    return [root] if root.is_dir() else []


@dataclass(frozen=True)
class _Listing:
    """Every candidate file under some roots, before the split: (root index, relpath, size)."""

    files: tuple[tuple[int, str, int], ...]
    skipped: dict[str, int]


_LISTING_CACHE: dict[tuple, _Listing] = {}


def _list_files(
    roots: tuple[Path, ...], suffixes: tuple[str, ...], max_file_bytes: int
) -> _Listing:
    """Walk ``roots`` (resolved, distinct) once; cached per arguments for the process, since a
    root can hold tens of thousands of files (the site-packages of a torch install)."""
    key = (roots, suffixes, max_file_bytes)
    if key in _LISTING_CACHE:
        return _LISTING_CACHE[key]
    root_set = {str(r) for r in roots}
    files: list[tuple[int, str, int]] = []
    skipped = {"symlinks": 0, "hard_links": 0, "empty": 0, "too_large": 0, "unreadable": 0}
    seen_inodes: set[tuple[int, int]] = set()
    for index, root in enumerate(roots):
        # Depth-first with sorted entries: the listing, and which of two hard links is kept, do
        # not depend on the order the file system returns entries in.
        stack = [(str(root), "")]
        while stack:
            directory, prefix = stack.pop()
            try:
                with os.scandir(directory) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                skipped["unreadable"] += 1
                continue
            subdirs = []
            for entry in entries:
                try:
                    if entry.is_symlink():
                        if entry.name.endswith(suffixes):
                            skipped["symlinks"] += 1
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name == "__pycache__" or entry.path in root_set:
                            continue
                        if entry.name in _PACKAGE_DIRS:
                            continue
                        subdirs.append((entry.path, f"{prefix}{entry.name}/"))
                        continue
                    if not entry.name.endswith(suffixes):
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    skipped["unreadable"] += 1
                    continue
                if st.st_size == 0:
                    skipped["empty"] += 1
                    continue
                if st.st_size > max_file_bytes:
                    skipped["too_large"] += 1
                    continue
                if st.st_nlink > 1:
                    inode = (st.st_dev, st.st_ino)
                    if inode in seen_inodes:
                        skipped["hard_links"] += 1
                        continue
                    seen_inodes.add(inode)
                files.append((index, f"{prefix}{entry.name}", st.st_size))
            stack.extend(reversed(subdirs))
    listing = _Listing(tuple(sorted(files)), skipped)
    _LISTING_CACHE[key] = listing
    return listing


class SourceCorpus:
    """The source files under ``roots`` that fall in one split; reads a file only when asked.

    Args:
        roots: directories to walk (``str`` or ``Path``); ``None`` means :func:`default_roots`.
        split: ``"train"`` or ``"val"``.
        val_fraction: the share of files (by path hash, see :func:`split_of`) in ``"val"``.
        suffixes: file-name endings to read.
        max_file_bytes: larger files are skipped (generated tables, not code).

    Attributes:
        roots: the resolved roots, in the order given.
        files: ``(root, relpath)`` of every file in this split, sorted by root then path.
        sizes: the size in bytes of each file when listed.

    The walk follows the module docstring's rules (no symlinks, no ``site-packages`` below a root,
    each file under exactly one root) and is cached per (roots, suffixes, max_file_bytes) for the
    life of the process: files added later are not seen. Raises ``ValueError`` naming the roots
    when no file matches, and for a bad argument.
    """

    def __init__(
        self,
        roots: Sequence[str | os.PathLike] | None = None,
        split: str = "train",
        val_fraction: float = 0.05,
        suffixes: Sequence[str] = (".py",),
        max_file_bytes: int = 1_000_000,
    ):
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        _check_fraction(val_fraction)
        if isinstance(suffixes, str):
            suffixes = (suffixes,)
        suffixes = tuple(suffixes)
        if not suffixes or not all(isinstance(s, str) and s for s in suffixes):
            raise ValueError(f"suffixes must be non-empty strings, got {suffixes!r}")
        if (
            isinstance(max_file_bytes, bool)
            or not isinstance(max_file_bytes, int)
            or (max_file_bytes < 1)
        ):
            raise ValueError(f"max_file_bytes must be a positive int, got {max_file_bytes!r}")
        if roots is None:
            roots = default_roots()
        if isinstance(roots, (str, os.PathLike)):
            roots = [roots]
        resolved: list[Path] = []
        for r in roots:
            path = Path(r).resolve()
            if not path.is_dir():
                raise ValueError(f"roots: {str(r)!r} is not a directory")
            if path not in resolved:
                resolved.append(path)
        if not resolved:
            raise ValueError("roots must name at least one directory, got an empty list")

        self.roots = resolved
        self.split = split
        self.val_fraction = float(val_fraction)
        self.suffixes = suffixes
        self.max_file_bytes = max_file_bytes
        listing = _list_files(tuple(resolved), suffixes, max_file_bytes)
        self.skipped = dict(listing.skipped)
        chosen = [f for f in listing.files if split_of(f[1], val_fraction) == split]
        if not chosen:
            where = ", ".join(str(r) for r in resolved)
            if listing.files:
                raise ValueError(
                    f"roots [{where}] hold {len(listing.files)} non-empty {'/'.join(suffixes)} "
                    f"files but none falls in split {split!r} at val_fraction={val_fraction}"
                )
            raise ValueError(f"roots [{where}] hold no non-empty {'/'.join(suffixes)} files")
        self.files: list[tuple[Path, str]] = [(resolved[i], rel) for i, rel, _ in chosen]
        self.sizes: list[int] = [size for _, _, size in chosen]
        self.unreadable: set[int] = set()
        digest = hashlib.sha256()
        for (root, rel), size in zip(self.files, self.sizes):
            digest.update(f"{root}\x1f{rel}\x1f{size}\n".encode())
        self.fingerprint = digest.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.files)

    def __repr__(self) -> str:
        return (
            f"SourceCorpus(split={self.split!r}, files={len(self.files)}, "
            f"bytes={sum(self.sizes)}, roots={[str(r) for r in self.roots]})"
        )

    def path(self, i: int) -> Path:
        root, rel = self.files[i]
        return root / rel

    def read(self, i: int) -> bytes:
        """File ``i``'s bytes (at most ``max_file_bytes``); raises ``OSError`` if unreadable."""
        with open(self.path(i), "rb") as f:
            return f.read(self.max_file_bytes)

    def try_read(self, i: int) -> bytes | None:
        """``read(i)``, or ``None`` (remembered, and counted by ``describe``) if it fails."""
        try:
            return self.read(i)
        except OSError:
            self.unreadable.add(i)
            return None

    def describe(self) -> dict:
        """What exactly this corpus reads, JSON-serialisable, for a run's log."""
        return {
            "roots": [str(r) for r in self.roots],
            "split": self.split,
            "val_fraction": self.val_fraction,
            "suffixes": list(self.suffixes),
            "max_file_bytes": self.max_file_bytes,
            "files": len(self.files),
            "bytes": sum(self.sizes),
            "fingerprint": self.fingerprint,
            "skipped_when_listing": dict(self.skipped),
            "unreadable_when_streaming": len(self.unreadable),
        }


class TokenStream:
    """Endless deterministic batches of token ids from a corpus.

    Documents (``BOS`` + a file's bytes) are concatenated in an order shuffled by ``(seed,
    epoch)`` and cut into rows of ``seq_len + 1`` tokens: ``x[:, :-1]`` are the inputs, ``x[:, 1:]``
    the targets. Consecutive rows, and batches, continue the stream where the last one stopped.
    With ``needle_fraction > 0`` each row is, with that probability, a retrieval sample instead
    (see :func:`make_multi_needle_sample`): ``needles_per_sample`` needles at uniform random
    depths (or, with ``edge_fraction``, some at the very start or end) in filler taken from the
    stream, their questions at the end. Each row's random choices come from its own generator
    seeded by ``(seed, row number)``, so the state to resume is a few counters.

    Args:
        corpus: the :class:`SourceCorpus` to read.
        seq_len: tokens per row, less one.
        batch_size: rows per batch.
        seed: the seed of the file order and of the needle rows.
        needle_fraction: the probability that a row is a retrieval sample.
        needles_per_sample, key_len, value_len: the retrieval samples' shape.
        edge_fraction: the share of needles planted at depth 0 or 1 exactly (half each) instead
            of a uniform depth: the first tokens of a context are otherwise almost never a
            needle's place, and models trained without them fail to retrieve from there.

    Example::

        stream = TokenStream(SourceCorpus(split="train"), seq_len=4096, batch_size=8, seed=0)
        x = stream.next_batch()           # (8, 4097) int64
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        state = stream.state_dict()       # JSON-serialisable; save it with the checkpoint
    """

    _STATE_FORMAT = 2  # 2: retrieval samples start with BOS

    def __init__(
        self,
        corpus: SourceCorpus,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        needle_fraction: float = 0.0,
        needles_per_sample: int = 4,
        key_len: int = 4,
        value_len: int = 6,
        edge_fraction: float = 0.0,
    ):
        if not isinstance(corpus, SourceCorpus):
            raise TypeError(f"corpus must be a SourceCorpus, got {type(corpus).__name__}")
        _check_positive_int("seq_len", seq_len)
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("needles_per_sample", needles_per_sample)
        _check_positive_int("key_len", key_len)
        _check_positive_int("value_len", value_len)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if (
            isinstance(needle_fraction, bool)
            or not isinstance(needle_fraction, (int, float))
            or not 0.0 <= needle_fraction <= 1.0
        ):
            raise ValueError(f"needle_fraction must be a number in [0, 1], got {needle_fraction!r}")
        if (
            isinstance(edge_fraction, bool)
            or not isinstance(edge_fraction, (int, float))
            or not 0.0 <= edge_fraction <= 1.0
        ):
            raise ValueError(f"edge_fraction must be a number in [0, 1], got {edge_fraction!r}")
        overhead = needle_overhead(needles_per_sample, key_len, value_len)
        if needle_fraction > 0 and seq_len + 1 < overhead:
            raise ValueError(
                f"seq_len must be >= {overhead - 1} to hold {needles_per_sample} needles and "
                f"questions (key_len={key_len}, value_len={value_len}), got {seq_len}"
            )
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.needle_fraction = float(needle_fraction)
        self.needles_per_sample = needles_per_sample
        self.key_len = key_len
        self.value_len = value_len
        self.edge_fraction = float(edge_fraction)
        self._overhead = overhead
        # Position: epoch, index into that epoch's file order, tokens of that document consumed;
        # and rows produced so far (the needle rows' seeds).
        self.epoch = 0
        self.file_pos = 0
        self.offset = 0
        self.rows = 0
        self._order: list[int] | None = None
        self._doc: np.ndarray | None = None

    # The configuration a saved state must match to resume exactly.
    def _config(self) -> dict:
        return {
            "corpus": self.corpus.fingerprint,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "needle_fraction": self.needle_fraction,
            "needles_per_sample": self.needles_per_sample,
            "key_len": self.key_len,
            "value_len": self.value_len,
            # Only when set, so that states saved before the option existed still load.
            **({"edge_fraction": self.edge_fraction} if self.edge_fraction else {}),
        }

    def describe(self) -> dict:
        """The corpus's ``describe()`` and this stream's settings and position."""
        return {
            "corpus": self.corpus.describe(),
            **{k: v for k, v in self._config().items() if k != "corpus"},
            "epoch": self.epoch,
            "rows": self.rows,
        }

    def _file_order(self) -> list[int]:
        if self._order is None:
            self._order = list(range(len(self.corpus)))
            random.Random(_stable_int("order", self.seed, self.epoch)).shuffle(self._order)
        return self._order

    def _current_doc(self) -> np.ndarray:
        """The document at the stream's position, as int16 tokens, moving past unreadable or
        emptied files and into the next epoch as needed."""
        files_tried = 0
        while self._doc is None or self.offset >= len(self._doc):
            if self._doc is not None:
                self._doc = None
                self.file_pos += 1
                self.offset = 0
            order = self._file_order()
            if self.file_pos >= len(order):
                self.epoch += 1
                self.file_pos = 0
                self.offset = 0
                self._order = None
                order = self._file_order()
            files_tried += 1
            if files_tried > 2 * len(order) + 1:
                raise RuntimeError(f"no file of {self.corpus!r} could be read")
            data = self.corpus.try_read(order[self.file_pos])
            if data is None:
                data = b""  # counted by the corpus; the loop moves on to the next file
            doc = np.empty(len(data) + 1, dtype=np.int16)
            doc[0] = BOS
            doc[1:] = np.frombuffer(data, dtype=np.uint8)
            self._doc = doc
            if not data:
                self.offset = len(doc)  # an unreadable or emptied file contributes nothing
        return self._doc

    def _fill(self, out: np.ndarray) -> None:
        """Copy the next ``len(out)`` tokens of the document stream into ``out``."""
        filled = 0
        while filled < len(out):
            doc = self._current_doc()
            take = min(len(out) - filled, len(doc) - self.offset)
            out[filled : filled + take] = doc[self.offset : self.offset + take]
            filled += take
            self.offset += take

    def _needle_depth(self, rng: random.Random) -> float:
        # A uniform depth almost never puts a needle on the context's very first tokens, where
        # attention behaves unlike anywhere else (the first position draws the "sink" weight of
        # every query); models trained on uniform depths alone fail there, dense ones included.
        if self.edge_fraction and rng.random() < self.edge_fraction:
            return float(rng.random() < 0.5)
        return rng.random()

    def next_batch(self) -> torch.Tensor:
        """The next ``(batch_size, seq_len + 1)`` int64 CPU tensor of token ids."""
        return self.next_batch_with_answers()[0]

    def next_batch_with_answers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, as :meth:`next_batch`, and a bool tensor of its shape marking the
        needle answers' tokens (the tokens a model can only predict by retrieval), so that a
        trainer can weight them."""
        length = self.seq_len + 1
        batch = np.empty((self.batch_size, length), dtype=np.int64)
        answers = np.zeros((self.batch_size, length), dtype=bool)
        for b in range(self.batch_size):
            rng = random.Random(_stable_int("row", self.seed, self.rows))
            self.rows += 1
            if self.needle_fraction > 0 and rng.random() < self.needle_fraction:
                filler = np.empty(length - self._overhead, dtype=np.int64)
                self._fill(filler)
                depths = [self._needle_depth(rng) for _ in range(self.needles_per_sample)]
                sample = make_multi_needle_sample(
                    torch.from_numpy(filler), length, depths, rng, self.key_len, self.value_len
                )
                batch[b] = sample.tokens.numpy()
                for start in sample.answer_starts:
                    answers[b, start : start + sample.answer_len] = True
            else:
                self._fill(batch[b])
        return torch.from_numpy(batch), torch.from_numpy(answers)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """The stream's position and configuration, JSON-serialisable."""
        return {
            "format": self._STATE_FORMAT,
            "config": self._config(),
            "epoch": self.epoch,
            "file_pos": self.file_pos,
            "offset": self.offset,
            "rows": self.rows,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a stream built with the same corpus
        and arguments): the next batches equal those the saved stream would have produced, as
        long as the files have not changed on disk. Raises ``ValueError`` on a mismatch."""
        if not isinstance(state, dict) or state.get("format") != self._STATE_FORMAT:
            raise ValueError(
                f"state must be a TokenStream.state_dict() of format {self._STATE_FORMAT}"
            )
        saved, mine = state.get("config", {}), self._config()
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {s!r}, here {h!r}" for k, (s, h) in diff.items())
            raise ValueError(f"state was saved by a stream with other settings ({detail})")
        for name in ("epoch", "file_pos", "offset", "rows"):
            value = state.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"state[{name!r}] must be a non-negative int, got {value!r}")
        self.epoch = state["epoch"]
        self.file_pos = state["file_pos"]
        self.offset = state["offset"]
        self.rows = state["rows"]
        self._order = None
        # Re-read lazily: _current_doc loads the file at file_pos and keeps the offset into it.
        self._doc = None


def needle_filler(corpus: SourceCorpus, length: int, seed: int) -> torch.Tensor:
    """``(length,)`` int64 filler for retrieval samples: the first ``length`` tokens of the
    document stream of ``corpus`` (typically the validation split) shuffled by ``seed``, after
    the stream's leading ``BOS`` (the retrieval sample brings its own); contains no
    ``KEY``/``VALUE``/``PAD``. The same arguments give the same filler on one machine."""
    _check_positive_int("length", length)
    # A stream row is seq_len + 1 tokens: exactly the leading BOS and the filler.
    row = TokenStream(corpus, seq_len=length, batch_size=1, seed=seed).next_batch()[0]
    return row[1:]
