"""`prepare`: a number-rich corpus into a Megatron indexed dataset (.bin/.idx) plus held-out
evaluation problems, written atomically: a failed prepare leaves nothing behind (no .bin that
looks valid, and no folder it created)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import List, Optional

import numpy as np

from .config import CHUNKED, check_out_dir
from .corpus import BASE, DISTRIBUTIONS, read_jsonl, synthetic
from .text_tokenizer import TextTokenizer, train_chunking_bpe, train_sentencepiece

PREFIX = "corpus_text_document"


def prepare(
    out_dir: str,
    corpus: Optional[str] = None,
    tokenizer: Optional[str] = None,
    num_docs: int = 20000,
    num_eval: int = 128,
    seed: int = 1234,
    distribution: str = BASE,
) -> dict:
    """Write out_dir/{corpus_text_document.bin,.idx, eval.jsonl, tokenizer, meta.json}.

    corpus: a JSONL file ({"text": ...} per line) or None for the seeded synthetic corpus.
    tokenizer: a tokenizer file (see del_megatron.digits.tokenizers.load_tokenizer), None to train a
    digit-splitting SentencePiece model on the corpus, or "chunked" to train a byte-level BPE
    that cuts numbers into chunks of up to three digits (Llama-3's pre-tokenizer).
    distribution: the synthetic problems' distribution (corpus.DISTRIBUTIONS), of the training
    corpus when there is no `corpus` and of the held-out problems always."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    check_out_dir(out_dir)
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution {distribution!r}: one of {', '.join(DISTRIBUTIONS)}")
    if corpus is not None and not os.path.isfile(corpus):
        raise FileNotFoundError(f"corpus {corpus!r} does not exist")
    trained = tokenizer is None or tokenizer == CHUNKED
    if not trained and not os.path.exists(tokenizer):
        raise FileNotFoundError(f"tokenizer {tokenizer!r} does not exist")
    if corpus is None:
        texts = [p["prompt"] + p["answer"] for p in synthetic(num_docs, seed, distribution)]
    else:
        texts = list(read_jsonl(corpus))
    if not texts:
        raise ValueError(f"corpus {corpus!r} holds no documents")
    held_out = synthetic(num_eval, seed + 1, distribution, held_out=True)

    # Read the user's tokenizer where it is, so that an error names their path, not a copy's.
    tok = None if trained else TextTokenizer(tokenizer)
    created = _first_missing(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".prepare-", dir=out_dir)
    try:
        if tokenizer is None:
            tok = TextTokenizer(train_sentencepiece(texts, os.path.join(staging, "tokenizer")))
        elif tokenizer == CHUNKED:
            path = os.path.join(staging, "tokenizer.json")
            tok = TextTokenizer(train_chunking_bpe(texts, path))
        else:
            copy = shutil.copytree if os.path.isdir(tokenizer) else shutil.copyfile
            copy(tokenizer, os.path.join(staging, os.path.basename(os.path.normpath(tokenizer))))
        tok_name = os.path.basename(os.path.normpath(tok.path))
        dtype = np.int32 if tok.vocab_size > 65000 else np.uint16
        builder = IndexedDatasetBuilder(os.path.join(staging, PREFIX + ".bin"), dtype=dtype)
        n_tokens = 0
        for text in texts:
            ids = tok.encode(text) + [tok.eod]
            builder.add_document(np.array(ids, dtype=dtype), [len(ids)])
            n_tokens += len(ids)
        builder.finalize(os.path.join(staging, PREFIX + ".idx"))
        with open(os.path.join(staging, "eval.jsonl"), "w", encoding="utf-8") as fh:
            for item in held_out:
                fh.write(json.dumps(item) + "\n")
        meta = {
            "documents": len(texts),
            "tokens": n_tokens,
            "eval_problems": len(held_out),
            "tokenizer": tok_name,
            "vocab_size": tok.vocab_size,
            "seed": seed,
            "corpus": os.path.abspath(corpus) if corpus else "synthetic",
            "distribution": distribution,
        }
        with open(os.path.join(staging, "meta.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
        # .idx last: a reader that finds the .idx finds a complete .bin beside it.
        order = sorted(os.listdir(staging), key=lambda name: name.endswith(".idx"))
        for name in order:
            target = os.path.join(out_dir, name)
            if os.path.isdir(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
        return meta
    except BaseException:
        if created is not None:  # the folders this call made go again: nothing is left behind
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _first_missing(path: str) -> Optional[str]:
    """The outermost folder of `path` that does not exist yet (None if `path` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


def tokenizer_path(data_dir: str) -> str:
    with open(os.path.join(data_dir, "meta.json")) as fh:
        return os.path.join(data_dir, json.load(fh)["tokenizer"])


def load_eval(data_dir: str) -> List[dict]:
    with open(os.path.join(data_dir, "eval.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def build_train_dataset(data_dir: str, tok: TextTokenizer, seq_len: int, samples: int, seed: int):
    """Megatron's GPTDataset over the prepared corpus, through BlendedMegatronDatasetBuilder."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([os.path.join(data_dir, PREFIX)], None),
        split="100,0,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=os.path.join(data_dir, "cache"),
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config)
    train, _, _ = builder.build()
    return train
