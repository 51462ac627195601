"""Say so when a run resumes a checkpoint trained with other numerical-loss settings.

Megatron-LM's load_checkpoint hands the args a checkpoint was saved with (state_dict['args'])
to megatron.training.checkpointing.check_checkpoint_args (core_v0.16.1, core_v0.18.0 and
core_v0.19.0 alike; core 0.19 adds a skip_args keyword) before iteration 1, on every rank,
unless --finetune is set or --pretrained-checkpoint started the run (Megatron-LM compares no
args then, and neither do we). install() wraps that module-level function: Megatron-LM's own
checks run first, then rank 0 logs once what this run changes (announcements). A change is
never refused: continuing a CE checkpoint with DEL is the main use.

A checkpoint of del-megatron 0.1 has no del_digit_share: under its token reduction, --del-alpha
weighed each digit token's term, so the weight on the mean digit term was alpha x the data's
digit share, where it is now alpha itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .. import config
from ..config import NumericalLossConfig
from . import registration as reg

MODULE = "megatron.training.checkpointing"
FUNCTION = "check_checkpoint_args"

MIGRATION = "docs/megatron-lm.md, 'Migrating from 0.1'"
# del-megatron 0.1's defaults, for checkpoints that lack a flag.
OLD_ALPHA = 0.01
OLD_REDUCTION = "token"

# Settings field -> the Megatron-LM flag that sets it (config.FLAGS; the ids are the vocab's).
FLAGS = {
    field: config.FLAGS["vocab" if field == "digit_ids" else field]
    for field in ("loss", "alpha", "reduction", "digit_share", "digit_ids", "slot_logits")
}
NAMES = {"ce": "CE", "del": "DEL"}

OLD_UNIT = (
    "del_megatron: the checkpoint in --load was trained by del-megatron 0.1 with --del-alpha "
    "{old} under the token reduction: a weight of {old} x its data's digit share on the mean "
    "digit term. This run's --del-alpha {new} is the weight on the mean digit term itself "
    "({migration}); --del-reduction token --del-digit-share 1 --del-alpha {old} trains what "
    "the checkpoint trained"
)
CHANGED = (
    "del_megatron: the checkpoint in --load was trained with other numerical-loss settings: "
    "{changes}; this run trains with its own from here"
)
FROM_CE = "del_megatron: this run continues a CE checkpoint with {name} ({flags})"
TO_CE = (
    "del_megatron: this run continues a {name} checkpoint ({flags}) with CE: no numerical "
    "term from here"
)


@dataclass(frozen=True)
class Settings:
    """What a numerical loss trains, as a checkpoint's args or a run name it: a checkpoint of
    0.1 may hold settings NumericalLossConfig now refuses, so this is a view for comparing, not
    a config. Loss "ce" leaves every other field None."""

    loss: str = "ce"
    alpha: Optional[float] = None
    reduction: Optional[str] = None
    digit_share: Optional[float] = None
    digit_ids: Optional[Tuple[int, ...]] = None
    # a chunking tokenizer's slot rule; None where the run gives no multi-digit token a term
    slot_logits: Optional[str] = None


def _slot_rule_of_args(args: Any) -> Optional[str]:
    """The slot rule args asked for (--del-slot-logits); None where they name none, so a
    checkpoint from before the flag, or a run on single digits, is not compared."""
    return getattr(args, "del_slot_logits", None)


def settings_of_args(args: Any) -> Settings:
    """The Settings a Namespace of Megatron-LM args names (a checkpoint's, or a run's); one
    without numerical_loss, as plain Megatron-LM saves, is CE."""
    loss = getattr(args, "numerical_loss", None) or "ce"
    if loss == "ce":
        return Settings()
    ids = getattr(args, "del_digit_token_ids", None)
    return Settings(
        loss=loss,
        alpha=getattr(args, "del_alpha", OLD_ALPHA),
        reduction=getattr(args, "del_reduction", None) or OLD_REDUCTION,
        digit_share=getattr(args, "del_digit_share", None),
        digit_ids=None if ids is None else tuple(ids),
        slot_logits=_slot_rule_of_args(args),
    )


def settings_of_config(cfg: NumericalLossConfig) -> Settings:
    """The Settings of a registered config (its digit ids as read from the tokenizer)."""
    if cfg.loss == "ce":
        return Settings()
    ids = None if cfg.vocab is None else tuple(cfg.vocab.digit_ids)
    rule = cfg.slot_logits if cfg.vocab is not None and cfg.vocab.chunked else None
    return Settings(cfg.loss, cfg.alpha, cfg.reduction, cfg.digit_share, ids, rule)


def is_old_unit(args: Any) -> bool:
    """Whether checkpoint args were saved by del-megatron 0.1 (no del_digit_share) with the
    token reduction, whose alpha weighed each digit token's term."""
    settings = settings_of_args(args)
    return (
        settings.loss != "ce"
        and settings.reduction == "token"
        and not hasattr(args, "del_digit_share")
    )


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def changes(old: Settings, new: Settings, fields: Sequence[str] = tuple(FLAGS)) -> List[str]:
    """'--flag old -> new' for each of `fields` that differs (digit ids and slot rules only when
    both sides name them: a checkpoint saved without --del-digit-token-ids read them from its
    tokenizer, and a slot rule is only a chunking tokenizer's)."""
    found = []
    for name in fields:
        before, after = getattr(old, name), getattr(new, name)
        if name in ("digit_ids", "slot_logits") and (before is None or after is None):
            continue
        if before != after:
            found.append(f"{FLAGS[name]} {_shown(before)} -> {_shown(after)}")
    return found


def flags_of(settings: Settings) -> str:
    """The flags that give `settings` (digit ids left out)."""
    shown = [
        f"{FLAGS[field]} {_shown(getattr(settings, field))}"
        for field in ("loss", "alpha", "reduction", "digit_share", "slot_logits")
        if field in ("loss", "alpha", "reduction") or getattr(settings, field) is not None
    ]
    return " ".join(shown)


def old_unit_line(old_alpha: float, new_alpha: float) -> str:
    return OLD_UNIT.format(old=_shown(old_alpha), new=_shown(new_alpha), migration=MIGRATION)


def _switch_line(old: Settings, new: Settings) -> Optional[str]:
    if old.loss == new.loss:
        return None
    if old.loss == "ce":
        return FROM_CE.format(name=NAMES.get(new.loss, new.loss), flags=flags_of(new))
    return TO_CE.format(name=NAMES.get(old.loss, old.loss), flags=flags_of(old))


def announcements(checkpoint_args: Any, run: Settings) -> List[str]:
    """What to log when a run with `run` resumes a checkpoint saved with `checkpoint_args`:
    nothing when it trains what the checkpoint trained."""
    old = settings_of_args(checkpoint_args)
    if "ce" in (old.loss, run.loss):
        line = _switch_line(old, run)
        return [] if line is None else [line]
    lines, fields = [], tuple(FLAGS)
    if is_old_unit(checkpoint_args):
        lines.append(old_unit_line(old.alpha, run.alpha))
        fields = (
            "loss",
            "digit_ids",
            "slot_logits",
        )  # the line above says what alpha and the reduction mean
    changed = changes(old, run, fields)
    if changed:
        lines.append(CHANGED.format(changes=", ".join(changed)))
    return lines


def run_settings(args: Any) -> Settings:
    """This run's Settings: the registered config's when there is one, else its args'."""
    cfg = reg.run_config()
    return settings_of_args(args) if cfg is None else settings_of_config(cfg)


def announce(checkpoint_args: Any, args: Any) -> None:
    """Log each announcement once, at INFO, on rank 0."""
    for line in announcements(checkpoint_args, run_settings(args)):
        reg.log_once(f"resume: {line}", "%s", line)


def _wrap(check: Callable, module: Any) -> Callable:
    # Megatron-LM's own check first (it may refuse), then the announcement

    @functools.wraps(check)
    def check_checkpoint_args(checkpoint_args, *args, **kwargs):
        result = check(checkpoint_args, *args, **kwargs)
        announce(checkpoint_args, module.get_args())
        return result

    return check_checkpoint_args


def install() -> None:
    """Wrap Megatron-LM's check_checkpoint_args until unregister() (a no-op without
    Megatron-LM). Idempotent."""
    reg.wrap_in_place(MODULE, FUNCTION, _wrap)
