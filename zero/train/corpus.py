"""Training data for the command: the user's text files, or by default the bytes of this Python's standard
library sources (present on every machine with Python), read as byte-level tokens."""
from __future__ import annotations

import os
import sysconfig

import torch


def default_corpus(limit: int = 64 << 20) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's .py files, in a fixed order, as uint8 tokens."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    # Walked top-down with the directories pruned and sorted in place (sorting the walk's output would walk
    # everything first, installed packages included, and the data would differ from machine to machine).
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(directory, name), "rb") as f:
                    data = f.read()
                chunks.append(data)
                total += len(data)
                if total >= limit:
                    return _tokens(chunks)[:limit]
    return _tokens(chunks)


def text_files(paths: list[str]) -> torch.Tensor:
    chunks = []
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read())
    tokens = _tokens(chunks)
    if tokens.numel() < 2:
        sizes = ", ".join(f"{path!r} {len(chunk)} bytes" for path, chunk in zip(paths, chunks))
        raise ValueError(f"the data files hold {tokens.numel()} bytes ({sizes}): need at least 2")
    return tokens


def split_held_out(tokens: torch.Tensor, seq_len: int, fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held out): the last `fraction` of the tokens (at least one window) are never trained on, so a
    loss measured there before and after training says whether the model learned, free of the noise
    between one training batch and the next."""
    held = max(int(tokens.numel() * fraction), seq_len + 2)
    if tokens.numel() - held < seq_len + 2:
        raise ValueError(f"corpus of {tokens.numel()} tokens is too short for a training part and a held-out part "
                         f"of {held} tokens with seq_len {seq_len}: need at least {held + seq_len + 2}")
    return tokens[:-held], tokens[-held:]


def _tokens(chunks: list[bytes]) -> torch.Tensor:
    data = bytearray(b"".join(chunks))
    # (frombuffer refuses an empty buffer: no data is an empty tensor, for the callers' checks to name)
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class Batches:
    """Random windows of seq_len + 1 tokens (inputs and next-token targets), from a seeded generator."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq_len: int, seed: int = 0):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is shorter than seq_len + 2 = {seq_len + 2}")
        self.tokens, self.batch, self.seq_len = tokens, batch, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch,), generator=self.generator)
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]
