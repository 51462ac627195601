"""`del-megatron check`: what a run's tokenizer means for DEL, in seconds, before the job.

Given a tokenizer file (what DigitVocab.from_tokenizer reads) or Megatron-LM's
`--tokenizer-type` / `--tokenizer-model` pair, report the digit and decimal-point ids, whether
numbers are split one digit per token, and the exact Megatron-LM flags to add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .tokenizers import QWEN_PATTERN, digit_vocab_from_tokenizer, load_tokenizer

# Megatron-LM --tokenizer-type values whose --tokenizer-model is a file load_tokenizer reads.
MEGATRON_TOKENIZER_TYPES = {
    "SentencePieceTokenizer": "a SentencePiece .model",
    "GPTSentencePieceTokenizer": "a SentencePiece .model",
    "Llama2Tokenizer": "a SentencePiece .model",
    "TikTokenizer": "a .tiktoken rank file or a tekken JSON",
    "HuggingFaceTokenizer": "a folder with tokenizer.json (or the file)",
}
NO_TEXT_TYPES = ("NullTokenizer", "NullMultimodalTokenizer")


@dataclass
class Preflight:
    """The outcome of a check: ids found (None when the tokenizer cannot serve DEL), whether
    digits are split, and what to tell the user."""

    digit_ids: Optional[List[int]]
    decimal_point_ids: List[int]
    digits_split: bool
    message: str

    @property
    def ok(self) -> bool:
        return self.digit_ids is not None

    def flags(self, loss: str = "del", alpha: float = 0.01) -> str:
        if not self.ok:
            return ""
        flags = [f"--numerical-loss {loss} --del-alpha {alpha}"]
        flags.append("--del-digit-token-ids " + " ".join(map(str, self.digit_ids)))
        if self.decimal_point_ids:
            points = " ".join(map(str, self.decimal_point_ids))
            flags.append(f"--del-decimal-point-token-ids {points}")
        if not self.digits_split:
            flags.append("--del-allow-multi-digit-tokens")
        return " ".join(flags)


def check_tokenizer(
    path: Optional[str],
    tokenizer_type: Optional[str] = None,
    allow_multi_digit_tokens: bool = False,
    tiktoken_pattern: str = QWEN_PATTERN,
) -> Preflight:
    """Check the tokenizer at `path` (Megatron-LM's --tokenizer-model when tokenizer_type, its
    --tokenizer-type, is given). Files that do not exist or cannot be read raise."""
    if tokenizer_type in NO_TEXT_TYPES:
        return Preflight(
            None,
            [],
            False,
            f"{tokenizer_type} has no text, so no digit tokens can be found in it: pass "
            "--del-digit-token-ids with the ids your data uses for '0'..'9' "
            "(and --del-decimal-point-token-ids for '.')",
        )
    if tokenizer_type is not None and tokenizer_type not in MEGATRON_TOKENIZER_TYPES:
        known = ", ".join(sorted(MEGATRON_TOKENIZER_TYPES) + list(NO_TEXT_TYPES))
        raise ValueError(f"--tokenizer-type {tokenizer_type!r}: this check reads {known}")
    if path is None:
        raise ValueError("give the tokenizer file (--tokenizer / --tokenizer-model)")
    tok = load_tokenizer(path, tiktoken_pattern)
    try:
        vocab = digit_vocab_from_tokenizer(tok, allow_multi_digit_tokens=False)
        split = True
    except ValueError as refused:
        if not allow_multi_digit_tokens or "merges digits" not in str(refused):
            return Preflight(None, [], False, str(refused))
        try:
            vocab = digit_vocab_from_tokenizer(tok, allow_multi_digit_tokens=True)
        except ValueError as still_refused:
            return Preflight(None, [], False, str(still_refused))
        split = False
    how = "one digit per token" if split else "MERGED into multi-digit tokens (DEL: single digits)"
    return Preflight(
        list(vocab.digit_ids),
        list(vocab.decimal_point_ids),
        split,
        f"{path}: numbers tokenize {how}",
    )


def report(result: Preflight, loss: str = "del", alpha: float = 0.01) -> str:
    """The lines `del-megatron check` prints."""
    lines = [result.message]
    if result.ok:
        lines.append(f"digit ids ('0'..'9'): {' '.join(map(str, result.digit_ids))}")
        points = " ".join(map(str, result.decimal_point_ids)) or "none found"
        lines.append(f"decimal-point ids: {points}")
        lines.append(f"add to pretrain_gpt.py: {result.flags(loss, alpha)}")
    return "\n".join(lines)
