"""Training text: Python sources found on this machine (or given paths), tokenized and packed.

Documents are joined into one token stream with the EOS id between them; a training
batch is a set of random windows of that stream. A fixed share of the *documents* is
held out (chosen by a seeded shuffle), so held-out windows never overlap training text.
"""

from __future__ import annotations

import os
import random
import re
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from draftflow.core.errors import DraftflowError

if TYPE_CHECKING:  # annotations only: torch is imported when a function needs it (the CLI checks flags first)
    import torch

# A `def` / `class` line ending in ':' (a wrapped signature's last line is not matched; its docstring's end is).
_HEADER = re.compile(r"\s*(async\s+def|def|class)\s.*:\s*(#.*)?$")
_TRIPLE = ('"""', "'''")
# Folder names whose files are tests or test data, not ordinary library code.
_TEST_DIRS = {"test", "tests", "testing", "idle_test", "unittests", "__pycache__"}
_MAX_FILE_BYTES = 200_000  # larger files are mostly generated tables
_MIN_FILE_BYTES = 200


def default_roots() -> list[Path]:
    """The standard library and the installed packages of the running interpreter."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def _is_test_name(name: str) -> bool:
    """A test file's name (test folders, `_TEST_DIRS`, are pruned while walking)."""
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def source_files(roots: list[Path] | None = None, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    """Source files under `roots` (files are taken as given), tests excluded, sorted, each path once.

    Test folders are pruned while walking (an installed torch alone holds ~200k paths), and directory links are
    not followed (as `Path.rglob` before Python 3.13), so only a root's real path and a linked file's are looked up
    (the default roots hold ~23k files: resolving each path took 4 of this function's 5 s)."""
    found: dict[Path, None] = {}
    for root in roots or default_roots():
        root = Path(root)
        if root.is_file():
            found[root.resolve()] = None
            continue
        files = []  # (path as walked, real path): sorted as walked
        folders = [(str(root), os.path.realpath(root))]  # (as walked, real): a folder below a real one is real
        while folders:
            folder, real = folders.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:  # unreadable: skipped, as os.walk does
                continue
            for e in entries:
                if e.is_dir():
                    if not e.is_symlink() and e.name not in _TEST_DIRS:
                        folders.append((e.path, os.path.join(real, e.name)))
                elif e.name.endswith(suffixes) and not _is_test_name(e.name) and e.is_file():
                    p = os.path.join(real, e.name)
                    files.append((e.path, os.path.realpath(p) if e.is_symlink() else p))
        for _, p in sorted(files, key=lambda f: f[0].split(os.sep)):  # Path order: part by part
            found[Path(p)] = None
    return list(found)


def read_texts(files: list[Path], max_bytes: int, seed: int = 0, named=()) -> list[str]:
    """Up to `max_bytes` of UTF-8 text from `files` in a seeded random order.

    Files found in folders are skipped when huge, tiny or not UTF-8; a file in `named` (given by the user
    directly) is always read, and one that is not UTF-8 is an error.
    """
    order = list(files)
    random.Random(seed).shuffle(order)
    texts, total = [], 0
    for p in order:
        try:
            if p not in named and not _MIN_FILE_BYTES <= p.stat().st_size <= _MAX_FILE_BYTES:
                continue
            with p.open(encoding="utf-8") as f:
                text = f.read(max(1, max_bytes - total)) if p in named else f.read()  # a named file may be huge
        except UnicodeDecodeError as exc:
            if p in named:
                raise DraftflowError(f"--data {p}: not UTF-8 text ({exc.reason} at byte {exc.start}); pass text "
                                     "files (.py, .txt, .md)") from None
            continue
        except OSError as exc:
            if p in named:
                raise DraftflowError(f"--data {p}: cannot read ({exc.strerror})") from None
            continue
        if not text.strip():
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


@attrs.frozen
class TokenData:
    """Packed token streams (1-D int64) for training and held-out evaluation."""

    train: torch.Tensor
    held_out: torch.Tensor
    documents: int
    characters: int

    @classmethod
    def from_texts(cls, texts: list[str], encode, eos_id: int, held_out_frac: float = 0.02, seed: int = 0) -> TokenData:
        """`encode(list[str]) -> list[list[int]]`; documents go to held-out with probability `held_out_frac`."""
        import torch

        ids = encode(texts)
        rng = random.Random(seed + 1)
        train, held = [], []
        for doc in ids:
            (held if rng.random() < held_out_frac else train).extend([*doc, eos_id])
        if not held and train:  # tiny corpora: still keep something apart
            cut = max(1, len(train) // 20)
            train, held = train[:-cut], train[-cut:]
        return cls(torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long), len(texts),
                   sum(len(t) for t in texts))


def tokenizer_encoder(tokenizer):
    """A batch encoder for a `tokenizers.Tokenizer` (no special tokens added)."""
    return lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


class WindowSampler:
    """Random training windows and fixed held-out windows over a `TokenData`."""

    def __init__(self, data: TokenData, seq_len: int, seed: int = 0) -> None:
        import torch

        if data.train.numel() <= seq_len:
            raise DraftflowError(f"the training text has {data.train.numel()} tokens, not more than one window of "
                                 f"--seq-len {seq_len}; give more --data (or a larger --max-data-mb) or a smaller --seq-len")
        self.data, self.seq_len = data, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        # returns: [batch_size, seq_len]
        import torch

        starts = torch.randint(0, self.data.train.numel() - self.seq_len, (batch_size,), generator=self.generator)
        return torch.stack([self.data.train[s:s + self.seq_len] for s in starts.tolist()])

    def held_out(self, count: int, length: int | None = None) -> list[torch.Tensor]:
        """`count` evenly spaced held-out windows (fewer if the held-out text is short)."""
        length = length or self.seq_len
        stream = self.data.held_out
        span = stream.numel() - length
        if span <= 0:
            return [stream] if stream.numel() > 2 else []
        return [stream[int(i * span / max(1, count - 1)):][:length] for i in range(count)]


def body_starts(stream, token_text: list[str]) -> list[int]:
    """Positions i of the token stream after which a body starts: token i ends (holds the newline of) a `def` or
    `class` header line, or a line that closes a triple-quoted string and ends with the quotes (a docstring),
    outside any other triple-quoted string. `token_text[id]` is each token's decoded text.

    These are where a HumanEval prompt ends (a signature and docstring; the model writes the body), the case
    `draftflow train --regen-body-share` trains on.
    """
    out, line, inside, doc = [], [], False, False
    for i, tok in enumerate(stream.tolist()):
        text = token_text[tok]
        if "\n" not in text:
            line.append(text)
            continue
        parts = text.split("\n")
        lines, line = ["".join(line) + parts[0], *parts[1:-1]], [parts[-1]]
        hit = False
        for full in lines:
            stripped = full.strip()
            quotes = sum(full.count(q) for q in _TRIPLE)
            was_inside, inside = inside, inside != (quotes % 2 == 1)
            starts_doc = stripped.lstrip("rRuU").startswith(_TRIPLE)  # a statement that is only a string
            if inside and not was_inside:
                doc = starts_doc  # a string opens here: a docstring if the line starts with it
            closes = stripped.endswith(_TRIPLE) and not inside and ((was_inside and doc) or
                                                                     (not was_inside and quotes >= 2 and starts_doc))
            hit = hit or closes or (not inside and not was_inside and _HEADER.match(full) is not None)
        if hit:
            out.append(i)
    return out
