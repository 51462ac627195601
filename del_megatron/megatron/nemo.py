"""NeMo 2 adapter (written against NeMo 2.x `nemo.lightning.megatron_parallel`:
MaskedTokenLossReduction.forward(batch, forward_out) -> (loss, dict) with batch["loss_mask"]).

    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction
    from del_megatron.megatron.nemo import numerical_loss_reduction

    class MyGPT(llm.GPTModel):
        @property
        def training_loss_reduction(self):
            return numerical_loss_reduction(MaskedTokenLossReduction)()

The model's config carries the settings (numerical_loss, del_alpha, ... as on a Megatron-Bridge
provider); call del_megatron.megatron.register() before training.
"""

from __future__ import annotations

from .telemetry import digit_reduced, find, report_entries


def numerical_loss_reduction(reduction_cls: type) -> type:
    """Subclass of a NeMo MegatronLossReduction whose forward applies the "digit" reduction (in
    the per-token losses, so NeMo's own masked mean/sum stays as it is) and returns the DEL
    telemetry under "del_telemetry" ([sum, count] pairs) beside NeMo's own entries."""

    class NumericalLossReduction(reduction_cls):
        def forward(self, batch, forward_out):
            rec = find(forward_out)
            if rec is None:
                return super().forward(batch, forward_out)
            loss_mask = batch["loss_mask"]
            loss, reduced = super().forward(batch, digit_reduced(loss_mask, rec))
            return loss, {**reduced, "del_telemetry": report_entries(loss_mask, rec)}

    NumericalLossReduction.__name__ = f"Numerical{reduction_cls.__name__}"
    NumericalLossReduction.__qualname__ = NumericalLossReduction.__name__
    return NumericalLossReduction
