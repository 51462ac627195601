"""The demo's training settings: one dataclass that the CLI turns into flags, with the range
each numeric setting must lie in (checked by argparse before anything launches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Mapping, Sequence

from ..preflight import SENTENCEPIECE
from ..slots import DEFAULT_SLOT_LOGITS

# `--tokenizer chunked`: prepare trains a byte-level BPE that cuts numbers into chunks of up to
# three digits, with Llama-3's pre-tokenizer (text_tokenizer.train_chunking_bpe).
CHUNKED = "chunked"
# The `del_single` loss: DEL on the ten single-digit tokens only (DigitVocab.single_digits_only),
# what a chunking tokenizer got before DEL had slots; the same as `del` on a one-digit tokenizer.
SINGLE_DIGIT_DEL = "del_single"

# The demo's reduction, which makes alpha the weight on the mean term over digit targets.
WEIGHT_REDUCTION = "digit"

# Ranges of numeric settings: "positive" (> 0) or "non-negative" (>= 0).
POSITIVE, NON_NEGATIVE = "positive", "non-negative"


def _setting(default, bound: str, help: str = ""):
    return field(default=default, metadata={"bound": bound, "help": help})


@dataclass
class TrainConfig:
    data_dir: str
    out_dir: str
    loss: str = "del"
    # `del-megatron check`'s recommendation for the demo's tokenizer (a digit-splitting
    # SentencePiece model): the DEL paper's weight in its CodeLlama and Mistral runs
    alpha: float = _setting(
        SENTENCEPIECE.alpha,
        NON_NEGATIVE,
        "weight of the numerical term (`del-megatron check --tokenizer T` recommends one for "
        "a tokenizer T you bring)",
    )
    steps: int = _setting(1500, POSITIVE, "optimizer steps")
    micro_batch: int = _setting(16, POSITIVE, "sequences a step")
    seq_len: int = _setting(64, POSITIVE, "tokens a sequence")
    hidden: int = _setting(192, POSITIVE, "hidden size (a multiple of --heads)")
    layers: int = _setting(3, POSITIVE, "transformer layers")
    heads: int = _setting(6, POSITIVE, "attention heads (a multiple of the TP size)")
    lr: float = _setting(2e-3, POSITIVE, "peak learning rate")
    min_lr: float = _setting(2e-4, NON_NEGATIVE, "final learning rate of the cosine decay")
    warmup: int = _setting(50, NON_NEGATIVE, "warm-up steps (capped at steps / 5)")
    seed: int = _setting(1234, NON_NEGATIVE, "random seed")
    save_interval: int = _setting(250, POSITIVE, "steps between checkpoints")
    resume: bool = False
    stop_after: int = _setting(0, NON_NEGATIVE, "stop as if killed after this step (0: never)")
    eval_problems: int = _setting(
        0, NON_NEGATIVE, "held-out problems scored at the end of the run (0: all)"
    )
    curve_points: int = _setting(
        10, NON_NEGATIVE, "evenly spaced steps at which the learning curve is scored (0: none)"
    )
    curve_problems: int = _setting(
        200, NON_NEGATIVE, "held-out problems (the first N) scored at each curve point (0: all)"
    )
    progress: bool = True
    # alpha's unit: the weight on the mean term over digit targets (NumericalLossConfig's
    # "digit" reduction). Runs made before it was recorded trained alpha x the batch's digit
    # share on that mean (the old "token" reduction): LEGACY_SETTINGS.
    reduction: str = WEIGHT_REDUCTION
    # A chunking tokenizer's slot rule (NumericalLossConfig.slot_logits; `--slot-logits`).
    slot_logits: str = DEFAULT_SLOT_LOGITS


# Fields that are not flags of their own (the CLI sets them by other means).
NOT_FLAGS = ("data_dir", "out_dir", "loss", "resume", "progress", "reduction", "slot_logits")
# What a saved run that lacks a setting trained with (it was made before the setting existed).
LEGACY_SETTINGS = {"reduction": "token", "slot_logits": "any"}
# Losses on which the slot rule has no effect: compare does not tell their runs apart by it.
NO_SLOTS = ("ce", SINGLE_DIGIT_DEL)

# Fields that do not change what a run trains: where it lives, how it is driven, how much of the
# held-out set it is scored on and when (scoring draws no random numbers: the weights are the
# same). A checkpoint resumes across them; `compare` reuses a run only if it was scored alike.
SCORING = ("eval_problems", "curve_points", "curve_problems")
NOT_DEFINING = (
    "data_dir",
    "out_dir",
    "resume",
    "progress",
    "stop_after",
    "save_interval",
    *SCORING,
)


def differing_settings(
    saved: Mapping[str, object],
    wanted: Mapping[str, object],
    ignore: Sequence[str] = NOT_DEFINING,
) -> List[str]:
    """'name saved -> wanted' for each setting in `wanted` (but `ignore`) that a saved run (the
    config in its metrics.json or checkpoint) has otherwise. Settings it lacks are skipped,
    except those of LEGACY_SETTINGS, which it trained with."""
    saved = {**LEGACY_SETTINGS, **saved} if saved else saved
    return [
        f"{name} {saved[name]!r} -> {value!r}"
        for name, value in wanted.items()
        if name not in ignore and name in saved and saved[name] != value
    ]
