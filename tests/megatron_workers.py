"""Bodies of the Megatron-Core integration tests; each runs on every rank of a gloo group."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron import cpu
from del_megatron import megatron as dmm
from del_megatron.kernels.linear import resolve_weight_gradient

from .cases import TOKEN_FORM
from .gpt_helpers import GPT_VOCAB, batch_on_this_cp_rank, build_gpt, number_batch
from .linear_workers import CountedChunks

CFG = dm.NumericalLossConfig(loss="del", alpha=0.5, vocab=GPT_VOCAB, **TOKEN_FORM)


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def check_hook_equals_numerical_lm_loss(tp: int) -> None:
    """The registered model's per-token loss equals numerical_lm_loss on its own logits."""
    tokens, labels, positions = number_batch(2, seed=0)
    for sp in (False, True) if tp > 1 else (False,):
        model = build_gpt(tp, sequence_parallel=sp)
        dmm.register(CFG)
        try:
            loss = model(tokens, positions, None, labels=labels)
            logits = model(tokens, positions, None).transpose(0, 1)  # [s, b, V/tp]
            assert logits.size(-1) * tp == model.vocab_size
            expected = dm.numerical_lm_loss(labels, logits, CFG, tp_group=_tp_group())
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
            parts = dm.numerical_lm_loss(labels, logits, CFG, _tp_group(), return_parts=True)
            assert parts.is_digit.sum() > 10 and (parts.term > 0).sum() > 10
        finally:
            dmm.unregister()


def check_parallel_output_false(tp: int) -> None:
    """Gathered logits (parallel_output=False) are recognised: same loss as sharded ones."""
    tokens, labels, positions = number_batch(2, seed=1)
    dmm.register(CFG)
    try:
        sharded = build_gpt(tp)(tokens, positions, None, labels=labels)
        gathered = build_gpt(tp, parallel_output=False)(tokens, positions, None, labels=labels)
    finally:
        dmm.unregister()
    torch.testing.assert_close(gathered, sharded, rtol=1e-6, atol=1e-6)


def train_curve(tp: int, sp: bool, steps: int, out_path: str, loss: str = "del") -> None:
    """`steps` Adam steps on number batches; rank 0 writes the mean-loss curve as JSON."""
    model = build_gpt(tp, sequence_parallel=sp)
    cfg = dm.NumericalLossConfig(loss=loss, alpha=0.5, vocab=GPT_VOCAB, **TOKEN_FORM)
    dmm.register(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    curve = []
    try:
        for step in range(steps):
            tokens, labels, positions = number_batch(4, seed=100 + step)
            optimizer.zero_grad()
            per_token = model(tokens, positions, None, labels=labels)
            mean = per_token.mean()
            mean.backward()
            cpu.sync_sequence_parallel_grads(model)
            optimizer.step()
            curve.append(mean.item())
    finally:
        dmm.unregister()
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(curve, fh)


def check_mtp_goes_through_del(tp: int) -> None:
    """With MTP, the MTP head's loss is computed by the hook too: its parameters' gradients
    change when the loss changes from 'ce' to 'del' (they see no other loss)."""
    tokens, labels, positions = number_batch(2, seed=2)
    grads = {}
    for loss in ("ce", "del"):
        model = build_gpt(tp, mtp_layers=1)
        model.train()
        dmm.register(dm.NumericalLossConfig(loss=loss, alpha=0.5, vocab=GPT_VOCAB, **TOKEN_FORM))
        try:
            out = model(tokens, positions, None, labels=labels)
            out.mean().backward()
        finally:
            dmm.unregister()
        grads[loss] = {n: p.grad.clone() for n, p in model.named_parameters() if "mtp" in n}
    assert grads["ce"], "model has no MTP parameters"
    differ = [n for n in grads["ce"] if not torch.allclose(grads["ce"][n], grads["del"][n])]
    assert differ, "MTP gradients do not depend on the numerical loss"


def _logits_and_their_gradients(model, args, labels, upstream, cfg=CFG):
    """One forward/backward of `model` with the hook registered: the loss, every parameter's
    gradient, and for each call of the output layer its logits and (data_ptr, copy) of the
    gradient autograd handed them."""
    calls = []
    layer_forward = model.output_layer.forward

    def capturing(*a, **kw):
        logits, bias = layer_forward(*a, **kw)
        call = {"logits": logits}
        logits.register_hook(lambda grad: call.update(grad=(grad.data_ptr(), grad.clone())))
        calls.append(call)
        return logits, bias

    model.output_layer.forward = capturing
    dmm.register(cfg)
    try:
        loss = model(*args, labels=labels)
        (loss * upstream).sum().backward()
    finally:
        dmm.unregister()
        model.output_layer.forward = layer_forward
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, calls


def _in_place(call) -> bool:
    return call["grad"][0] == call["logits"].data_ptr()


def check_fp32_logits_take_their_gradient_in_place(tp: int) -> None:
    """Audit G5: the main head's fp32 logits (an fp32 run; Megatron-LM dev's
    --output-logit-dtype fp32) get their gradient written over them, one [s, b, V/tp] fp32
    buffer as in Megatron's own cross-entropy, not a second one; loss, logits' gradient and
    every parameter's gradient equal the loss's without inplace. Logits something else reads
    after the loss keep theirs: an MTP head's (Megatron counts its accepted tokens from them),
    and any under a forward hook of the output layer (distillation's logit capture)."""
    from del_megatron.megatron import hook

    tokens, labels, positions = number_batch(2, seed=41)
    args, upstream = (tokens, positions, None), torch.rand(labels.shape)
    ours = _logits_and_their_gradients(build_gpt(tp), args, labels, upstream)
    spent = getattr(hook, "_logits_spent_by_the_loss", None)
    hook._logits_spent_by_the_loss = lambda *a: False
    try:
        want = _logits_and_their_gradients(build_gpt(tp), args, labels, upstream)
    finally:
        if spent is None:
            del hook._logits_spent_by_the_loss
        else:
            hook._logits_spent_by_the_loss = spent
    assert [_in_place(c) for c in ours[2]] == [True], "main head's gradient not in place"
    assert [_in_place(c) for c in want[2]] == [False]
    torch.testing.assert_close(ours[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[2][0]["grad"][1], want[2][0]["grad"][1], rtol=1e-6, atol=1e-7)
    assert ours[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # MTP: one call of the output layer for the MTP head, then the main head's
    mtp = _logits_and_their_gradients(build_gpt(tp, mtp_layers=1), args, labels, upstream)
    assert [_in_place(c) for c in mtp[2]] == [False, True], "MTP logits overwritten"
    model = build_gpt(tp)
    captured = []
    model.output_layer.register_forward_hook(lambda module, i, out: captured.append(out[0]))
    hooked = _logits_and_their_gradients(model, args, labels, upstream)
    assert [_in_place(c) for c in hooked[2]] == [False], "logits a forward hook holds overwritten"
    torch.testing.assert_close(hooked[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(captured[0], want[2][0]["logits"], rtol=0, atol=0)


def check_register_cycle(tp: int) -> None:
    """register / unregister / register: the original method comes back exactly, and the
    loss is Megatron's own after unregister and ours after register again."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt import GPTModel

    original = LanguageModule.compute_language_model_loss
    original_forward = GPTModel.forward
    tokens, labels, positions = number_batch(2, seed=3)
    model = build_gpt(tp)
    megatron_loss = model(tokens, positions, None, labels=labels)
    dmm.register(CFG)
    dmm.register(CFG)  # idempotent
    assert dmm.is_registered()
    ours = model(tokens, positions, None, labels=labels)
    dmm.unregister()
    assert LanguageModule.compute_language_model_loss is original and not dmm.is_registered()
    assert GPTModel.forward is original_forward
    torch.testing.assert_close(model(tokens, positions, None, labels=labels), megatron_loss)
    dmm.register(CFG)
    again = model(tokens, positions, None, labels=labels)
    dmm.unregister()
    dmm.unregister()  # idempotent
    torch.testing.assert_close(again, ours)
    assert not torch.allclose(ours, megatron_loss)
    # loss="ce" through the hook equals Megatron's own CE
    dmm.register(dm.NumericalLossConfig(loss="ce"))
    try:
        torch.testing.assert_close(
            model(tokens, positions, None, labels=labels), megatron_loss, rtol=1e-6, atol=1e-6
        )
    finally:
        dmm.unregister()


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
        for name, value in dmm.config_fields(CFG).items():
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
    expected = dm.numerical_lm_loss(local["labels"], logits, CFG, cp_group=cp_group)
    torch.testing.assert_close(hooked, expected, rtol=1e-6, atol=1e-6)
    unsplit = dm.numerical_lm_loss(local["labels"], logits, CFG)
    assert not torch.allclose(hooked, unsplit)
    _check_hybrid_cp_layout(model, tokens, labels, cp_group)


def _check_hybrid_cp_layout(model, tokens, labels, cp_group) -> None:
    """Hybrid context parallelism (core 0.19: PackedSeqParams.local_cp_size and cp_group per
    micro-batch): the hook takes the micro-batch's group and cuts the whole packed sequence in
    2 * local_cp_size chunks ("sequence" balancing); with local_cp_size 1 the micro-batch is
    whole on this rank (no CP, whatever parallel_state's CP group); a local_cp_size without its
    group is refused. A registration's cp_balancing="sequence" cuts a packed micro-batch without
    local_cp_size the same way over the model's CP group."""
    import types

    from del_megatron.megatron import hook
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
        token = hook._packed_seq_params.set(params)
        try:
            return model.compute_language_model_loss(labels, logits)
        finally:
            hook._packed_seq_params.reset(token)

    dmm.register(CFG)
    try:
        got = hooked(whole[:, positions], logits, cp, cp_group)
        by_sequence = dm.numerical_lm_loss(
            whole[:, positions], logits, CFG, cp_group=cp_group, cu_seqlens=cu,
            cp_balancing="sequence",
        )  # fmt: skip
        torch.testing.assert_close(got, by_sequence, rtol=0, atol=0)
        by_document = dm.numerical_lm_loss(
            whole[:, positions], logits, CFG, cp_group=cp_group, cu_seqlens=cu
        )
        assert not torch.allclose(got, by_document)
        alone = hooked(whole, whole_logits, 1, None)
        want = dm.numerical_lm_loss(whole, whole_logits, CFG, cu_seqlens=cu)
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


def check_packed_seq_params_reach_the_hook() -> None:
    """GPTModel.forward, wrapped by register(), shows the call's packed_seq_params (keyword or
    positional) to the loss hook: THD cu_seqlens (padded ones first), nothing for other
    formats and after the call."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from del_megatron.megatron import hook

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
        seen.append(hook._cu_seqlens())

    wrapped = hook._capture_packed_seq_params(forward)
    cu, padded = torch.tensor([0, 3, 8]), torch.tensor([0, 4, 8])
    wrapped(None, 1, 2, 3, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu))
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=padded)
    wrapped(None, 1, 2, 3, None, None, None, thd)
    wrapped(None, 1, 2, 3, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    wrapped(None, 1, 2, 3)
    assert seen[0] is cu and seen[1] is padded and seen[2:] == [None, None]
    assert hook._cu_seqlens() is None


def check_model_classes_taking_packed_seq_params() -> None:
    """register() wraps the forward of every LanguageModule class that takes packed_seq_params
    (not only GPTModel's) and unregister() restores it; a class defined after register() whose
    loss would run without its document boundaries is refused, naming the class."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.packed_seq_params import PackedSeqParams

    from del_megatron.megatron import hook

    model = build_gpt(1)
    tokens, labels, positions = number_batch(1, seed=3)  # THD packs documents in one row
    seen = []

    class EarlyModel(LanguageModule):  # a hybrid-style model: computes its own loss
        def __init__(self, config, head):
            super().__init__(config)
            self.head, self.vocab_size = head, head.vocab_size

        def forward(self, input_ids, labels, packed_seq_params=None):
            seen.append(hook._cu_seqlens())
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


def _stage_models(pp_size: int, vp_size: int, num_layers: int):
    """This pipeline rank's model chunks (one per virtual stage) with the weights of the
    single-stage model (same seed): each layer takes the weights of its global layer_number."""
    from megatron.core import parallel_state

    full = build_gpt(1, config_kwargs={"num_layers": num_layers})
    source = full.state_dict()
    chunks = []
    for vp_stage in range(vp_size):
        extra = {"pipeline_model_parallel_size": pp_size, "num_layers": num_layers}
        kwargs = {}
        if vp_size > 1:
            extra["virtual_pipeline_model_parallel_size"] = vp_size
            # gloo's batch_isend_irecv pairs the interleaved schedule's sends and receives
            # across micro-batches (losses off by 0.1% at step 0); NCCL's does not.
            extra["batch_p2p_comm"] = False
            kwargs["vp_stage"] = vp_stage
        stage = build_gpt(
            1,
            config_kwargs=extra,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            **kwargs,
        )
        target = {}
        for name in stage.state_dict():
            if name.startswith("decoder.layers."):
                local, rest = name[len("decoder.layers.") :].split(".", 1)
                number = stage.decoder.layers[int(local)].layer_number
                name_in_full = f"decoder.layers.{number - 1}.{rest}"
            else:
                name_in_full = name
            target[name] = source[name_in_full]
        stage.load_state_dict(target)
        chunks.append(stage)
    return chunks


def pipeline_curve(steps: int, out_path: str, vp_size: int = 1) -> None:
    """Train a 4-layer GPT through Megatron's own schedules (PP = world size, vp_size virtual
    stages a rank: the interleaved schedule); the last stage writes its per-step reports. The
    loss seam must run on the last stage only."""
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from del_megatron.megatron import telemetry

    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = _stage_models(pp_size, vp_size, num_layers=4)
    dmm.register(CFG)
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=3e-3)
    calls = []

    def forward_step(data_iterator, model):
        tokens, labels, positions = next(data_iterator)
        output = model(tokens, positions, None, labels=labels)
        calls.append(telemetry.find(output) is not None)
        mask = torch.ones_like(labels, dtype=torch.float)
        return output, partial(dmm.numerical_loss_func, mask)

    reports = []
    try:
        for step in range(steps):
            batches = [number_batch(2, seed=1000 * step + i) for i in range(4)]
            optimizer.zero_grad()
            reduced = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(batches) for _ in chunks] if vp_size > 1 else iter(batches),
                model=chunks,
                num_microbatches=4,
                seq_length=batches[0][0].size(1),
                micro_batch_size=2,
            )
            optimizer.step()
            if reduced:
                summed = {k: sum(r[k] for r in reduced).tolist() for k in reduced[0]}
                reports.append(summed)
    finally:
        dmm.unregister()
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if vp_size == 1:
        assert all(calls) if last else not any(calls), (pp_rank, calls)
    else:  # the last rank's last virtual stage computes the loss, its first one does not
        assert sum(calls) == (steps * 4 if last else 0), (pp_rank, sum(calls), len(calls))
    assert bool(reports) == last
    if last:
        with open(out_path, "w") as fh:
            json.dump(reports, fh)


class _ToyDigitTokenizer:
    """Megatron-style tokenizer (tokenize/detokenize) of the helper's toy vocabulary."""

    def tokenize(self, text):
        ids = []
        for ch in text:
            if ch.isdigit():
                ids.append(GPT_VOCAB.digit_ids[int(ch)])
            elif ch == ".":
                ids.append(GPT_VOCAB.decimal_point_ids[0])
            else:
                ids.append(51 if ch == " " else 60 + ord(ch) % 20)
        return ids

    def detokenize(self, ids):
        table = {d: str(k) for k, d in enumerate(GPT_VOCAB.digit_ids)}
        table[GPT_VOCAB.decimal_point_ids[0]] = "."
        return "".join(table.get(i, " " if i == 51 else "x") for i in ids)


def _refused_by_this_core() -> bool:
    """True, after checking that register(logits_free=True) is refused with the minimum version
    named, on a core whose GPTModel has no output_processor (megatron-core < 0.18)."""
    from del_megatron.megatron.logits_free import core_supports

    if core_supports():
        return False
    try:
        dmm.register(CFG, logits_free=True)
    except ValueError as exc:
        assert "megatron-core >= 0.18" in str(exc), exc
        assert not dmm.is_registered()
        return True
    dmm.unregister()
    raise AssertionError("logits_free was accepted by a core without output_processor")


def _loss_and_grads(model, logits_free, args, labels, upstream, cfg=CFG, **kwargs):
    """Per-token loss, every parameter's gradient and the calls of the output layer's forward
    (logits formed) for one forward/backward with the hook registered."""
    calls = []
    layer_forward = model.output_layer.forward

    def counted(*a, **kw):
        calls.append(1)
        return layer_forward(*a, **kw)

    model.output_layer.forward = counted
    dmm.register(cfg, logits_free=logits_free)
    try:
        loss = model(*args, labels=labels, **kwargs)
        (loss * upstream).sum().backward()
        report = dmm.numerical_loss_func(torch.ones_like(labels, dtype=torch.float), loss)[2]
    finally:
        dmm.unregister()
        model.output_layer.forward = layer_forward
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(calls), report


def _assert_same_training_signal(ours, want, what: str) -> None:
    torch.testing.assert_close(ours[0], want[0], rtol=1e-5, atol=1e-5, msg=what)
    assert ours[1].keys() == want[1].keys(), what
    for name, grad in want[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-5, atol=1e-5, msg=f"{what} {name}")
    for key, value in want[3].items():
        torch.testing.assert_close(ours[3][key], value, rtol=1e-5, atol=1e-5, msg=f"{what} {key}")


def check_logits_free_equals_materialised(tp: int) -> None:
    """register(logits_free=True) on a real GPTModel: the output layer never forms logits for a
    call with labels, and loss, every parameter gradient and the telemetry equal the
    materialised path, with and without sequence parallelism and tied embeddings; MTP heads
    keep theirs; calls without labels still return logits. Cores without GPTModel's
    output_processor refuse it at register()."""
    if _refused_by_this_core():
        return
    tokens, labels, positions = number_batch(2, seed=21)
    upstream = torch.rand(labels.shape, generator=torch.Generator().manual_seed(21)) + 0.5
    layouts = [(False, False, None), (False, True, None), (False, False, 1)]
    if tp > 1:
        layouts += [(True, False, None), (True, True, 1)]
    for sp, tied, mtp in layouts:
        what = f"tp {tp} sp {sp} tied {tied} mtp {mtp}"
        build = dict(sequence_parallel=sp, mtp_layers=mtp)
        build["share_embeddings_and_output_weights"] = tied
        args = (tokens, positions, None)
        want = _loss_and_grads(build_gpt(tp, **build), False, args, labels, upstream)
        model = build_gpt(tp, **build)
        ours = _loss_and_grads(model, True, args, labels, upstream)
        _assert_same_training_signal(ours, want, what)
        assert want[2] == 1 + (mtp or 0) and ours[2] == (mtp or 0), f"{what}: logits formed"
        dmm.register(CFG, logits_free=True)
        try:
            logits = model(*args)  # no labels: Megatron's own output layer
        finally:
            dmm.unregister()
        assert logits.shape == (2, tokens.size(1), model.vocab_size // tp), what
    _check_logits_free_with_loss_mask(tp, tokens, labels, positions)


def _check_logits_free_with_loss_mask(tp: int, tokens, labels, positions) -> None:
    """GPTModel hands the processor loss_mask (pretrain_gpt passes it): with an upstream gradient
    proportional to it, as Megatron's loss_func gives, backward multiplies no token chunk out
    again; on the "backward" weight-gradient route, each vocab tile once."""
    mask = (torch.rand(labels.shape, generator=torch.Generator().manual_seed(23)) > 0.3).float()
    build = dict(sequence_parallel=tp > 1, share_embeddings_and_output_weights=True)
    args, upstream = (tokens, positions, None), mask / 7
    want = _loss_and_grads(build_gpt(tp, **build), False, args, labels, upstream, loss_mask=mask)
    for route in ("forward", "backward"):
        with CountedChunks() as counted:
            model = build_gpt(tp, **build)
            ours = _loss_and_grads(model, route, args, labels, upstream, loss_mask=mask)
        _assert_same_training_signal(ours, want, f"tp {tp} loss_mask {route}")
        # every token multiplied out once, in forward; never again in backward
        assert sum(counted.rows) == labels.numel() and len(counted.rows) > 1, counted.rows
        tiles = model.vocab_size // tp if route == "backward" else 0
        assert sum(counted.tiles) == tiles and len(counted.tiles) != 1, (route, counted.tiles)


def check_logits_free_refusals(tp: int) -> None:
    """A model config asking for logits-free on a model class without output_processor, an
    output layer with a bias, MuP's logit multiplier and an unknown weight-gradient route are
    refused with the fix named."""
    if _refused_by_this_core():
        return
    from del_megatron.megatron import logits_free as lf

    class NoProcessor:
        pass

    try:
        lf.check_model_supports(NoProcessor(), forward_takes_output_processor=False)
    except ValueError as exc:
        assert "NoProcessor.forward takes no output_processor" in str(exc), exc
    else:
        raise AssertionError("a forward without output_processor was accepted")
    tokens, labels, positions = number_batch(2, seed=22)

    def refused(model, message: str) -> None:
        dmm.register(CFG, logits_free=True)
        try:
            model(tokens, positions, None, labels=labels)
        except ValueError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"accepted, where '{message}' was expected")
        finally:
            dmm.unregister()

    model = build_gpt(tp)
    model.output_layer.bias = torch.nn.Parameter(torch.zeros(model.vocab_size // tp))
    refused(model, "has a bias")
    model = build_gpt(tp)
    model.config.use_mup, model.config.mup_output_mult = True, 0.5
    refused(model, "mup_output_mult=0.5")
    # Audit G4: Megatron-LM dev's --output-logit-dtype fp32 on a bf16 model (GPTModel's
    # logit_dtype, handed to ColumnParallelLinear as output_dtype); the same dtype is a no-op
    from megatron.core.transformer.module import Float16Module

    for owner in ("output layer", "model"):
        model = build_gpt(tp, config_kwargs=dict(bf16=True))
        if owner == "model":
            model.logit_dtype = torch.float32
        else:
            model.output_layer.output_dtype = torch.float32
        refused(Float16Module(model.config, model), "--output-logit-dtype fp32")
    model = build_gpt(tp)
    model.output_layer.output_dtype = model.logit_dtype = torch.float32
    dmm.register(CFG, logits_free=True)
    try:
        model(tokens, positions, None, labels=labels)
    finally:
        dmm.unregister()
    with pytest.raises(ValueError, match="logits_free must be True, False or a weight-gradient"):
        dmm.register(CFG, logits_free="sideways")


def check_logits_free_from_the_model_config(tp: int) -> None:
    """register(None) with the model config's fields (Bridge's way): del_logits_free=True (or a
    weight-gradient route) on the config turns the logits-free loss on for that model."""
    if _refused_by_this_core():
        return
    tokens, labels, positions = number_batch(2, seed=23)
    upstream = torch.ones(labels.shape)
    args = (tokens, positions, None)
    want = _loss_and_grads(build_gpt(tp), False, args, labels, upstream)
    for setting in (True, "forward", "backward"):
        model = build_gpt(tp)
        for name, value in dmm.config_fields(CFG).items():
            setattr(model.config, name, value)
        model.config.del_logits_free = setting
        with CountedChunks() as counted:
            ours = _loss_and_grads(model, False, args, labels, upstream, cfg=None)
        assert ours[2] == 0, "logits formed"
        _assert_same_training_signal(ours, want, f"tp {tp} config field {setting}")
        # the route the field names ("auto" as the kernel resolves it for this batch)
        asked = "auto" if setting is True else setting
        local, hidden_size = model.vocab_size // tp, model.config.hidden_size
        route = resolve_weight_gradient(asked, labels.numel(), local, hidden_size, torch.float32)
        assert (sum(counted.tiles) > 0) == (route == "backward"), (setting, counted.tiles)


def check_logits_free_under_cp() -> None:
    """Logits-free under context parallelism: the same loss and gradients as the materialised
    path, both with the CP group (digits weighed as in the whole sequence)."""
    if _refused_by_this_core():
        return
    from megatron.core import parallel_state

    tokens, labels, positions = number_batch(2, seed=24)
    cp_group = parallel_state.get_context_parallel_group()
    local = batch_on_this_cp_rank(
        {"tokens": tokens, "labels": labels, "position_ids": positions}, cp_group
    )
    args = (local["tokens"], local["position_ids"], None)
    upstream = torch.rand(local["labels"].shape, generator=torch.Generator().manual_seed(3))
    results = []
    for logits_free in (False, True):
        model = build_gpt(1, position_embedding_type="learned_absolute")
        results.append(_loss_and_grads(model, logits_free, args, local["labels"], upstream))
    _assert_same_training_signal(results[1], results[0], "cp 2")
    assert results[1][2] == 0


# (config field, value, logits_free, what the message names); set on a model's config after it
# is built (TransformerConfig validates some of them against settings a CPU run lacks).
FIRST_SIGHT_REFUSALS = [
    ("cuda_graph_impl", "full_iteration", False, "--cuda-graph-impl full_iteration"),
    ("overlap_moe_expert_parallel_comm", True, False, "--overlap-moe-expert-parallel-comm"),
    ("defer_embedding_wgrad_compute", True, True, "--defer-embedding-wgrad-compute"),
    ("fp16", True, "forward", "--fp16 with --del-logits-free forward"),
    ("gtp_weight_remat_size", 2, True, "gtp_weight_remat_size=2"),  # audit G2
]


def check_refused_when_the_hook_first_sees_the_model(tp: int) -> None:
    """A model config that register() could not see (Bridge providers, NeMo, models built by
    hand) is checked the first time the hook sees the model, before any loss: in its forward,
    or in compute_language_model_loss called outside it (the combined 1F1B schedule's
    post-process, where the message names the flag, not a model class); an output weight FSDP
    shards is refused for logits-free. The check runs once a model, not per call."""
    from del_megatron.megatron import support

    tokens, labels, positions = number_batch(2, seed=31)
    for field, value, logits_free, named in FIRST_SIGHT_REFUSALS:
        if logits_free and _refused_by_this_core():
            continue
        model = build_gpt(tp)
        setattr(model.config, field, value)
        logits = build_gpt(tp)(tokens, positions, None).transpose(0, 1).contiguous()
        for call in ("forward", "compute_language_model_loss"):
            dmm.register(CFG, logits_free=logits_free)  # a fresh registration: unchecked
            try:
                with pytest.raises(ValueError, match=named):
                    if call == "forward":
                        model(tokens, positions, None, labels=labels)
                    else:
                        model.compute_language_model_loss(labels, logits)
            finally:
                dmm.unregister()
    if not _refused_by_this_core():
        model = build_gpt(tp)
        model.output_layer.weight.__fsdp_param__ = True  # what Megatron-FSDP marks
        dmm.register(CFG, logits_free=True)
        try:
            with pytest.raises(ValueError, match="sharded by FSDP"):
                model(tokens, positions, None, labels=labels)
        finally:
            dmm.unregister()
        for tied in (False, True):  # audit G2: what GTP weight remat marks (core >= 0.19)
            model = build_gpt(tp, share_embeddings_and_output_weights=tied)
            weight = model.shared_embedding_or_output_weight() if tied else None
            weight = model.output_layer.weight if weight is None else weight
            weight.is_gtp_weight_remat, weight.gtp_remat_size = True, 2
            dmm.register(CFG, logits_free=True)
            try:
                with pytest.raises(ValueError, match="GTP weight-remat shard"):
                    model(tokens, positions, None, labels=labels)
            finally:
                dmm.unregister()
    calls, check = [], support.check_settings
    support.check_settings = lambda *args: calls.append(args) or check(*args)
    model = build_gpt(tp)
    dmm.register(CFG)
    try:
        for _ in range(3):
            model(tokens, positions, None, labels=labels)
    finally:
        dmm.unregister()
        support.check_settings = check
    assert len(calls) == 1, calls
