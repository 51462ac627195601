"""A tokenizer read as Megatron-LM's `--tokenizer-type` reads it, for `del-megatron check`.

Each type takes one kind of file (megatron/core/tokenizers/utils/build_tokenizer.py, core_v0.16.1
to core_v0.19.0): the SentencePiece types a SentencePiece model, HuggingFaceTokenizer a folder
for transformers' AutoTokenizer (its tokenizer.json), TikTokenizer a JSON list of ranks (not a
tiktoken rank file, not tekken), GPT2BPETokenizer --vocab-file and --merge-file. A file another
type reads is refused naming both, so that `check` never reports a split the run would not have.
Without a type, the file is read by what it holds (tokenizers.load_tokenizer).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from .tokenizers import (
    MEGATRON_TIKTOKEN_SPECIALS,
    MEGATRON_TIKTOKEN_VOCAB,
    _is_vocab_json,
    is_megatron_tiktoken_json,
    is_rank_file,
    load_gpt2_bpe,
    load_megatron_tiktoken,
    load_sentencepiece,
    load_tokenizer,
)

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HUGGING_FACE = "HuggingFaceTokenizer"
TIKTOKEN = "TikTokenizer"
GPT2_BPE = "GPT2BPETokenizer"
NO_TEXT_TYPES = ("NullTokenizer", "NullMultimodalTokenizer")
TYPES = (*SENTENCEPIECE_TYPES, HUGGING_FACE, TIKTOKEN, GPT2_BPE, *NO_TEXT_TYPES)

# What each file kind is, and the type that reads it.
KINDS = {
    "sentencepiece": ("a SentencePiece model", "--tokenizer-type Llama2Tokenizer (or "
                      "SentencePieceTokenizer, GPTSentencePieceTokenizer)"),
    "tokenizer.json": ("a Hugging Face tokenizer.json", f"--tokenizer-type {HUGGING_FACE} with "
                       "the folder holding it"),
    "rank": ("a tiktoken rank file", f"--tokenizer-type {HUGGING_FACE} with the model's folder "
             "holding its tokenizer.json (no type reads a rank file)"),
    "tekken": ("a Mistral tekken JSON", f"--tokenizer-type {TIKTOKEN} with the list under its "
               '"vocab" key saved as a JSON file of its own (tekken\'s pattern is TikTokenizer\'s '
               "v2, its 1,000 special tokens the default)"),
    "megatron-tiktoken": ("Megatron-LM's TikTokenizer JSON list", f"--tokenizer-type {TIKTOKEN}"),
    "vocab.json": ("a GPT-2 vocab.json", f"--tokenizer-type {GPT2_BPE} --vocab-file it "
                   "--merge-file merges.txt"),
}  # fmt: skip


def file_kind(path: str) -> str:
    """One of KINDS' keys for the file (or folder) at `path`, by what it holds; "folder" for a
    folder without tokenizer.json, "unknown" for anything else."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return "tokenizer.json"
        return "folder"
    if is_rank_file(path):
        return "rank"
    with open(path, "rb") as fh:
        head = fh.read(1).lstrip()
        if not head:
            head = fh.read(64).lstrip()[:1]
    if head in (b"{", b"["):
        import json

        try:
            with open(path, "rb") as fh:
                data = json.load(fh)
        except ValueError:
            return "unknown"
        if is_megatron_tiktoken_json(data):
            return "megatron-tiktoken"
        if isinstance(data, dict):
            if isinstance(data.get("config"), dict) and "pattern" in data["config"]:
                return "tekken"
            if isinstance(data.get("model"), dict):
                return "tokenizer.json"
            if _is_vocab_json(data):
                return "vocab.json"
        return "unknown"
    try:
        load_sentencepiece(path)
    except ValueError:
        return "unknown"
    return "sentencepiece"


def _refuse(tokenizer_type: str, path: str, kind: str, reads: str) -> ValueError:
    what, fix = KINDS.get(kind, ("a file no Megatron-LM tokenizer type reads", ""))
    fix = f": for it, pass {fix}" if fix else ""
    return ValueError(
        f"--tokenizer-type {tokenizer_type} reads {reads}, and --tokenizer-model {path!r} is "
        f"{what}{fix}"
    )


def _vocab_size(tok: Any) -> Optional[int]:
    """Ids the tokenizer can give, added tokens included; None when unknown."""
    for name in ("get_piece_size", "n_vocab"):
        size = getattr(tok, name, None)
        if size is not None:
            return size() if callable(size) else size
    size = getattr(tok, "get_vocab_size", None)
    return size(with_added_tokens=True) if callable(size) else None


def read_as_megatron(
    tokenizer_type: Optional[str],
    path: Optional[str],
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tiktoken_pattern: str = "v2",
    tiktoken_num_special_tokens: int = MEGATRON_TIKTOKEN_SPECIALS,
    vocab_size: Optional[int] = None,
) -> Tuple[Any, str, Optional[int]]:
    """(the tokenizer, how to name it, its vocabulary size or None) as Megatron-LM builds it for
    these flags (tokenizer_type None: read by content). ValueError naming the mismatch and the
    fix when the file is not what the type reads, or the flags do not fit."""
    gpt2_files = vocab_file is not None or merge_file is not None
    if tokenizer_type == GPT2_BPE or (tokenizer_type is None and gpt2_files):
        if path is not None:
            raise ValueError(
                f"{GPT2_BPE} reads --vocab-file and --merge-file, not --tokenizer-model: drop "
                f"--tokenizer-model {path}"
            )
        if vocab_file is None or merge_file is None:
            raise ValueError(
                f"{GPT2_BPE} needs both --vocab-file (its vocab.json) and --merge-file (its "
                "merges.txt)"
            )
        tok = load_gpt2_bpe(vocab_file, merge_file)
        return tok, f"{vocab_file} + {merge_file}", _vocab_size(tok)
    if tokenizer_type is not None and tokenizer_type not in TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type!r}: this check reads {', '.join(TYPES)}"
        )
    if gpt2_files:
        raise ValueError(
            f"--vocab-file and --merge-file are {GPT2_BPE}'s files; --tokenizer-type "
            f"{tokenizer_type} reads --tokenizer-model only: drop them, or pass --tokenizer-type "
            f"{GPT2_BPE}"
        )
    if path is None:
        raise ValueError("give the tokenizer file (--tokenizer / --tokenizer-model)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
    kind = file_kind(path)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if kind != "sentencepiece":
            raise _refuse(tokenizer_type, path, kind, "a SentencePiece model")
        tok = load_sentencepiece(path)
    elif tokenizer_type == HUGGING_FACE:
        if kind != "tokenizer.json":
            raise _refuse(tokenizer_type, path, kind, "a folder with tokenizer.json")
        tok = load_tokenizer(path)
    elif tokenizer_type == TIKTOKEN or kind == "megatron-tiktoken":
        if kind != "megatron-tiktoken":
            raise _refuse(
                tokenizer_type, path, kind, "a JSON list of {rank, token_bytes, token_str}"
            )
        size = MEGATRON_TIKTOKEN_VOCAB if vocab_size is None else vocab_size
        tok = load_megatron_tiktoken(path, tiktoken_pattern, tiktoken_num_special_tokens, size)
        return tok, path, size
    else:
        tok = load_tokenizer(path)
    return tok, path, _vocab_size(tok)
