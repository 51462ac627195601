"""The digit share of a run's data: the share of label positions that are digit targets.

`--del-reduction token` weighs each digit token's term by alpha / S, where S is this share
(counted in digits: a three-digit token of a chunking vocab counts 3, as the "digit" reduction
counts). This module measures S on Megatron indexed datasets (.bin/.idx), given as Megatron-LM's
`--data-path` is: prefixes, or WEIGHT PREFIX pairs.

Label positions. Megatron's GPTDataset packs the documents of a dataset (the sequences of its
.idx) back to back and takes each sample's labels as its tokens shifted by one, samples
overlapping by one token: every token of the packed stream is a label once, the first token of
a document included (it is the target after the previous document's last token, its
end-of-document token when the data has one). So every token of a document read here counts as
one label position, and the share is digits / tokens over the documents read. A run with
--eod-mask-loss drops the end-of-document labels from its loss: its share is then higher by
about tokens / (tokens - documents).

Blends. Weights are normalised to sum to 1, as Megatron does, and the share is the weighted mean
of the datasets' shares: Megatron draws each dataset's samples (of equal length) in proportion
to its weight. Prefixes without weights: Megatron blends by the datasets' sizes (len of each
mid-level GPTDataset, its tokens / sequence length), so each dataset weighs its token count.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .vocab import DigitVocab

# Tokens read from each dataset by default (whole documents, about this many).
DEFAULT_SAMPLE_TOKENS = 1_000_000

PREFIX_HELP = (
    "a prefix is the dataset's path without the extension (Megatron's preprocess_data.py writes "
    "PREFIX.bin and PREFIX.idx; --data-path takes PREFIX)"
)
SYNTAX_HELP = "give PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...], as Megatron-LM takes"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _syntax(entries: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    entries = list(entries)
    if not entries:
        raise ValueError(f"--data-path is empty: {SYNTAX_HELP}")
    numbers = [_is_number(e) for e in entries]
    if not any(numbers):
        return entries, None
    if len(entries) % 2:
        raise ValueError(
            f"--data-path has an odd weight/prefix list ({len(entries)} entries, some of them "
            f"weights): {SYNTAX_HELP}"
        )
    if not all(numbers[0::2]) or any(numbers[1::2]):
        raise ValueError(f"--data-path mixes weights and prefixes out of pairs: {SYNTAX_HELP}")
    weights = [float(w) for w in entries[0::2]]
    for text, weight in zip(entries[0::2], weights, strict=True):
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"--data-path weight {text!r} must be a finite number > 0")
    total = sum(weights)
    return entries[1::2], [w / total for w in weights]


def parse_data_path(entries: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron-LM's --data-path list -> (prefixes, weights normalised to sum 1, or None).

    Raises ValueError for a list that mixes weights and prefixes out of pairs, for a weight that
    is not finite and > 0, and FileNotFoundError for a prefix without its .bin/.idx."""
    prefixes, weights = _syntax(entries)
    for prefix in prefixes:  # a missing dataset stops the check before any is read
        check_prefix(prefix)
    return prefixes, weights


def check_prefix(prefix: str) -> None:
    """Raise FileNotFoundError unless PREFIX.bin and PREFIX.idx both exist."""
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if not missing:
        return
    hint = ""
    stem, ext = os.path.splitext(prefix)
    if ext in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
        hint = f" (did you mean {stem!r}?)"
    raise FileNotFoundError(
        f"--data-path {prefix!r}: {' and '.join(missing)} not found{hint}; {PREFIX_HELP}"
    )


def sample_documents(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Indices int64 [k] of documents spread evenly over a dataset whose documents hold
    `lengths` [n] tokens, k chosen to read about `budget` tokens (all of them if they fit)."""
    n = len(lengths)
    total = int(lengths.sum())
    if total <= budget:
        return np.arange(n, dtype=np.int64)
    k = max(1, int(n * budget / total))
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def digit_counts(vocab: DigitVocab) -> np.ndarray:
    """int64 [max_id + 2]: digits each token id holds as a target (1 for '0'..'9', 2 or 3 for a
    chunking vocab's multi-digit tokens, 0 elsewhere; the last entry serves every id > max_id)."""
    table = np.zeros(vocab.max_id + 2, dtype=np.int64)
    ids, texts = zip(*vocab.number_tokens(), strict=True)
    table[list(ids)] = [len(t) for t in texts]
    return table


def _gather(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """tokens[starts[i] : starts[i] + lengths[i]] for every i, concatenated (no Python loop)."""
    ends = np.cumsum(lengths)
    offsets = np.repeat(starts - (ends - lengths), lengths)
    return tokens[np.arange(int(ends[-1]), dtype=np.int64) + offsets]


@dataclass(frozen=True)
class DatasetShare:
    """What was read from one dataset: its size, the documents and tokens read (= label
    positions), and the digit targets among them (counted in digits)."""

    prefix: str
    documents: int
    tokens: int
    read_documents: int
    read_tokens: int
    digits: int
    max_id: int = -1  # the largest token id read (-1: none read)

    @property
    def share(self) -> float:
        """Digit targets per label position read."""
        return self.digits / max(self.read_tokens, 1)


def _open(prefix: str):
    import struct

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # IndexedDataset.__del__ deletes both readers: preset them, so that a failed __init__
    # leaves no "Exception ignored" traceback behind.
    dataset = IndexedDataset.__new__(IndexedDataset)
    dataset.bin_reader = dataset.index = None
    try:
        dataset.__init__(prefix)
        return dataset
    except (AssertionError, ValueError, OSError, struct.error) as exc:  # a truncated/foreign .idx
        raise ValueError(
            f"--data-path {prefix!r}: not a Megatron indexed dataset "
            f"({str(exc) or type(exc).__name__})"
        ) from None


def dataset_share(
    prefix: str, vocab: DigitVocab, budget: int = DEFAULT_SAMPLE_TOKENS
) -> DatasetShare:
    """DatasetShare of the dataset at `prefix`, from about `budget` tokens of whole documents
    spread evenly over it (sample_documents)."""
    check_prefix(prefix)
    index = _open(prefix).index
    lengths = index.sequence_lengths.astype(np.int64)
    docs = sample_documents(lengths, budget)
    read = lengths[docs]
    digits, max_id = 0, -1
    if read.sum() > 0:
        tokens = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r")
        starts = index.sequence_pointers[docs].astype(np.int64) // index.dtype_size
        ids = _gather(tokens, starts, read).astype(np.int64)
        table = digit_counts(vocab)
        digits = int(table[np.clip(ids, 0, len(table) - 1)].sum())
        max_id = int(ids.max())
    return DatasetShare(
        prefix, len(lengths), int(lengths.sum()), len(docs), int(read.sum()), digits, max_id
    )


@dataclass(frozen=True)
class BlendShare:
    """The datasets of a --data-path, the normalised weights they are blended with, and whether
    those were given (else: the datasets' token counts, as Megatron blends them)."""

    datasets: List[DatasetShare]
    weights: List[float]
    weighted: bool

    @property
    def share(self) -> float:
        """Share of the blend's label positions that are digit targets, in [0, 3]."""
        return float(sum(w * d.share for w, d in zip(self.weights, self.datasets, strict=True)))


def blend_share(
    data_path: Sequence[str], vocab: DigitVocab, budget: int = DEFAULT_SAMPLE_TOKENS
) -> BlendShare:
    """BlendShare of Megatron-LM's --data-path list, `budget` tokens read from each dataset."""
    prefixes, weights = parse_data_path(data_path)
    datasets = [dataset_share(p, vocab, budget) for p in prefixes]
    if weights is not None:
        return BlendShare(datasets, weights, True)
    total = sum(d.tokens for d in datasets)
    sizes = [d.tokens / total if total else 1 / len(datasets) for d in datasets]
    return BlendShare(datasets, sizes, False)
