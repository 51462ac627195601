"""Bodies of the step-accounting tests: one global batch, cut into 1, 2 or 4 micro-batches over
DP = 1 or 2 ranks, trained through Megatron's own schedule, gives the gradients of the exact
"digit" reduction over the whole batch."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

import del_megatron as dm
import del_megatron.megatron as dmm

from .gpt_helpers import GPT_VOCAB, SPACE, build_gpt, number_batch

GLOBAL_BATCH = 8
CFG = dm.NumericalLossConfig(loss="del", alpha=0.5, vocab=GPT_VOCAB, reduction="digit")


def global_batch(seed: int):
    """(tokens, labels, positions) [8, s]: sums text, with digits blanked out of the first half
    of rows 1, 2 and 6, so that micro-batches differ in their share of digit targets."""
    tokens, labels, positions = number_batch(GLOBAL_BATCH, seed)
    labels = labels.clone()
    labels[[1, 2, 6], : labels.size(1) // 2] = SPACE
    return tokens, labels, positions


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def reference(seed: int):
    """(loss, grads) of the whole global batch on one rank: mean CE + alpha * sum(term) / digits."""
    model = build_gpt(1)
    tokens, labels, positions = global_batch(seed)
    logits = model(tokens, positions, None)  # [b, s, V]
    parts = dm.numerical_lm_loss(labels, logits.transpose(0, 1), CFG, return_parts=True)
    loss = parts.ce.mean() + CFG.alpha * parts.term.sum() / parts.is_digit.sum()
    loss.backward()
    return loss.detach(), _grads(model)


def _finalize(per_token: bool):
    """Megatron's finalize_model_grads for plain DP on CPU: gradients summed over DP; then
    divided by the step's global token count (calculate_per_token_loss) or averaged."""
    group = dist.group.WORLD

    def finalize(models, num_tokens, **kwargs):
        world = dist.get_world_size(group)
        if num_tokens is not None:
            dist.all_reduce(num_tokens, group=group)
        for param in models[0].parameters():
            if param.grad is None:
                continue
            dist.all_reduce(param.grad, group=group)
            param.grad /= float(num_tokens) if num_tokens is not None else world

    return finalize


def _schedule(forward_step, data, model, microbatches: int, seq: int, size: int):
    """One training step through Megatron's schedule; its per-micro-batch reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=microbatches,
        seq_length=seq,
        micro_batch_size=size,
    )


def megatron_step(seed: int, microbatches: int, per_token: bool, accounting: bool):
    """(reported loss, grads) of one step through Megatron's schedule on this DP rank's share."""

    dp, rank = dist.get_world_size(), dist.get_rank()
    model = build_gpt(1, config_kwargs={"calculate_per_token_loss": per_token})
    model.config.finalize_model_grads_func = _finalize(per_token)
    tokens, labels, positions = global_batch(seed)
    share = GLOBAL_BATCH // dp
    size = share // microbatches
    mine = slice(rank * share, (rank + 1) * share)
    batches = [
        tuple(t[mine][i * size : (i + 1) * size] for t in (tokens, labels, positions))
        for i in range(microbatches)
    ]

    def forward_step(data_iterator, model):
        tokens, labels, positions = next(data_iterator)
        output = model(tokens, positions, None, labels=labels)
        return output, partial(dmm.numerical_loss_func, torch.ones_like(labels, dtype=torch.float))

    step = dmm.DigitAccounting(
        GPT_VOCAB,
        microbatches,
        group=dist.group.WORLD,
        per_token_loss=per_token,
        labels_and_mask=lambda batch: (batch[1], None),
    )
    data = step.wrap(iter(batches)) if accounting else iter(batches)
    dmm.register(CFG)
    try:
        with step if accounting else _nothing():
            reports = _schedule(forward_step, data, model, microbatches, tokens.size(1), size)
    finally:
        dmm.unregister()
    summed = torch.stack([r["lm loss"] for r in reports]).sum(0)
    dist.all_reduce(summed)
    return summed[0] / summed[1], _grads(model)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def check_cut_independence(seed: int, per_token: bool) -> None:
    """Every cut of the global batch (micro-batches x DP ranks) gives the whole-batch loss and
    gradients."""
    dp = dist.get_world_size()
    ref_loss, ref_grads = reference(seed)
    scale = ref_grads.abs().max()
    for microbatches in (1, 2, 4) if dp == 1 else (1, 2):
        loss, grads = megatron_step(seed, microbatches, per_token, accounting=True)
        what = f"dp {dp} micro-batches {microbatches} per_token_loss {per_token}"
        torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0, msg=what)
        torch.testing.assert_close(grads, ref_grads, rtol=0, atol=2e-6 * scale, msg=what)


def check_without_accounting_the_cut_shows(seed: int) -> None:
    """Teeth for check_cut_independence: a per-micro-batch digit reduction depends on the cut."""
    dp = dist.get_world_size()
    ref_grads = reference(seed)[1]
    _, grads = megatron_step(seed, 4 // dp, True, accounting=False)
    gap = ((grads - ref_grads).abs().max() / ref_grads.abs().max()).item()
    assert gap > 1e-4, gap


def check_count_needs_a_wrapped_iterator() -> None:
    step = dmm.DigitAccounting(GPT_VOCAB, 2)
    try:
        step.term_scale(torch.tensor(3.0))
    except RuntimeError as exc:
        assert "accounting.wrap" in str(exc), exc
    else:
        raise AssertionError("term_scale without counts was not refused")


def check_megatron_lm_glue(seed: int, per_token: bool) -> None:
    """Megatron-LM's layout at TP = world size: only tensor-parallel rank 0 holds a data
    iterator (its get_batch broadcasts the batch); lm.counted() counts the step there and the
    other rank receives the counts. Reported loss and the (replicated) final-norm gradient equal
    the whole-batch reference (calculate_per_token_loss on or off: `per_token`)."""
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from del_megatron.megatron import accounting, lm

    tp, rank = dist.get_world_size(), dist.get_rank()
    # The reference: the same TP model, the whole batch in one pass of numerical_lm_loss.
    ref_model = build_gpt(tp)
    tokens, labels, positions = global_batch(seed)
    logits = ref_model(tokens, positions, None)  # [b, s, V/tp]
    parts = dm.numerical_lm_loss(
        labels, logits.transpose(0, 1), CFG, ps.get_tensor_model_parallel_group(), True
    )
    ref_loss = parts.ce.mean() + CFG.alpha * parts.term.sum() / parts.is_digit.sum()
    ref_loss.backward()
    ref_norm_grad = ref_model.decoder.final_layernorm.weight.grad

    microbatches, size = 4, GLOBAL_BATCH // 4
    init_num_microbatches_calculator(rank, None, GLOBAL_BATCH, size, 1)
    try:
        model = build_gpt(tp, config_kwargs={"calculate_per_token_loss": per_token})
        batches = [
            {
                "tokens": tokens[i * size : (i + 1) * size],
                "labels": labels[i * size : (i + 1) * size],
            }
            for i in range(microbatches)
        ]
        data = iter(batches) if ps.get_tensor_model_parallel_rank() == 0 else None

        def forward_step(data_iterator, model):
            data_iterator = lm.counted(data_iterator, model)
            batch = next(data_iterator) if data_iterator is not None else None
            shape = (size, tokens.size(1))
            received = [torch.empty(shape, dtype=torch.long) for _ in range(2)]
            if batch is not None:
                received = [batch["tokens"].clone(), batch["labels"].clone()]
            for t in received:
                dist.broadcast(t, src=ps.get_tensor_model_parallel_src_rank())
            output = model(received[0], positions[:size], None, labels=received[1])
            mask = torch.ones(shape)
            return output, partial(dmm.numerical_loss_func, mask)

        args = types.SimpleNamespace(
            numerical_loss="del",
            calculate_per_token_loss=per_token,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=size,
            data_parallel_size=1,
        )
        # As Megatron-LM's registration does: the step accounting is made on first use.
        dmm.register(CFG, step_accounting=partial(lm.step_accounting, CFG, args))
        try:
            assert accounting.active() is None
            reports = _schedule(forward_step, data, model, microbatches, tokens.size(1), size)
            assert accounting.active() is not None
        finally:
            dmm.unregister()
        assert accounting.active() is None
        summed = torch.stack([r["lm loss"] for r in reports]).sum(0)
        what = f"tp rank {rank} per_token_loss {per_token}"
        torch.testing.assert_close(
            summed[0] / summed[1], ref_loss.detach(), rtol=2e-6, atol=0, msg=what
        )
        # No finalize_model_grads here: per-token gradients are still sums over tokens.
        norm_grad = model.decoder.final_layernorm.weight.grad
        scale = float(summed[1]) if per_token else 1.0
        torch.testing.assert_close(
            norm_grad / scale,
            ref_norm_grad,
            rtol=0,
            atol=2e-6 * ref_norm_grad.abs().max(),
            msg=what,
        )
    finally:
        destroy_num_microbatches_calculator()


def _whole_batch_reference(model, tokens, labels, positions, tp_group):
    """Mean CE + alpha * sum(term) / digits over the whole batch, from `model`'s logits."""
    logits = model(tokens, positions, None)  # [b, s, V/tp]
    parts = dm.numerical_lm_loss(labels, logits.transpose(0, 1), CFG, tp_group, True)
    return parts.ce.mean() + CFG.alpha * parts.term.sum() / parts.is_digit.sum()


def _lm_step(model, batches, size: int, forward_only: bool = False) -> torch.Tensor:
    """One Megatron-LM-style step (data on tensor-parallel rank 0 of each DP rank, lm.counted,
    the batch broadcast over TP) through Megatron's schedule: the logged lm loss, sum / count
    over the micro-batches and the DP ranks."""
    from megatron.core import parallel_state as ps

    from del_megatron.megatron import lm

    data = iter(batches) if ps.get_tensor_model_parallel_rank() == 0 else None
    seq = batches[0]["tokens"].size(1)

    def forward_step(data_iterator, model):
        data_iterator = lm.counted(data_iterator, model)
        batch = next(data_iterator) if data_iterator is not None else None
        received = [torch.empty((size, seq), dtype=torch.long) for _ in range(2)]
        if batch is not None:
            received = [batch["tokens"].clone(), batch["labels"].clone()]
        for t in received:
            dist.broadcast(
                t, src=ps.get_tensor_model_parallel_src_rank(),
                group=ps.get_tensor_model_parallel_group(),
            )  # fmt: skip
        positions = torch.arange(seq).expand(size, seq)
        output = model(received[0], positions, None, labels=received[1])
        return output, partial(dmm.numerical_loss_func, torch.ones((size, seq)))

    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq,
        micro_batch_size=size,
        forward_only=forward_only,
    )
    summed = torch.stack([r["lm loss"] for r in reports]).sum(0)
    dist.all_reduce(summed, group=ps.get_data_parallel_group())
    return summed[0] / summed[1]


def _dict_batches(tokens, labels, rows: slice, size: int):
    tokens, labels = tokens[rows], labels[rows]
    return [
        {"tokens": tokens[i : i + size], "labels": labels[i : i + size]}
        for i in range(0, tokens.size(0), size)
    ]


def check_evaluation_counts_its_own_micro_batches(seed: int) -> None:
    """An evaluation step with its own micro-batch size (core 0.18+'s --eval-micro-batch-size and
    --eval-global-batch-size; or a batch-size ramp-up, where evaluation uses the final batch)
    runs a different number of micro-batches than a training step: lm.counted counts the
    evaluation iterator by the evaluation count, so the logged validation lm loss under the
    "digit" reduction is the whole evaluation batch's (DP 2, training: 2 micro-batches of 2
    rows a rank; evaluation: 4 of 1)."""
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from del_megatron.megatron import lm

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens, labels, positions = global_batch(seed)
    args = types.SimpleNamespace(
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=2,
        eval_global_batch_size=GLOBAL_BATCH,
        eval_micro_batch_size=1,
        data_parallel_size=dp,
        calculate_per_token_loss=False,
    )
    assert lm.eval_num_microbatches(args) == 4
    share = slice(rank * GLOBAL_BATCH // dp, (rank + 1) * GLOBAL_BATCH // dp)
    init_num_microbatches_calculator(dist.get_rank(), None, GLOBAL_BATCH, 2, dp)
    try:
        model = build_gpt(1)
        dmm.register(CFG, step_accounting=partial(lm.step_accounting, CFG, args))
        try:
            model.train()
            _lm_step(model, _dict_batches(tokens, labels, share, 2), 2)
            model.eval()
            with torch.no_grad():
                got = _lm_step(model, _dict_batches(tokens, labels, share, 1), 1, True)
        finally:
            dmm.unregister()
    finally:
        destroy_num_microbatches_calculator()
    with torch.no_grad():  # the weights are unchanged: no optimizer steps here
        want = _whole_batch_reference(model, tokens, labels, positions, None)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)


def check_the_accounting_follows_new_process_groups(seed: int) -> None:
    """An in-process restart (NVRx) destroys the process groups and makes new ones, then trains
    again in the same process with the same registration: the step accounting made on the old
    groups is made again on the new ones (checked when the new model and iterators arrive), so
    the "digit" reduction still gives the whole-batch loss. Real gloo groups, destroyed and
    re-made, at TP 2 (the counts are broadcast over the tensor-parallel group)."""
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from del_megatron.megatron import accounting, lm

    tp = dist.get_world_size()
    tokens, labels, positions = global_batch(seed)
    args = types.SimpleNamespace(
        global_batch_size=GLOBAL_BATCH, micro_batch_size=2, data_parallel_size=1
    )
    init_num_microbatches_calculator(dist.get_rank(), None, GLOBAL_BATCH, 2, 1)
    dmm.register(CFG, step_accounting=partial(lm.step_accounting, CFG, args))
    try:
        losses, made = [], []
        for attempt in range(2):
            if attempt:  # the restart: Megatron's groups destroyed, new ones made
                old = {id(g): g for g in lm.process_groups()}
                ps.destroy_model_parallel()
                for group in old.values():
                    dist.destroy_process_group(group)
                ps.initialize_model_parallel(tensor_model_parallel_size=tp)
            model = build_gpt(tp)  # pretrain() builds the model again
            with torch.no_grad():
                want = _whole_batch_reference(
                    model, tokens, labels, positions, ps.get_tensor_model_parallel_group()
                )
            losses.append((_lm_step(model, _dict_batches(tokens, labels, slice(None), 2), 2), want))
            made.append(accounting.active())
    finally:
        dmm.unregister()
        destroy_num_microbatches_calculator()
    assert made[0] is not made[1]
    assert made[1].share_group is ps.get_tensor_model_parallel_group()
    for got, want in losses:
        torch.testing.assert_close(got, want.detach(), rtol=2e-6, atol=0)
