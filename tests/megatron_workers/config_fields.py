"""register(None) reads the model config's fields; Megatron's fused cross-entropy modes are
replaced or refused."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.distributed as dist

from del_megatron import megatron as dmm

from ..gpt_helpers import build_gpt, number_batch
from .config import CFG


@contextlib.contextmanager
def captured_log():
    """The del_megatron log records (INFO and up) made inside the block."""
    records, handler, logger = [], logging.Handler(), logging.getLogger("del_megatron")
    handler.emit = lambda record: records.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _fused_gpt(tp: int, impl: str):
    """build_gpt with cross_entropy_loss_fusion and `impl` (set after the config is made: core
    0.19's TransformerConfig refuses 'te' itself)."""
    model = build_gpt(tp, config_kwargs=dict(cross_entropy_loss_fusion=True))
    model.config.cross_entropy_fusion_impl = impl
    return model


def check_config_fields_and_fusion_modes(tp: int) -> None:
    """cfg=None reads the model config's fields; a model config without them keeps Megatron's
    loss; fused 'native'/'te' are replaced (logged once a registration, saying what replaces
    them and, for TE's in-place kernel, at what memory); any other impl is refused the first
    time the hook sees the model."""
    tokens, labels, positions = number_batch(2, seed=4)
    model = build_gpt(tp)
    megatron_loss = model(tokens, positions, None, labels=labels)
    dmm.register()
    try:
        torch.testing.assert_close(model(tokens, positions, None, labels=labels), megatron_loss)
        for name, value in CFG.to_fields().items():
            setattr(model.config, name, value)
        from_fields = model(tokens, positions, None, labels=labels)
    finally:
        dmm.unregister()
    said = {}
    for impl in ("native", "te"):
        dmm.register(CFG)
        try:
            torch.testing.assert_close(from_fields, model(tokens, positions, None, labels=labels))
            with captured_log() as records:
                for _ in range(2):
                    fused = _fused_gpt(tp, impl)
                    loss = fused(tokens, positions, None, labels=labels)
                    torch.testing.assert_close(loss, from_fields)
        finally:
            dmm.unregister()
        said[impl] = [r for r in records if "fused cross-entropy" in r]
        assert len(said[impl]) == (1 if dist.get_rank() == 0 else 0), said[impl]
    if dist.get_rank() == 0:
        assert "impl 'native'" in said["native"][0], said
        assert "Transformer Engine" in said["te"][0], said
        assert "one more [s, b, V/tp] buffer than TE's" in said["te"][0], said
        assert not any("same passes" in line for lines in said.values() for line in lines)
    dmm.register(CFG)
    try:
        with pytest.raises(ValueError, match="cross_entropy_fusion_impl='linear'"):
            _fused_gpt(tp, "linear")(tokens, positions, None, labels=labels)
    finally:
        dmm.unregister()


@contextlib.contextmanager
def cross_entropy_cached_at_build():
    """Megatron-LM #6766's shape on this core: LanguageModule.compute_language_model_loss calls
    the cross-entropy its __init__ cached on the model (`self.vocab_parallel_cross_entropy`).
    Yields the calls made to the cached function."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule

    calls = []

    def chosen_at_build(logits, labels):
        calls.append(1)
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)

    def compute_language_model_loss(self, labels, logits):  # the #6766 body
        labels = labels.transpose(0, 1).contiguous()
        loss = self.vocab_parallel_cross_entropy(logits.float(), labels)
        return loss.transpose(0, 1).contiguous()

    before = LanguageModule.compute_language_model_loss
    LanguageModule.compute_language_model_loss = compute_language_model_loss
    try:
        yield calls, chosen_at_build
    finally:
        LanguageModule.compute_language_model_loss = before


def check_a_cross_entropy_cached_at_build_is_replaced(tp: int) -> None:
    """Under #6766's shape the hook still decides the loss, for a model built before register()
    and one built after, never calling the cached function; the startup line names the cached
    function (not TE's kernel, which #6766 never picks); unregister() gives the model its own
    cross-entropy back."""
    tokens, labels, positions = number_batch(2, seed=4)
    with cross_entropy_cached_at_build() as (calls, chosen):

        def built():
            model = _fused_gpt(tp, "te")
            model.vocab_parallel_cross_entropy = chosen  # as #6766's __init__ does
            return model

        early = built()
        stock = early(tokens, positions, None, labels=labels)
        assert len(calls) == 1
        dmm.register(CFG)
        try:
            with captured_log() as records:
                ours = early(tokens, positions, None, labels=labels)
                late = built()(tokens, positions, None, labels=labels)
        finally:
            dmm.unregister()
        assert len(calls) == 1  # the cached function was never reached under the hook
        reference = build_gpt(tp)
        reference.load_state_dict(early.state_dict())
        dmm.register(CFG)
        try:
            want = reference(tokens, positions, None, labels=labels)
        finally:
            dmm.unregister()
        torch.testing.assert_close(ours, want)
        torch.testing.assert_close(late, want)
        assert not torch.allclose(ours, stock)  # teeth: DEL differs from plain CE
        torch.testing.assert_close(early(tokens, positions, None, labels=labels), stock)
        assert len(calls) == 2
    said = [r for r in records if "replaced by" in r]
    if dist.get_rank() == 0:
        assert len(said) == 1 and "chosen_at_build" in said[0], records
        assert "Transformer Engine" not in said[0] and "impl setting 'te'" in said[0], said
