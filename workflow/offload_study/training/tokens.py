"""The harness's token source: seeded synthetic tokens, or windows of a token file."""

from __future__ import annotations

import os

from offload_study.core.contracts import RunSpec


def load_token_file(path: str):
    """Token ids from .npy (any int dtype) or .bin (raw uint16, or int32 if name has 'int32')."""
    import numpy as np

    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
    else:
        dtype = np.int32 if "int32" in os.path.basename(path) else np.uint16
        arr = np.memmap(path, dtype=dtype, mode="r")
    return arr.reshape(-1)


class Batches:
    """Seeded micro-batches of (micro_batch, seq_len) token ids, different per rank."""

    def __init__(self, spec: RunSpec, vocab_size: int, rank: int):
        import torch

        self.mb, self.seq = spec.micro_batch, spec.seq_len
        self.vocab = int(vocab_size)
        self.gen = torch.Generator().manual_seed(spec.seed * 1000 + rank)
        self.tokens = None
        token_file = spec.data.token_file
        if token_file:
            self.tokens = load_token_file(str(token_file))
            if len(self.tokens) <= self.seq:
                raise ValueError(f"token file {token_file} shorter than seq_len {self.seq}")
            print(f"[harness] tokens from {token_file}: {len(self.tokens)} ids", flush=True)

    def next(self):
        import numpy as np
        import torch

        if self.tokens is None:
            return torch.randint(0, self.vocab, (self.mb, self.seq), generator=self.gen)
        starts = torch.randint(0, len(self.tokens) - self.seq, (self.mb,), generator=self.gen)
        rows = [np.asarray(self.tokens[s : s + self.seq], dtype=np.int64) for s in starts.tolist()]
        ids = torch.from_numpy(np.stack(rows))
        return ids.clamp_(0, self.vocab - 1)
