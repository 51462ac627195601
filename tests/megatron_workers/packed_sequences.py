"""Packed sequences: every model class taking packed_seq_params shows them to the hook."""

from __future__ import annotations

import torch

from del_megatron import megatron as dmm

from ..gpt_helpers import build_gpt, number_batch
from .config import CFG


def check_packed_seq_params_reach_the_hook() -> None:
    """GPTModel.forward, wrapped by register(), shows the call's packed_seq_params (keyword or
    positional) to the loss hook: THD cu_seqlens (padded ones first), nothing for other
    formats and after the call."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from del_megatron.megatron import capture

    seen = []

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input=None,
        labels=None,
        inference_context=None,
        packed_seq_params=None,
    ):
        seen.append(capture.cu_seqlens())

    wrapped = capture._capturing(forward, lambda module, arguments, kwargs, takes: kwargs)
    cu, padded = torch.tensor([0, 3, 8]), torch.tensor([0, 4, 8])
    wrapped(None, 1, 2, 3, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu))
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=padded)
    wrapped(None, 1, 2, 3, None, None, None, thd)
    wrapped(None, 1, 2, 3, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    wrapped(None, 1, 2, 3)
    assert seen[0] is cu and seen[1] is padded and seen[2:] == [None, None]
    assert capture.cu_seqlens() is None


def check_model_classes_taking_packed_seq_params() -> None:
    """register() wraps the forward of every LanguageModule class that takes packed_seq_params
    (not only GPTModel's) and unregister() restores it; a class defined after register() whose
    loss would run without its document boundaries is refused, naming the class."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.packed_seq_params import PackedSeqParams

    from del_megatron.megatron import capture

    model = build_gpt(1)
    tokens, labels, positions = number_batch(1, seed=3)  # THD packs documents in one row
    seen = []

    class EarlyModel(LanguageModule):  # a hybrid-style model: computes its own loss
        def __init__(self, config, head):
            super().__init__(config)
            self.head, self.vocab_size = head, head.vocab_size

        def forward(self, input_ids, labels, packed_seq_params=None):
            seen.append(capture.cu_seqlens())
            logits = self.head(input_ids, positions, None).transpose(0, 1)
            return self.compute_language_model_loss(labels, logits.contiguous())

    original = EarlyModel.forward
    dmm.register(CFG)
    try:
        assert EarlyModel.forward is not original
        early = EarlyModel(model.config, model)
        cu = torch.tensor([0, 5, tokens.size(1)])
        thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu)
        early(tokens, labels, packed_seq_params=thd)
        assert seen == [cu]

        class LateModel(EarlyModel):
            def forward(self, input_ids, labels, packed_seq_params=None):
                logits = self.head(input_ids, positions, None).transpose(0, 1)
                return self.compute_language_model_loss(labels, logits.contiguous())

        try:
            LateModel(model.config, model)(tokens, labels)
        except RuntimeError as exc:
            assert "LateModel.forward takes packed_seq_params" in str(exc), exc
        else:
            raise AssertionError("a model class defined after register() was not refused")
    finally:
        dmm.unregister()
    assert EarlyModel.forward is original
