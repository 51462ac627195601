"""NeMo AutoModel's LLM recipe with the numerical loss's step accounting and report.

Named by the YAML's `recipe: del_megatron.automodel.recipe.NumericalLossRecipe`. Over AutoModel's
TrainFinetuneRecipeForNextTokenPrediction it:
- refuses before step 1, in one line on rank 0, what the loss cannot compute exactly: context
  and pipeline parallelism, packed (THD) batches, a domain mixture (from the YAML, before
  AutoModel builds anything), and a loss_fn that is no longer ours (AutoModel swaps a custom
  loss for MaskedCrossEntropy when the model's forward has no `logits_to_keep`), and AutoModel's
  compiled fp32 RMSNorm under tensor parallelism (it drops its input's gradient there);
- gives the loss the run's tokenizer when its YAML names no digit ids;
- counts each step's digit targets over its micro-batches and data-parallel ranks before the
  first forward, as the recipe counts num_label_tokens (the "digit" reduction's unit);
- adds `ce loss`, `<loss> term`, `digit acc`, `digit entropy`, `digit target prob`,
  `digit distance` and `digit tokens` (Megatron-LM's names) to each step's metrics, which
  AutoModel writes to training.jsonl and its remote loggers.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

from ..megatron.refusals import one_line
from .loss import NumericalLoss


def _refusal(cause: str, fix: str) -> ValueError:
    return ValueError(f"del_megatron: {cause}: {fix}")


def check_rms_norm_under_tensor_parallel(model_parts: List[torch.nn.Module], tp_size: int) -> None:
    """Refuse AutoModel's Float32RMSNorm (BackendConfig rms_norm "torch_fp32", its default) at
    tp_size > 1. Its torch.compile'd custom op returns no gradient for an input that is an
    AsyncCollectiveTensor, which the first decoder layer's input is at TP > 1 (the output of the
    vocab-parallel embedding's all-reduce): the input embedding then trains on the residual
    path's gradient alone, whatever the loss (tests/test_automodel.py)."""
    if tp_size <= 1:
        return
    names = sorted(
        {
            name
            for part in model_parts
            for name, module in part.named_modules()
            if type(module).__name__ == "Float32RMSNorm"
        }
    )
    if names:
        raise _refusal(
            f"AutoModel's compiled fp32 RMSNorm ({names[0]} and {len(names) - 1} more; model "
            "backend rms_norm torch_fp32, the default) drops the gradient of an input that comes "
            "out of a tensor-parallel all-reduce, as the first layer's does at tp_size > 1, so "
            "the input embedding would train on part of its gradient",
            "add to the model block backend: {_target_: "
            "nemo_automodel.components.models.common.BackendConfig, rms_norm: torch}",
        )


class NumericalLossRecipe(TrainFinetuneRecipeForNextTokenPrediction):
    """AutoModel's next-token recipe with the numerical loss (module docstring)."""

    def setup(self) -> None:
        one_line(self._check_the_config)()
        super().setup()
        one_line(self._check_what_setup_built)()

    def _check_the_config(self) -> None:
        """Refusals the YAML decides, before AutoModel builds anything (one line on rank 0, exit
        code 2)."""
        cfg = self.cfg
        if (cfg.get("distributed.pp_size", 1) or 1) > 1:
            raise _refusal(
                "pipeline parallelism hands the loss no num_label_tokens and is not tested with "
                "the numerical loss",
                "set distributed.pp_size: 1",
            )
        if (cfg.get("distributed.cp_size", 1) or 1) > 1:
            raise _refusal(
                "context parallelism gives the loss each rank's chunks of a sequence without their "
                "places in it, so a number cut at a chunk seam would be weighed wrong",
                "set distributed.cp_size: 1",
            )
        dataloader = cfg.dataloader
        packed = (cfg.get("packed_sequence.packed_sequence_size", 0) or 0) > 0
        if packed or (dataloader is not None and (dataloader.emits_thd or dataloader.packing)):
            raise _refusal(
                "packed (THD) batches reach the loss without their document boundaries, so a "
                "number would run on across a document start",
                "drop the packing (packed_sequence_size, the THD collater) from the dataloader",
            )
        if cfg.get("domain_mixture") is not None:
            raise _refusal(
                "a domain mixture weighs each token by its dataset, which the numerical loss "
                "does not",
                "drop domain_mixture",
            )

    def _check_what_setup_built(self) -> None:
        """The loss is still ours (AutoModel may have swapped it), it gets the digit ids and the
        vocabulary size from the run's tokenizer and model, and the model's RMSNorm passes
        gradients under tensor parallelism."""
        mesh = self.device_mesh
        tp_size = mesh["tp"].size() if mesh is not None and "tp" in mesh.mesh_dim_names else 1
        check_rms_norm_under_tensor_parallel(self.model_parts, tp_size)
        loss = self.loss_fn
        if not isinstance(loss, NumericalLoss):
            raise _refusal(
                f"the recipe's loss is {type(loss).__name__}, not del_megatron's NumericalLoss "
                "(AutoModel replaces a custom loss by MaskedCrossEntropy when the model's forward "
                "takes no logits_to_keep)",
                "use a model whose forward takes logits_to_keep (AutoModel's and Hugging Face's "
                "Llama and Qwen2 do), and name del_megatron.automodel.loss.NumericalLoss in "
                "loss_fn",
            )
        cfg = loss.cfg if loss.cfg is not None else loss.bind_tokenizer(self.tokenizer)
        vocab_size = getattr(getattr(self.model_parts[0], "config", None), "vocab_size", None)
        if isinstance(vocab_size, int):
            cfg.vocab.check_vocab_size(vocab_size)
            loss.vocab_size = vocab_size

    def _run_train_optim_step(self, batches, max_grad_norm: Optional[float] = None) -> Any:
        loss: NumericalLoss = self.loss_fn
        digits = loss.count_digit_targets(batch["labels"] for batch in batches)
        loss.begin_step(self._dp_allreduce(digits.cpu()))
        sample = super()._run_train_optim_step(batches, max_grad_norm)
        totals = self._dp_allreduce(loss.step_sums().cpu())
        sample.metrics.update(loss.entries(totals))
        return sample
