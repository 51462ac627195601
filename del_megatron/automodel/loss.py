"""The numerical loss as a NeMo AutoModel `loss_fn`, named by `_target_` in the recipe's YAML.

AutoModel calls a logits loss as `loss_fn(logits=, labels=, num_label_tokens=)`: logits
[B, S, V] (a DTensor sharded on the vocabulary under tensor parallelism), labels [B, S] already
shifted, and num_label_tokens the step's loss tokens over its micro-batches and data-parallel
ranks (None in validation, where the raw sum is wanted). A DTensor's local shard goes through
the same vocab-parallel kernels as Megatron's logits, over its mesh's group; the logits are never
gathered.

The unit is the papers': alpha weighs the term's mean over the step's digit targets. With the
"digit" reduction that mean needs the step's digit targets, counted over its micro-batches and
data-parallel ranks before the first forward, as AutoModel counts num_label_tokens: the recipe
in recipe.py does it (`begin_step`). With the "token" reduction each digit token's term weighs
alpha / digit_share and nothing is counted.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import API_NAMES, NumericalLossConfig, check_settings
from ..digit_stats import digit_stats
from ..digits.numbers import number_layout
from ..digits.vocab import DigitVocab
from ..layout import VocabParallelLayout
from ..loss import digit_term_scale, loss_parts

NO_STEP_COUNT = (
    "del_megatron: reduction 'digit' weighs the term's mean over the step's digit targets, and "
    "no step count was given: use the recipe del_megatron.automodel.recipe.NumericalLossRecipe "
    "(`recipe:` in the YAML), which counts them as AutoModel counts num_label_tokens, or "
    "reduction: token with digit_share"
)
# Report entries, as Megatron-LM names them: (name, numerator, denominator) of the step's sums.
ENTRIES = (
    ("ce loss", "ce", "tokens"),
    ("{loss} term", "term", "digits"),
    ("digit acc", "correct", "digits"),
    ("digit entropy", "entropy", "digits"),
    ("digit target prob", "target_prob", "digits"),
    ("digit distance", "distance", "digits"),
)
SUMS = ("ce", "term", "correct", "entropy", "target_prob", "distance", "digits", "tokens")


def local_logits(logits: Any) -> Tuple[torch.Tensor, Optional[dist.ProcessGroup]]:
    """(this rank's [B, S, V_local] logits, the group holding the other vocab shards): a DTensor
    sharded on its last dimension over a 1-D mesh gives its local shard and the mesh's group; a
    plain tensor holds the whole vocabulary (None). Any other placement is refused by name."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(logits, DTensor):
        return logits, None
    placements, mesh = logits.placements, logits.device_mesh
    last = logits.dim() - 1
    if mesh.ndim == 1 and len(placements) == 1:
        placement = placements[0]
        if isinstance(placement, Shard) and placement.dim in (-1, last):
            return logits.to_local(), mesh.get_group()
        if isinstance(placement, Replicate):
            return logits.to_local(), None
    raise ValueError(
        f"del_megatron: logits reach the loss as a DTensor placed {tuple(placements)} on a "
        f"{mesh.ndim}-D mesh {mesh.mesh_dim_names}; the loss takes them sharded on the "
        "vocabulary (Shard(-1), as the tensor-parallel plans of AutoModel's LlamaForCausalLM and "
        "Qwen2 give them) or replicated: use one of those plans for lm_head"
    )


class NumericalLoss:
    """AutoModel loss: cross-entropy plus the numerical term on digit targets (docs/DEL.md).

    Args (the YAML's loss_fn keys besides _target_):
        numerical_loss: NumericalLossConfig's `loss` (the flag's and model-config field's name:
            AutoModel's loss builder takes `loss` itself); "ce" is an A/B's control arm.
        alpha, reduction, digit_share, slot_logits: NumericalLossConfig's, with its defaults.
        digit_ids, decimal_point_ids: the tokenizer's ids of '0'..'9' and '.', or None to read
            them from `tokenizer` (a path or a tokenizer) or, in the recipe, from the run's
            tokenizer; held against that tokenizer when both are there.
        allow_multi_digit_tokens: accept a tokenizer that merges digits another way than in
            chunks of three (DEL then acts on the single-digit tokens).
        ignore_index: the label of positions without a loss (AutoModel maps -100 to it).
    """

    def __init__(
        self,
        numerical_loss: str = NumericalLossConfig.loss,
        alpha: float = NumericalLossConfig.alpha,
        reduction: str = NumericalLossConfig.reduction,
        digit_share: Optional[float] = None,
        slot_logits: Optional[str] = None,
        digit_ids: Optional[Iterable[int]] = None,
        decimal_point_ids: Optional[Iterable[int]] = None,
        tokenizer: Any = None,
        allow_multi_digit_tokens: bool = False,
        ignore_index: int = -100,
    ) -> None:
        # the one check of the YAML's settings: a bad one stops the recipe before the model exists
        self.settings = check_settings(numerical_loss, alpha, reduction, digit_share, slot_logits)
        self.slot_rule, self.allow_multi_digit_tokens = slot_logits, allow_multi_digit_tokens
        self.ignore_index = ignore_index
        self.given = None
        if digit_ids is not None:
            self.given = DigitVocab(digit_ids, decimal_point_ids or ())
        self.cfg: Optional[NumericalLossConfig] = None
        if tokenizer is not None or self.given is not None:
            self.bind_tokenizer(tokenizer)
        self._step_digits: Optional[torch.Tensor] = None
        self._sums: Optional[torch.Tensor] = None
        # the model's vocabulary (the recipe sets it): plain logits must hold all of it
        self.vocab_size: Optional[int] = None

    def bind_tokenizer(self, tokenizer: Any) -> NumericalLossConfig:
        """Resolve the digit ids against the run's tokenizer (None: the ids given, unchecked)
        and fix the config; a second call keeps the first config."""
        if self.cfg is None:
            from ..megatron.digit_ids import resolve_vocab

            vocab = resolve_vocab(
                tokenizer,
                self.given,
                API_NAMES,
                allow_multi_digit_tokens=self.allow_multi_digit_tokens,
                slot_rule=self.slot_rule,
            )
            self.cfg = NumericalLossConfig.of(self.settings, vocab, self.ignore_index)
        return self.cfg

    def _config(self) -> NumericalLossConfig:
        if self.cfg is None:
            raise ValueError(
                "del_megatron: the loss has no digit ids: give digit_ids (and decimal_point_ids) "
                "or tokenizer in its YAML block, or run it with the recipe "
                "del_megatron.automodel.recipe.NumericalLossRecipe, which reads the run's"
            )
        return self.cfg

    def count_digit_targets(self, labels: Iterable[torch.Tensor]) -> torch.Tensor:
        """[] float64: the digit targets of these labels ([B, S] each, shifted as the loss gets
        them), in digits (a three-digit token counts 3), on the labels' device."""
        cfg, total = self._config(), None
        for batch_labels in labels:
            layout = number_layout(batch_labels, cfg.vocab, cfg.ignore_index)
            count = layout.digit_count.sum().double()
            total = count if total is None else total + count.to(total.device)
        return torch.zeros((), dtype=torch.float64) if total is None else total

    def begin_step(self, digit_targets: torch.Tensor) -> None:
        """The step's digit targets over its micro-batches and data-parallel ranks (the "digit"
        reduction's count); the step's report sums start from zero."""
        self._step_digits = digit_targets
        self._sums = None

    def step_sums(self) -> torch.Tensor:
        """[len(SUMS)] float64: this rank's sums over the step's micro-batches so far, in SUMS'
        order, for the recipe to all-reduce over data parallel and pass to entries()."""
        return torch.zeros(len(SUMS), dtype=torch.float64) if self._sums is None else self._sums

    def entries(self, sums: torch.Tensor) -> Dict[str, float]:
        """Report entries (Megatron-LM's names) from sums ([len(SUMS)], as step_sums) over a
        step's ranks and micro-batches; the term's only where there is one, and none over digit
        targets that are not there."""
        loss, sums = self._config().loss, dict(zip(SUMS, sums.tolist(), strict=True))
        out: Dict[str, float] = {"digit tokens": sums["digits"]}
        for name, numerator, denominator in ENTRIES:
            if numerator == "term" and loss == "ce":
                continue
            if sums[denominator] > 0:
                out[name.format(loss=loss)] = sums[numerator] / sums[denominator]
        return out

    def __call__(
        self,
        logits: Any,
        labels: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        num_label_tokens: Optional[int] = None,
        loss_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """[] the micro-batch's loss: sum(CE) + w x sum(term) over its loss tokens, divided by
        num_label_tokens when given (training), the raw sum when None (validation). w is
        alpha / digit_share ("token"), or alpha x num_label_tokens / the step's digit targets
        ("digit", so that the step's loss is mean CE + alpha x the term's mean over its digit
        targets); in validation the batch's own counts."""
        cfg = self._config()
        if loss_weights is not None:
            raise ValueError(
                "del_megatron: per-token loss_weights (AutoModel's domain mixture) are not "
                "supported by the numerical loss: drop the domain mixture"
            )
        if mask is not None:
            labels = labels.masked_fill(mask == 0, cfg.ignore_index)
        shard, tp_group = local_logits(logits)
        if tp_group is None and self.vocab_size is not None and shard.size(-1) < self.vocab_size:
            raise ValueError(
                f"del_megatron: the logits are a plain tensor of {shard.size(-1)} columns where "
                f"the model's vocabulary has {self.vocab_size}: a vocab shard without its group "
                "(a tensor-parallel plan with use_local_output=True for lm_head). Keep lm_head's "
                "output a DTensor sharded on the vocabulary (use_local_output=False)"
            )
        layout = VocabParallelLayout(tp_group=tp_group)
        parts = loss_parts(labels, shard.transpose(0, 1), cfg, layout)
        target = (labels != cfg.ignore_index).to(parts.ce.dtype)
        ce, term = (parts.ce * target).sum(), (parts.term * target).sum()
        stats = digit_stats(target, parts)
        weight = self._term_weight(cfg, stats.n_digits, target.sum(), num_label_tokens)
        total = ce + weight * term
        if torch.is_grad_enabled():
            self._add(ce, term, stats, target.sum())
        if num_label_tokens is None:
            return total
        return total / max(num_label_tokens, 1)

    def _term_weight(
        self,
        cfg: NumericalLossConfig,
        batch_digits: torch.Tensor,
        batch_tokens: torch.Tensor,
        num_label_tokens: Optional[int],
    ) -> Any:
        if not cfg.counts_digits:
            return cfg.term_weight()
        if num_label_tokens is None:  # validation: this batch's own mean over digit targets
            return cfg.term_weight(digit_term_scale(batch_tokens, batch_digits))
        if self._step_digits is None:
            raise RuntimeError(NO_STEP_COUNT)
        digits = self._step_digits.to(batch_digits.device, batch_digits.dtype)
        return cfg.term_weight(digit_term_scale(num_label_tokens, digits))

    def _add(self, ce, term, stats, tokens) -> None:
        these = torch.stack(
            [
                ce.detach().double(),
                term.detach().double(),
                stats.correct.double(),
                stats.entropy.double(),
                stats.target_prob.double(),
                stats.distance.double(),
                stats.n_digits.double(),
                tokens.double(),
            ]
        )
        self._sums = these if self._sums is None else self._sums + these.to(self._sums.device)
