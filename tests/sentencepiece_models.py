"""Small SentencePiece models trained on number-rich text, in seconds: "split" keeps one digit
per token (Llama-2 / Mistral style), "merging" learns multi-digit pieces."""

import random
from pathlib import Path
from typing import Dict


def train_sentencepiece_models(folder: Path) -> Dict[str, str]:
    import sentencepiece as spm

    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 6)))
        for _ in range(300)
    ]
    lines = [
        f"{rng.choice(words)} {rng.randint(0, 999)} {rng.choice(words)} "
        f"{rng.randint(1, 99)}.{rng.randint(0, 99):02d} {rng.choice(words)} {rng.randint(10, 5000)}"
        for _ in range(4000)
    ]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    models = {}
    for name, split in (("split", True), ("merging", False)):
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(folder / name), vocab_size=400,
            split_digits=split, model_type="bpe", hard_vocab_limit=False, minloglevel=2,
        )  # fmt: skip
        models[name] = str(folder / f"{name}.model")
    return models
