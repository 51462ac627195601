"""Find the digit and decimal-point token ids of a tokenizer, and check how it cuts numbers: one
digit per token, or left to right in chunks of up to three digits with all 1,110 number tokens
present (Llama-3, cl100k/o200k, DeepSeek-V3: DEL then has a term for every digit, docs/DEL.md).

Works by encoding probe strings and decoding each token back, through whichever interface the
tokenizer has: tiktoken Encoding, Hugging Face `tokenizers`/`transformers`, SentencePiece, or
Megatron's tokenizers (`tokenize`/`detokenize`). Token strings are never looked up directly: an
unknown piece maps to <unk> silently in SentencePiece, and '0' alone often tokenizes as '_0'.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional, Tuple

from .vocab import NUM_DIGITS, NUM_MULTI_DIGIT, DigitVocab, multi_digit_text

logger = logging.getLogger("del_megatron")

# Every digit appears in the middle of a number (the first token of a number may carry a word
# boundary marker, e.g. SentencePiece's '_1'); the others check what a real number looks like.
DIGITS_PROBE = "10123456789"
NUMBER_PROBES = ("3.14159", "1234567", "x = 42.5")
DIGIT_STRINGS = tuple(str(d) for d in range(NUM_DIGITS))
# How a chunking tokenizer cuts numbers: left to right, three digits at a time.
CHUNK_PROBES = {
    "12345": ["123", "45"],
    "1234567": ["123", "456", "7"],
    "2024": ["202", "4"],
    "3.14159": ["3", ".", "141", "59"],
}


def token_codec(tok: Any) -> Tuple[Callable[[str], List[int]], Callable[[int], str]]:
    """(encode text -> ids without special tokens, decode one id -> text) for `tok`."""
    encode, decode = _codec(tok)
    # Megatron's HuggingFaceTokenizer encodes with the tokenizer's special tokens (Llama-3's
    # <|begin_of_text|> before every text): the ids it gives the empty text are no text's own.
    added = set(encode(""))
    if added:
        return (lambda text: [i for i in encode(text) if i not in added]), decode
    return encode, decode


def _codec(tok: Any) -> Tuple[Callable[[str], List[int]], Callable[[int], str]]:
    if hasattr(tok, "encode_ordinary") and hasattr(tok, "decode_single_token_bytes"):  # tiktoken
        return tok.encode_ordinary, lambda i: tok.decode_single_token_bytes(i).decode(
            "utf-8", errors="replace"
        )
    if hasattr(tok, "get_vocab_size") and hasattr(tok, "encode") and hasattr(tok, "id_to_token"):
        # Hugging Face `tokenizers.Tokenizer`
        return (
            lambda text: tok.encode(text, add_special_tokens=False).ids,
            lambda i: tok.decode([i], skip_special_tokens=False),
        )
    if hasattr(tok, "piece_to_id") and hasattr(tok, "encode"):  # SentencePiece
        return lambda text: list(tok.encode(text, out_type=int)), lambda i: tok.decode([i])
    if hasattr(tok, "convert_tokens_to_ids") and hasattr(tok, "encode"):  # transformers
        return (
            lambda text: list(tok.encode(text, add_special_tokens=False)),
            lambda i: tok.decode([i]),
        )
    if hasattr(tok, "tokenize") and hasattr(tok, "detokenize"):  # Megatron tokenizers
        return lambda text: list(tok.tokenize(text)), lambda i: tok.detokenize([i])
    raise TypeError(
        f"cannot read digit ids from a {type(tok).__name__}: pass a SentencePiece processor, "
        "a Hugging Face tokenizer, a tiktoken Encoding or a Megatron tokenizer, or give the ids "
        "explicitly: DigitVocab(digit_ids=[...], decimal_point_ids=[...])"
    )


def _pieces(encode, decode, text: str) -> List[Tuple[int, str]]:
    """(id, decoded text without surrounding whitespace) per token, whitespace-only dropped."""
    out = []
    for i in encode(text):
        piece = decode(i).strip()
        if piece:
            out.append((i, piece))
    return out


def _merged(pieces) -> List[str]:
    return [p for _, p in pieces if sum(c.isdigit() for c in p) > 1]


def chunked_number_ids(encode, decode) -> Tuple[Optional[List[int]], str]:
    """The ids of '00'..'99' and '000'..'999' (multi_digit_text order) when the tokenizer cuts
    numbers as a chunking one does (each of them one token, numbers cut left to right in chunks
    of three: CHUNK_PROBES); else (None, why not)."""
    ids, missing = [], []
    for index in range(NUM_MULTI_DIGIT):
        text = multi_digit_text(index)
        pieces = _pieces(encode, decode, text)
        if len(pieces) == 1 and pieces[0][1] == text:
            ids.append(pieces[0][0])
        else:
            missing.append(text)
    if missing:
        return None, (
            f"{len(missing)} of the 1,100 two- and three-digit numbers are not one token each "
            f"(e.g. {missing[:3]})"
        )
    for text, expected in CHUNK_PROBES.items():
        got = [p for _, p in _pieces(encode, decode, text)]
        if got != expected:
            return None, f"it cuts {text!r} as {got}, not left to right in threes ({expected})"
    if len(set(ids)) != len(ids):
        return None, "some two- or three-digit numbers share a token id"
    return ids, ""


def _single_digit_ids(encode, decode, name: str) -> List[int]:
    digit_ids = []
    for d in DIGIT_STRINGS:
        single = [i for i, p in _pieces(encode, decode, d) if p == d]
        if len(single) != 1:
            raise ValueError(f"{name} has no single-digit token for {d!r}")
        digit_ids.append(single[0])
    return digit_ids


def digit_vocab_from_tokenizer(tok: Any, allow_multi_digit_tokens: bool = False) -> DigitVocab:
    """DigitVocab of `tok`: one digit a token, or a chunking vocab (all 1,110 number tokens,
    numbers cut left to right in chunks of up to three; DigitVocab.multi_digit_ids) when the
    tokenizer is one. Any other tokenizer that merges digits raises ValueError with the reason,
    unless allow_multi_digit_tokens: then DEL applies to the single-digit tokens only (numbers
    made of multi-digit tokens get no numerical term, and a run's places count tokens)."""
    if isinstance(tok, (str, os.PathLike)):
        tok = load_tokenizer(os.fspath(tok))
    encode, decode = token_codec(tok)
    name = type(tok).__name__
    probe = _pieces(encode, decode, DIGITS_PROBE)
    merged = _merged(probe) + [
        m for text in NUMBER_PROBES for m in _merged(_pieces(encode, decode, text))
    ]
    multi_digit_ids: List[int] = []
    if merged:
        chunked, why_not = chunked_number_ids(encode, decode)
        if chunked is not None:
            multi_digit_ids = chunked
            logger.info(
                "del_megatron: %s cuts numbers into chunks of up to three digits; DEL gives "
                "every digit of them its own term (docs/DEL.md)",
                name,
            )
        elif not allow_multi_digit_tokens:
            raise ValueError(
                f"this {name} merges digits into multi-digit tokens (found "
                f"{sorted(set(merged))[:8]}), but not as a chunking tokenizer does: {why_not}. "
                "DEL needs one digit per token, or chunks of up to three cut left to right "
                "with all 1,110 number tokens present (Llama-3, o200k, DeepSeek-V3). Use such "
                "a tokenizer, give ids explicitly with DigitVocab(...) / --del-digit-token-ids, "
                "or opt in with allow_multi_digit_tokens=True (--del-allow-multi-digit-tokens) "
                "to apply DEL to single-digit tokens only"
            )
        else:
            logger.warning(
                "del_megatron: %s merges digits %s (%s); DEL applies to single-digit tokens only",
                name,
                sorted(set(merged))[:5],
                why_not,
            )
        digit_ids = _single_digit_ids(encode, decode, name)
    else:
        tail = probe[1:]
        if tuple(p for _, p in tail) != DIGIT_STRINGS:
            raise ValueError(
                f"{name} does not tokenize {DIGITS_PROBE!r} into single digits "
                f"(got {[p for _, p in probe]}); give the ids explicitly with DigitVocab(...)"
            )
        digit_ids = [i for i, _ in tail]

    points = set()
    by_digit = dict(zip(DIGIT_STRINGS, digit_ids, strict=True))
    for text in NUMBER_PROBES:
        for i, piece in _pieces(encode, decode, text):
            if piece == ".":
                points.add(i)
            elif piece in by_digit and i != by_digit[piece]:
                expected = by_digit[piece]
                raise ValueError(
                    f"{name} gives digit {piece!r} the id {i} in {text!r} but {expected} inside "
                    "numbers: a digit must have one id; give the ids explicitly"
                )
    if not points:
        logger.warning("del_megatron: %s has no '.' token inside numbers; no decimal points", name)
    return DigitVocab(digit_ids, sorted(points), multi_digit_ids)


# Qwen2/2.5's pre-tokenizer pattern: \p{N} alone splits numbers one digit per token.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class OffsetEncoding:
    """A tiktoken Encoding whose ids are shifted by `offset` (Mistral's tekken files put their
    special tokens first)."""

    def __init__(self, encoding, offset: int) -> None:
        self.encoding, self.offset = encoding, offset

    def encode_ordinary(self, text: str) -> List[int]:
        return [i + self.offset for i in self.encoding.encode_ordinary(text)]

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_id - self.offset)


def _tiktoken_file(path: str, pattern: str):
    import base64

    import tiktoken

    ranks = {}
    with open(path, "rb") as fh:
        for line_no, line in enumerate(fh, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2:
                raise ValueError(f"{path}:{line_no}: not a tiktoken rank line ('<base64> <rank>')")
            ranks[base64.b64decode(parts[0])] = int(parts[1])
    return tiktoken.Encoding(path, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def _tekken_file(path: str, data: dict):
    import base64

    import tiktoken

    config = data["config"]
    specials = config.get("default_num_special_tokens", 0)
    n_ranks = config.get("default_vocab_size", len(data["vocab"]) + specials) - specials
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in data["vocab"][:n_ranks]}
    encoding = tiktoken.Encoding(
        path, pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={}
    )
    return OffsetEncoding(encoding, specials)


def load_tokenizer(path: str, tiktoken_pattern: str = QWEN_PATTERN):
    """A tokenizer object from a file: SentencePiece `.model`, tiktoken rank file
    (`.tiktoken`, e.g. Qwen's; `tiktoken_pattern` is its pre-tokenizer), Mistral tekken JSON,
    Hugging Face `tokenizer.json` (or a folder holding one)."""
    import json

    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {os.path.dirname(path)!r}")
    if path.endswith(".tiktoken"):
        return _tiktoken_file(path, tiktoken_pattern)
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if isinstance(data.get("config"), dict) and "pattern" in data["config"]:
            return _tekken_file(path, data)
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as exc:
        raise ValueError(
            f"{path!r} is not a SentencePiece model, a .tiktoken rank file, a tekken JSON or a "
            "Hugging Face tokenizer.json"
        ) from exc
