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
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from .number_tokens import NUM_DIGITS, NUM_MULTI_DIGIT, multi_digit_text

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


class MultiDigitTokens(ValueError):
    """A tokenizer whose numbers hold tokens other than the ten digits (digits merged, or a
    digit after a space as a token of its own): allow_multi_digit_tokens=True accepts it.
    `how` says what it does, in a few words."""

    def __init__(self, message: str, how: str) -> None:
        super().__init__(message)
        self.how = how


MERGED = "MERGED into multi-digit tokens"
SPACED = "with a token of its own for a digit after a space"
OPT_IN = (
    "opt in with allow_multi_digit_tokens=True (--del-allow-multi-digit-tokens) to apply DEL "
    "to the bare digits '0'..'9' only"
)


def _spaced(decode, token_id: int, digit: str) -> bool:
    """Whether `token_id` is `digit` with whitespace around it (GPT-2's 'Ġ4'), not the digit."""
    text = decode(token_id)
    return text != digit and text.strip() == digit


def _spaced_digits(encode, decode) -> List[Tuple[int, str]]:
    """(id, text) of the tokens that are a digit after a space (' 4'), found by encoding them."""
    found = []
    for d in DIGIT_STRINGS:
        ids = encode(" " + d)
        if len(ids) == 1 and _spaced(decode, ids[0], d):
            found.append((ids[0], decode(ids[0])))
    return found


def spaced_digit_tokens(tok: Any) -> List[Tuple[int, str]]:
    """(id, text) of `tok`'s tokens for a digit after a space (GPT-2-style 'Ġ4', decoding to
    ' 4'): with allow_multi_digit_tokens they are not digit targets."""
    return _spaced_digits(*token_codec(tok))


def _points_and_spaced(encode, decode, digit_ids: List[int], name: str) -> Tuple[set, set]:
    """(ids of '.', ids of a digit after a space) in NUMBER_PROBES; ValueError if a digit has
    another bare id there than `digit_ids`."""
    points, spaced = set(), set()
    by_digit = dict(zip(DIGIT_STRINGS, digit_ids, strict=True))
    for text in NUMBER_PROBES:
        for i, piece in _pieces(encode, decode, text):
            if piece == ".":
                points.add(i)
            elif piece in by_digit and i != by_digit[piece]:
                if _spaced(decode, i, piece):
                    spaced.add((i, decode(i)))
                    continue
                expected = by_digit[piece]
                raise ValueError(
                    f"{name} gives digit {piece!r} the id {i} in {text!r} but {expected} inside "
                    "numbers: a digit must have one id; give the ids explicitly"
                )
    return points, spaced


def _spaced_refusal(name: str, spaced: List[Tuple[int, str]], digit_ids: List[int]):
    shown = ", ".join(f"{t!r} (id {i})" for i, t in spaced[:4])
    return MultiDigitTokens(
        f"this {name} has tokens of their own for a digit after a space ({shown}) beside the "
        "digits '0'..'9': the first digit of a number after a space would get no DEL term. Use "
        f"a tokenizer without them, {OPT_IN} (ids {' '.join(map(str, digit_ids))}; a digit "
        "after a space is then no digit target)",
        SPACED,
    )


def _number_digit_ids(encode, decode, name: str, allow: bool) -> Tuple[List[int], List[int]]:
    """(ids of '0'..'9', ids of a chunking vocab's 1,100 number tokens or []) as
    number_token_ids finds them."""
    probe = _pieces(encode, decode, DIGITS_PROBE)
    merged = _merged(probe) + [
        m for text in NUMBER_PROBES for m in _merged(_pieces(encode, decode, text))
    ]
    if not merged:
        tail = probe[1:]
        if tuple(p for _, p in tail) != DIGIT_STRINGS:
            raise ValueError(
                f"{name} does not tokenize {DIGITS_PROBE!r} into single digits "
                f"(got {[p for _, p in probe]}); give the ids explicitly with DigitVocab(...)"
            )
        return [i for i, _ in tail], []
    chunked, why_not = chunked_number_ids(encode, decode)
    if chunked is not None:
        logger.info(
            "del_megatron: %s cuts numbers into chunks of up to three digits; DEL gives "
            "every digit of them its own term (docs/DEL.md)",
            name,
        )
        return _single_digit_ids(encode, decode, name), chunked
    if not allow:
        raise MultiDigitTokens(
            f"this {name} merges digits into multi-digit tokens (found "
            f"{sorted(set(merged))[:8]}), but not as a chunking tokenizer does: {why_not}. "
            "DEL needs one digit per token, or chunks of up to three cut left to right "
            "with all 1,110 number tokens present (Llama-3, o200k, DeepSeek-V3). Use such "
            "a tokenizer, or opt in with allow_multi_digit_tokens=True "
            "(--del-allow-multi-digit-tokens) to apply DEL to single-digit tokens only (ids "
            "given by hand need the opt-in too)",
            MERGED,
        )
    logger.warning(
        "del_megatron: %s merges digits %s (%s); DEL applies to single-digit tokens only",
        name,
        sorted(set(merged))[:5],
        why_not,
    )
    return _single_digit_ids(encode, decode, name), []


class NumberTokenIds(NamedTuple):
    """The number token ids number_token_ids finds (what DigitVocab(...) takes, in its order):
    '0'..'9' in digit order, the decimal points (sorted), and a chunking vocab's 1,100
    multi-digit tokens "00".."99" then "000".."999" (multi_digit_text order) or []."""

    digit_ids: List[int]
    decimal_point_ids: List[int]
    multi_digit_ids: List[int]


def number_token_ids(tok: Any, allow_multi_digit_tokens: bool = False) -> NumberTokenIds:
    """The digit, '.' and multi-digit ids of `tok` (a tokenizer or a tokenizer file's path): one
    digit a token, or a chunking vocab (all 1,110 number tokens, numbers cut left to right in
    chunks of up to three) when the tokenizer is one. Any other tokenizer whose numbers hold
    other tokens (digits merged, or a digit after a space as a token of its own, GPT-2's 'Ġ4')
    raises MultiDigitTokens (a ValueError) with the reason, unless allow_multi_digit_tokens: then
    the multi-digit ids are [] and the digit ids are the bare single-digit tokens as they are
    encoded inside numbers. del_megatron.digits.vocab.digit_vocab_from_tokenizer makes a DigitVocab
    of them."""
    if isinstance(tok, (str, os.PathLike)):
        tok = load_tokenizer(os.fspath(tok))
    encode, decode = token_codec(tok)
    name = type(tok).__name__
    digit_ids, multi_digit_ids = _number_digit_ids(encode, decode, name, allow_multi_digit_tokens)
    points, spaced = _points_and_spaced(encode, decode, digit_ids, name)
    spaced = sorted(spaced | set(_spaced_digits(encode, decode)), key=lambda s: s[1])
    if spaced and not allow_multi_digit_tokens:
        raise _spaced_refusal(name, spaced, digit_ids)
    if spaced:
        logger.warning(
            "del_megatron: %s has tokens for a digit after a space %s; they are no digit targets",
            name,
            [t for _, t in spaced[:5]],
        )
    if not points:
        logger.warning("del_megatron: %s has no '.' token inside numbers; no decimal points", name)
    return NumberTokenIds(digit_ids, sorted(points), multi_digit_ids)


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


# Megatron-LM's TikTokenizer (--tokenizer-type TikTokenizer, megatron/core/tokenizers/text/
# libraries/tiktoken_tokenizer.py, the same at core_v0.16.1 to core_v0.19.0): a JSON list of
# {"rank", "token_bytes", "token_str"}, ids shifted by --tiktoken-num-special-tokens, the first
# --vocab-size minus that many entries read, split by one of two patterns (--tiktoken-pattern,
# default v2). Both patterns cut numbers one digit a token (\p{N}).
MEGATRON_TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
MEGATRON_TIKTOKEN_SPECIALS = 1000  # --tiktoken-num-special-tokens' default
MEGATRON_TIKTOKEN_VOCAB = 2**17  # TikTokenizer's vocab_size when --vocab-size is not given
MEGATRON_TIKTOKEN_KEYS = {"rank", "token_bytes", "token_str"}

# The rank files whose split is known, by their number of ranks: Qwen's qwen.tiktoken is
# read with Qwen's pattern (one digit a token, as Qwen's own tokenizer reads it).
QWEN_RANKS = 151_643
LLAMA3_RANKS = 128_000


def is_megatron_tiktoken_json(data: Any) -> bool:
    """Whether parsed JSON is the vocabulary Megatron-LM's TikTokenizer reads."""
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(x, dict) and x.keys() == MEGATRON_TIKTOKEN_KEYS for x in data[:8])
    )


def load_megatron_tiktoken(
    path: str,
    pattern: str = "v2",
    num_special_tokens: int = MEGATRON_TIKTOKEN_SPECIALS,
    vocab_size: int = MEGATRON_TIKTOKEN_VOCAB,
    data: Any = None,
):
    """A tiktoken Encoding that gives the ids of Megatron-LM's TikTokenizer for the JSON list at
    `path` (its --tokenizer-model), its --tiktoken-pattern (v1 or v2),
    --tiktoken-num-special-tokens and --vocab-size. ValueError naming the flag to fix when
    Megatron-LM could not read the file with them."""
    import base64

    import tiktoken

    if pattern not in MEGATRON_TIKTOKEN_PATTERNS:
        raise ValueError(
            f"--tiktoken-pattern {pattern!r}: Megatron-LM's TikTokenizer takes v1 or v2"
        )
    if data is None:
        data = _json_file(path, MEGATRON_TIKTOKEN_JSON)
    if not is_megatron_tiktoken_json(data):
        raise ValueError(f"{path!r} is not {MEGATRON_TIKTOKEN_JSON}")
    inner = vocab_size - num_special_tokens
    if len(data) < inner:
        raise ValueError(
            f"{path!r} holds {len(data):,} tokens and Megatron-LM's TikTokenizer reads its first "
            f"--vocab-size {vocab_size} - --tiktoken-num-special-tokens {num_special_tokens} = "
            f"{inner:,} (it stops on an assertion): pass the run's --vocab-size"
        )
    ranks = {
        base64.b64decode(x["token_bytes"]): x["rank"] + num_special_tokens for x in data[:inner]
    }
    return tiktoken.Encoding(
        path, pat_str=MEGATRON_TIKTOKEN_PATTERNS[pattern], mergeable_ranks=ranks, special_tokens={}
    )


MEGATRON_TIKTOKEN_JSON = (
    'the JSON list of {"rank", "token_bytes", "token_str"} that Megatron-LM\'s TikTokenizer reads'
)


def is_rank_file(path: str) -> bool:
    """Whether the file at `path` is a tiktoken rank file (lines '<base64> <rank>'), whatever
    its name (Meta's Llama-3 tokenizer.model is one)."""
    import base64
    import binascii

    with open(path, "rb") as fh:
        head = fh.read(4096).split(b"\n")[:-1] or [b""]
    parts = head[0].split()
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except (ValueError, binascii.Error):
        return False
    return True


def _rank_file_refusal(path: str, n_ranks: int) -> ValueError:
    what = "a tiktoken rank file"
    if n_ranks == LLAMA3_RANKS:
        what = f"a tiktoken rank file of {n_ranks:,} ranks, as Meta's Llama-3 tokenizer.model is"
    return ValueError(
        f"{path!r} is {what}: it carries no pre-tokenizer pattern, which decides how numbers "
        "split, and no Megatron-LM --tokenizer-type reads it (TikTokenizer takes a JSON list). "
        "Megatron-LM reads Llama-3 with --tokenizer-type HuggingFaceTokenizer and the folder "
        "holding its tokenizer.json, which cuts numbers into chunks of up to three digits: "
        "check that folder"
    )


def _tiktoken_file(path: str, pattern: Optional[str]):
    """A rank file with `pattern`; pattern None: Qwen's for Qwen's ranks, else refused."""
    import base64
    import binascii

    import tiktoken

    ranks = {}
    with open(path, "rb") as fh:
        for line_no, line in enumerate(fh, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                if len(parts) != 2:
                    raise ValueError
                ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
            except (ValueError, binascii.Error):
                raise ValueError(
                    f"{path}:{line_no}: not a tiktoken rank line ('<base64> <rank>')"
                ) from None
    if not ranks:
        raise ValueError(f"{path!r} holds no tiktoken ranks (lines '<base64> <rank>')")
    if pattern is None:
        if len(ranks) != QWEN_RANKS:
            raise _rank_file_refusal(path, len(ranks))
        pattern = QWEN_PATTERN
    return tiktoken.Encoding(path, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def _tekken_file(path: str, data: dict):
    import base64

    import tiktoken

    try:
        config = data["config"]
        specials = config.get("default_num_special_tokens", 0)
        n_ranks = config.get("default_vocab_size", len(data["vocab"]) + specials) - specials
        ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in data["vocab"][:n_ranks]}
        encoding = tiktoken.Encoding(
            path, pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={}
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f'{path!r} has a tekken "config" but is not a tekken JSON Mistral writes '
            f"({type(exc).__name__}: {exc})"
        ) from None
    return OffsetEncoding(encoding, specials)


# What a JSON tokenizer file holds, and the fix when a file does not.
JSON_TOKENIZER = (
    'a tokenizer.json is a JSON object with a "model", as Tokenizer.save of the tokenizers '
    'library writes it (a tekken JSON one with a "config" and a "vocab"): give the file your '
    "run's tokenizer is saved in"
)


def _json_file(path: str, expected: str = JSON_TOKENIZER, flag: str = "") -> Any:
    """The JSON value in the file at `path`; ValueError naming it (after `flag`, the option
    that gave it) and what it should hold when it is empty or no JSON."""
    import json

    with open(path, "rb") as fh:
        raw = fh.read()
    if not raw.strip():
        raise ValueError(f"{flag}{path!r} is empty: {expected}")
    try:
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{flag}{path!r} is not JSON ({exc}): {expected}") from None


def _is_vocab_json(data: dict) -> bool:
    """Whether `data` is a BPE vocab.json (token -> id; GPT-2's has a token "model" too)."""
    return bool(data) and all(type(v) is int for v in data.values())


def _json_tokenizer(path: str, data: Any):
    """A tekken JSON or a Hugging Face tokenizer.json, from the parsed file."""
    if not isinstance(data, dict):
        kind = {list: "list", str: "string"}.get(type(data), "number or literal")
        raise ValueError(f"{path!r} holds a JSON {kind} at its top: {JSON_TOKENIZER}")
    if isinstance(data.get("config"), dict) and "pattern" in data["config"]:
        return _tekken_file(path, data)
    if _is_vocab_json(data):
        raise ValueError(
            f"{path!r} is a vocab.json (token -> id), not a tokenizer.json: for GPT-2's BPE "
            f"pass --tokenizer-type GPT2BPETokenizer --vocab-file {path} --merge-file "
            "merges.txt (the merges.txt saved with it)"
        )
    if "model" not in data:
        what = "an empty JSON object" if not data else 'a JSON object without a "model"'
        raise ValueError(f"{path!r} is {what}: {JSON_TOKENIZER}")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the tokenizers library raises plain Exception
        raise ValueError(f"{path!r}: the tokenizers library cannot read it ({exc})") from None


def load_tokenizer(path: str, tiktoken_pattern: Optional[str] = None):
    """A tokenizer object from a file: SentencePiece `.model`, a tiktoken rank file (read with
    `tiktoken_pattern`, its pre-tokenizer; None: Qwen's for Qwen's qwen.tiktoken, any other
    rank file refused, since its split cannot be known), Mistral tekken JSON, Megatron-LM's
    TikTokenizer JSON list (its defaults: pattern v2, ids shifted by 1000), Hugging Face
    `tokenizer.json` (or a folder holding one). A file that is none of them raises ValueError
    naming it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {os.path.dirname(path)!r}")
    if path.endswith(".tiktoken") or is_rank_file(path):
        return _tiktoken_file(path, tiktoken_pattern)
    if path.endswith(".json"):
        data = _json_file(path)
        if is_megatron_tiktoken_json(data):
            return load_megatron_tiktoken(
                path, vocab_size=len(data) + MEGATRON_TIKTOKEN_SPECIALS, data=data
            )
        return _json_tokenizer(path, data)
    return load_sentencepiece(path)


def load_sentencepiece(path: str):
    """A SentencePiece processor of the model at `path`; ValueError when it is not one."""
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as exc:
        raise ValueError(
            f"{path!r} is not a SentencePiece model, a tiktoken rank file, a tekken JSON or a "
            "Hugging Face tokenizer.json"
        ) from exc


GPT2_VOCAB = (
    "a GPT-2 vocab.json is a JSON object of token -> id (--vocab-file; --merge-file takes the "
    "merges.txt saved with it)"
)


def _gpt2_vocab(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--vocab-file {path!r} does not exist (or is not a file)")
    data = _json_file(path, GPT2_VOCAB, "--vocab-file ")
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        raise ValueError(
            f"--vocab-file {path!r} is a tokenizer.json: pass it as --tokenizer-model with "
            "--tokenizer-type HuggingFaceTokenizer"
        )
    if not isinstance(data, dict) or not _is_vocab_json(data):
        raise ValueError(f"--vocab-file {path!r} is not a GPT-2 vocab.json: {GPT2_VOCAB}")


def _gpt2_merges(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--merge-file {path!r} does not exist (or is not a file)")
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = [line.rstrip("\r\n") for line in fh]
    merges = [line for line in lines if line and not line.startswith("#version")]
    bad = next((line for line in merges if len(line.split(" ")) != 2), None)
    if not merges or bad is not None:
        found = f"e.g. {bad[:40]!r}" if bad is not None else "no merges"
        raise ValueError(
            f"--merge-file {path!r} is not a GPT-2 merges.txt (lines 'a b', one merge each; "
            f"{found})"
        )


def load_gpt2_bpe(vocab_file: str, merge_file: str):
    """Megatron-LM's GPT2BPETokenizer (its --vocab-file and --merge-file) as a
    tokenizers.Tokenizer: GPT-2's byte-level BPE, with GPT-2's pre-tokenizer regex and no space
    added before the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    _gpt2_vocab(vocab_file)
    _gpt2_merges(merge_file)
    try:
        model = models.BPE.from_file(vocab_file, merge_file)
    except Exception as exc:  # the tokenizers library raises plain Exception
        raise ValueError(
            f"--vocab-file {vocab_file!r} and --merge-file {merge_file!r} are not one GPT-2 BPE "
            f"({exc})"
        ) from None
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok
