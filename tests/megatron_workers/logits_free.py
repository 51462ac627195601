"""register(logits_free=...) on a real GPTModel: the same training signal as the materialised
path, at every layout, from the model config, under CP; its refusals."""

from __future__ import annotations

import pytest
import torch

from del_megatron import megatron as dmm
from del_megatron.kernels.linear import resolve_weight_gradient

from ..gpt_helpers import batch_on_this_cp_rank, build_gpt, number_batch
from ..linear_workers import CountedChunks
from .config import CFG


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
        for name, value in CFG.to_fields().items():
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
