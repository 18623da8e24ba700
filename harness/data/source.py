"""Token batches: the same tokens in the same order for every engine and layout.

A step's global batch is a [global_batch_size, seq_len + 1] int64 tensor that depends only
on (seed, step) for synthetic and Markov data, or on the step's position in the token file. Every rank
builds the same global batch and takes its data-parallel slice (and under context parallelism
its chunks of every sequence), so any layout sees exactly the tokens of the single-device reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from harness.spec import Workload, check_token_file

MARKOV_ALPHABET = 32  # distinct tokens a Markov source visits (fewer where the vocabulary is smaller)
MARKOV_SUCCESSORS = 2  # each token's possible next tokens: ln 2 nats a token once learned


class SyntheticTokens:
    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int):
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed

    def global_batch_at(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + step)
        return torch.randint(0, self.vocab, (self.global_batch, self.seq_len + 1), generator=g)


class MarkovTokens:
    """Sequences walked on a seeded first-order Markov chain: MARKOV_ALPHABET tokens of the vocabulary,
    each followed by one of MARKOV_SUCCESSORS successors drawn uniformly. Its entropy is ln 2 nats a
    token against ln vocab for uniform tokens, so a model's loss falls from the first steps (which
    tokens occur, then which follow which): parity then compares training, not a loss pinned at
    ln vocab. The chain depends on the seed only, each step's walks on (seed, step): every rank and
    engine builds the same global batch."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int):
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed
        g = torch.Generator().manual_seed(seed)
        states = min(vocab, MARKOV_ALPHABET)
        self.tokens = torch.randperm(vocab, generator=g)[:states]  # which token ids the chain visits
        self.successors = torch.randint(0, states, (states, MARKOV_SUCCESSORS), generator=g)

    def global_batch_at(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + step)
        state = torch.randint(0, len(self.tokens), (self.global_batch,), generator=g)
        choice = torch.randint(0, MARKOV_SUCCESSORS, (self.global_batch, self.seq_len), generator=g)
        walk = [state]
        for t in range(self.seq_len):  # one position at a time, every sequence at once
            state = self.successors[state, choice[:, t]]
            walk.append(state)
        return self.tokens[torch.stack(walk, dim=1)]


class TokenFile:
    """A flat memory-mapped token file (nanoGPT/Megatron .bin): consecutive windows, wrapping."""

    def __init__(self, path: str, dtype: str, vocab: int, seq_len: int, global_batch: int):
        try:  # a wrong dtype or an empty file: numpy's ValueError, said as the spec field it comes from
            self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        except (ValueError, OSError) as e:
            from harness.errors import SpecError

            raise SpecError("workload.data.path", f"{path}: cannot read it as {dtype} tokens ({e})") from None
        self.seq_len, self.global_batch = seq_len, global_batch
        window = seq_len + 1
        self.windows = len(self.tokens) // window
        if self.windows == 0:
            from harness.errors import SpecError

            raise SpecError("workload.data.path", f"holds {len(self.tokens)} tokens, fewer than seq_len + 1")
        self.vocab = vocab

    def global_batch_at(self, step: int) -> torch.Tensor:
        window = self.seq_len + 1
        idx = (np.arange(self.global_batch) + step * self.global_batch) % self.windows
        rows = np.stack([self.tokens[i * window : (i + 1) * window] for i in idx]).astype(np.int64)
        out = torch.from_numpy(rows)
        if int(out.max()) >= self.vocab:
            from harness.errors import SpecError

            raise SpecError("workload.data.path", f"token id {int(out.max())} >= model vocabulary {self.vocab}")
        return out


def token_source(workload: Workload, vocab: int):
    if workload.data.kind == "file":
        # the checks `harness train` makes before launch (its .bin.json's dtype and vocabulary, size),
        # also for callers that build a source without validating the spec first
        check_token_file(workload, SimpleNamespace(vocab=vocab))
        return TokenFile(workload.data.path, workload.data.dtype, vocab, workload.seq_len, workload.global_batch_size)
    kind = MarkovTokens if workload.data.kind == "markov" else SyntheticTokens
    return kind(vocab, workload.seq_len, workload.global_batch_size, workload.seed)


def dp_slice(batch: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """Data-parallel rank r takes rows [r·B/dp, (r+1)·B/dp): contiguous, like the reference order."""
    per = batch.shape[0] // dp
    return batch[dp_rank * per : (dp_rank + 1) * per]


def micro_batches(
    local: torch.Tensor, micro_batch_size: int, positions: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) pairs of micro_batch_size sequences each. `positions`: only those token
    positions, the same for inputs and targets so each target stays with the token that predicts
    it: a context-parallel rank's, which the engine takes from harness.model.llama.cp_token_index
    (a package this one does not import: same layer); None: every position."""
    out = [(mb[:, :-1], mb[:, 1:]) for mb in local.split(micro_batch_size)]
    if positions is None:
        return out
    return [(inputs[:, positions], targets[:, positions]) for inputs, targets in out]
