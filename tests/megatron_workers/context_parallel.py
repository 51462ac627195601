"""The hook under context parallelism: the CP group, and hybrid CP's per-micro-batch groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron import megatron as dmm

from ..gpt_helpers import batch_on_this_cp_rank, build_gpt, number_batch
from .config import CFG


def check_hook_passes_the_cp_group() -> None:
    """Under context parallelism (parallel_state CP = world size) the hook weighs the local
    chunks' digits as in the whole sequence: it equals numerical_lm_loss(cp_group=...). (The
    model runs with its local attention, which knows no CP; only the loss seam is checked.)"""
    from megatron.core import parallel_state

    tokens, labels, positions = number_batch(2, seed=11)
    # Megatron's RoPE slices its table for CP with pinned memory, which needs CUDA.
    model = build_gpt(1, position_embedding_type="learned_absolute")
    cp_group = parallel_state.get_context_parallel_group()
    local = batch_on_this_cp_rank(
        {"tokens": tokens, "labels": labels, "position_ids": positions}, cp_group
    )
    args = (local["tokens"], local["position_ids"], None)
    logits = model(*args).transpose(0, 1).detach()
    dmm.register(CFG)
    try:
        hooked = model(*args, labels=local["labels"])
    finally:
        dmm.unregister()
    expected = dm.numerical_lm_loss(
        local["labels"], logits, CFG, dm.VocabParallelLayout(cp_group=cp_group)
    )
    torch.testing.assert_close(hooked, expected, rtol=1e-6, atol=1e-6)
    unsplit = dm.numerical_lm_loss(local["labels"], logits, CFG)
    assert not torch.allclose(hooked, unsplit)
    _check_hybrid_cp_split(model, tokens, labels, cp_group)


def _check_hybrid_cp_split(model, tokens, labels, cp_group) -> None:
    """Hybrid context parallelism (core 0.19: PackedSeqParams.local_cp_size and cp_group per
    micro-batch): the hook takes the micro-batch's group and cuts the whole packed sequence in
    2 * local_cp_size chunks ("sequence" balancing); with local_cp_size 1 the micro-batch is
    whole on this rank (no CP, whatever parallel_state's CP group); a local_cp_size without its
    group is refused. A registration's cp_balancing="sequence" cuts a packed micro-batch without
    local_cp_size the same way over the model's CP group."""
    import types

    from del_megatron.megatron import capture
    from del_megatron.sequence import cp_positions

    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    cu = torch.tensor([0, 8, 20, labels.size(1)], dtype=torch.int32)  # one packed row
    whole, local_len = labels[:1], labels.size(1) // cp
    positions = cp_positions(local_len, cp, rank, cu, "sequence")
    gen = torch.Generator().manual_seed(rank)
    logits = torch.randn(local_len, 1, model.vocab_size, generator=gen)
    whole_logits = torch.randn(whole.size(1), 1, model.vocab_size, generator=gen)

    def hooked(labels, logits, local_cp_size, group):
        params = types.SimpleNamespace(
            qkv_format="thd", cu_seqlens_q=cu, local_cp_size=local_cp_size, cp_group=group
        )
        token = capture._packed_seq_params.set(params)
        try:
            return model.compute_language_model_loss(labels, logits)
        finally:
            capture._packed_seq_params.reset(token)

    dmm.register(CFG)
    try:
        got = hooked(whole[:, positions], logits, cp, cp_group)
        by_sequence = dm.numerical_lm_loss(
            whole[:, positions], logits, CFG,
            dm.VocabParallelLayout(cp_group=cp_group, cu_seqlens=cu, cp_balancing="sequence"),
        )  # fmt: skip
        torch.testing.assert_close(got, by_sequence, rtol=0, atol=0)
        by_document = dm.numerical_lm_loss(
            whole[:, positions],
            logits,
            CFG,
            dm.VocabParallelLayout(cp_group=cp_group, cu_seqlens=cu),
        )
        assert not torch.allclose(got, by_document)
        alone = hooked(whole, whole_logits, 1, None)
        want = dm.numerical_lm_loss(whole, whole_logits, CFG, dm.VocabParallelLayout(cu_seqlens=cu))
        torch.testing.assert_close(alone, want, rtol=0, atol=0)
        with pytest.raises(ValueError, match="local_cp_size is 2 but its cp_group is missing"):
            hooked(whole[:, positions], logits, 2, None)
    finally:
        dmm.unregister()
    # Megatron-LM core 0.19's --dataloader-inter-document-masking (without --sft) cuts the whole
    # packed sequence over parallel_state's CP group; lm.register_from_args says so at register.
    dmm.register(CFG, cp_balancing="sequence")
    try:
        got = hooked(whole[:, positions], logits, None, None)
        torch.testing.assert_close(got, by_sequence, rtol=0, atol=0)
    finally:
        dmm.unregister()
