"""Configurations del_megatron refuses before iteration 1 (del_megatron/megatron/refusals.py,
docs/support.md), and a loss function that sees a loss the hook did not compute."""

import argparse
import types

import pytest
import torch

import del_megatron as dm
from del_megatron import megatron as dmm
from del_megatron.megatron import lm, loss_func, refusals

DIGITS = [str(i) for i in range(10, 20)]


def _scope(name: str):
    """A --cuda-graph-scope value as core 0.16 parses it (its CudaGraphScope enum; the string
    where this core has none)."""
    from megatron.core.transformer import enums

    scope = getattr(enums, "CudaGraphScope", None)
    return getattr(scope, name) if scope is not None and hasattr(scope, name) else name


def megatron_args(argv, **flags) -> argparse.Namespace:
    """Megatron-LM's parsed arguments as register_from_args sees them: the DEL flags parsed,
    Megatron's own flags by their dest."""
    parser = argparse.ArgumentParser()
    dmm.add_arguments(parser)
    ids = [] if "ce" in argv else ["--del-digit-token-ids", *DIGITS]  # ce takes no ids
    args = parser.parse_args([*ids, *argv])
    args.padded_vocab_size = 1024
    for name, value in flags.items():
        setattr(args, name, value)
    return args


def one_refusal_line(capsys, call, *args, **kwargs) -> str:
    """Run a Megatron-LM entry that refuses: it exits with refusals.EXIT_CODE after printing
    exactly one line, 'del_megatron: refused: ...', to stderr (rank 0 here), and no traceback.
    The line, without its prefix."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        call(*args, **kwargs)
    err = capsys.readouterr().err
    assert exited.value.code == refusals.EXIT_CODE
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("del_megatron: refused: "), err
    return lines[0][len("del_megatron: refused: ") :]


DEL = ["--numerical-loss", "del"]
LOGITS_FREE = ["--del-logits-free"]
REFUSED = [
    pytest.param(
        DEL,
        dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear"),
        ("--cross-entropy-fusion-impl linear", "drop --cross-entropy-loss-fusion"),
        id="F6-fusion-impl",
    ),
    pytest.param(
        DEL,
        dict(cuda_graph_impl="full_iteration"),
        ("--cuda-graph-impl full_iteration", "per-layer CUDA graphs"),
        id="F5-full-iteration-graphs",
    ),
    pytest.param(
        DEL,
        dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"),
        ("--cuda-graph-scope full_iteration", "per-layer CUDA graphs"),
        id="F5-full-iteration-scope-core-0.16",
    ),
    pytest.param(
        ["--numerical-loss", "ce", *LOGITS_FREE],
        dict(overlap_moe_expert_parallel_comm=True),
        ("--overlap-moe-expert-parallel-comm", "drop --overlap-moe-expert-parallel-comm"),
        id="F7-combined-1f1b",
    ),
    pytest.param(
        DEL + LOGITS_FREE,
        dict(defer_embedding_wgrad_compute=True),
        ("--defer-embedding-wgrad-compute", "drop --defer-embedding-wgrad-compute or"),
        id="F10-deferred-embedding-wgrad",
    ),
    pytest.param(
        DEL + LOGITS_FREE,
        dict(use_megatron_fsdp=True),
        ("--use-megatron-fsdp shards", "drop --del-logits-free"),
        id="F11-megatron-fsdp",
    ),
    pytest.param(
        DEL + LOGITS_FREE + ["backward"],
        dict(use_torch_fsdp2=True),
        ("--use-torch-fsdp2 shards", "drop --del-logits-free"),
        id="F11-torch-fsdp2",
    ),
    pytest.param(
        DEL + LOGITS_FREE + ["forward"],
        dict(fp16=True),
        ("--fp16 with --del-logits-free forward", "use --del-logits-free backward"),
        id="F17-fp16-forward-route",
    ),
    pytest.param(
        DEL + ["--del-reduction", "digit"],
        dict(hybrid_context_parallel=True),
        ("--hybrid-context-parallel with --del-reduction digit", "use --del-reduction token"),
        id="F15-hybrid-cp-digit-reduction",
    ),
    pytest.param(
        DEL,
        dict(hybrid_context_parallel=True, dataloader_inter_document_masking=True),
        ("--hybrid-context-parallel with --dataloader-inter-document-masking", "drop one"),
        id="hybrid-cp-inter-document-masking",
    ),
    pytest.param(
        DEL + LOGITS_FREE,
        dict(logits_load_dir="/data/teacher-logits"),
        ("--logits-load-dir (knowledge distillation)", "drop --del-logits-free"),
        id="cached-logits-distillation",
    ),
    pytest.param(
        DEL + LOGITS_FREE,
        dict(export_kd_teacher_load="/ckpt/teacher"),
        ("--export-kd-teacher-load (knowledge distillation)", "drop --del-logits-free"),
        id="modelopt-distillation",
    ),
    pytest.param(
        DEL + LOGITS_FREE,
        dict(
            tensor_model_parallel_size=2,
            tensor_parallel_num_weight_shards=4,
            gtp_weight_remat_size=2,
        ),  # fmt: skip
        (
            "--tensor-parallel-num-weight-shards 4 at tensor-parallel size 2",
            "keeps a 1/2 shard of the output layer's weight",
            "drop --del-logits-free",
            "set --tensor-parallel-num-weight-shards to the tensor-parallel size",
        ),
        id="G2-gtp-weight-remat",
    ),
    pytest.param(
        DEL + LOGITS_FREE + ["forward"],
        # a model config before its __post_init__ derives gtp_weight_remat_size
        dict(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=8),
        ("gtp_weight_remat_size=4", "drop --del-logits-free"),
        id="G2-gtp-weight-shards-only",
    ),
    pytest.param(
        DEL + LOGITS_FREE,
        dict(logit_dtype=torch.float32, bf16=True, params_dtype=torch.bfloat16),
        ("--output-logit-dtype fp32", "drop --del-logits-free", "or --output-logit-dtype"),
        id="G4-fp32-output-logits",
    ),
    pytest.param(
        DEL + LOGITS_FREE,
        dict(logit_dtype="fp32", bf16=True),  # the flag's value before Megatron maps it
        ("--output-logit-dtype fp32", "drop --del-logits-free"),
        id="G4-fp32-output-logits-by-name",
    ),
]


@pytest.mark.parametrize("argv, flags, named", REFUSED)
def test_register_from_args_refuses_before_any_model_naming_the_flag_and_the_way_out(
    argv, flags, named, capsys
):
    if flags.get("cuda_graph_scope"):
        flags = {**flags, "cuda_graph_scope": [_scope("attn"), _scope("full_iteration")]}
    args = megatron_args(argv, **flags)
    line = one_refusal_line(capsys, lm.register_from_args, args, tokenizer=None)
    for words in named:
        assert words in line, line
    assert not dmm.is_registered()


@pytest.mark.parametrize(
    "route, flags",
    [
        (None, dict(defer_embedding_wgrad_compute=True, use_megatron_fsdp=True, fp16=True)),
        ("auto", dict(fp16=True)),  # resolves to the backward route in fp16
        ("backward", dict(fp16=True, cuda_graph_impl="transformer_engine")),
        ("auto", dict(cuda_graph_impl="local", cuda_graph_scope=["attn", "mlp"])),
        ("auto", dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")),
        (None, dict(hybrid_context_parallel=True, numerical_loss="del", del_reduction="token")),
        (None, dict(hybrid_context_parallel=True, numerical_loss="ce", del_reduction="digit")),
        (
            None,
            dict(hybrid_context_parallel=True, dataloader_inter_document_masking=True, sft=True),
        ),
        (None, dict(logits_load_dir="/data/teacher-logits", logits_save_dir="/data/out")),
        (None, dict(gtp_weight_remat_size=2, logit_dtype=torch.float32, bf16=True)),
        (
            "auto",
            dict(
                expert_gtp_weight_remat_size=2,
                tensor_parallel_num_weight_shards=2,
                tensor_model_parallel_size=2,
            ),
        ),  # fmt: skip
        ("auto", dict(logit_dtype=torch.bfloat16, bf16=True, params_dtype=torch.bfloat16)),
        # a model config: Float16Module casts the fp32-built model to bf16
        ("auto", dict(logit_dtype=torch.bfloat16, bf16=True, params_dtype=torch.float32)),
        ("auto", dict(logit_dtype=torch.float32)),  # an fp32 run: already its logits' dtype
    ],
)
def test_what_is_not_refused(route, flags):
    """The refusals are narrow: without logits-free its own ones do not apply, fp16 takes the
    backward route, per-layer CUDA graphs and the fused impls the hook replaces are fine, GTP of
    the experts only leaves the output layer whole, and output logits asked for in the run's own
    dtype change nothing."""
    refusals.check_megatron_settings(types.SimpleNamespace(**flags), route)


def test_an_output_weight_gathered_only_when_its_layer_runs_is_refused_for_logits_free():
    """Audit G2: a GTP weight-remat shard (core >= 0.19 marks it is_gtp_weight_remat) holds
    V/(tp * g) rows, which the logits-free loss would read as the whole shard (and then stop on
    a misleading out-of-vocabulary label assert): refused, as an FSDP-managed weight is."""
    weight = torch.nn.Parameter(torch.zeros(8, 4))
    refusals.check_sharded_weight(weight)
    weight.is_gtp_weight_remat, weight.gtp_remat_size = True, 2
    with pytest.raises(ValueError) as refused:
        refusals.check_sharded_weight(weight)
    for words in ("GTP weight-remat shard", "1/2 shard", "drop --del-logits-free"):
        assert words in str(refused.value), str(refused.value)
    fsdp = torch.nn.Parameter(torch.zeros(8, 4))
    fsdp.__fsdp_param__ = True
    with pytest.raises(ValueError, match="sharded by FSDP"):
        refusals.check_sharded_weight(fsdp)


def test_a_numerical_loss_run_stops_on_a_loss_the_hook_did_not_compute():
    """F6: with the numerical loss registered (or named by the model's config), loss_func
    refuses a loss del_megatron did not compute; a CE registration and an unregistered run pass
    it to Megatron's loss unchanged."""
    out, mask = torch.ones(1, 3), torch.ones(1, 3)
    vocab = dm.DigitVocab(range(10), [10])
    dmm.register(dm.NumericalLossConfig(loss="del", vocab=vocab))
    try:
        with pytest.raises(RuntimeError, match="would train plain cross-entropy"):
            dmm.numerical_loss_func(mask, out)
    finally:
        dmm.unregister()
    dmm.register(dm.NumericalLossConfig(loss="ce"))
    try:
        assert dmm.numerical_loss_func(mask, out)[0].item() == 3
    finally:
        dmm.unregister()
    # cfg on the model config (Bridge's, NeMo's way): loss_func finds it through the wrappers
    config = types.SimpleNamespace(**dm.NumericalLossConfig(vocab=vocab).to_fields())
    wrapped = types.SimpleNamespace(module=types.SimpleNamespace(config=config))
    plain = types.SimpleNamespace(module=types.SimpleNamespace(config=types.SimpleNamespace()))
    dmm.register(None)
    try:
        with pytest.raises(RuntimeError, match="numerical loss 'del'"):
            dmm.numerical_loss_func(mask, out, model=wrapped)
        assert dmm.numerical_loss_func(mask, out, model=plain)[0].item() == 3
    finally:
        dmm.unregister()
    assert dmm.numerical_loss_func(mask, out)[0].item() == 3
    with pytest.raises(RuntimeError):
        loss_func.check_recorded(None, "ntl_was")


def test_the_output_layers_forward_pre_hooks_run_and_one_that_changes_its_input_is_refused():
    """The logits-free loss runs the output layer's own forward pre-hooks as calling the layer
    would (Megatron's DDP waits there for the weight's all-gather); a hook that would replace
    the layer's input cannot be honoured without the logits, so it is refused."""
    from del_megatron.megatron.logits_free import run_forward_pre_hooks

    layer, hidden, seen = torch.nn.Linear(4, 8, bias=False), torch.randn(3, 1, 4), []
    layer.register_forward_pre_hook(lambda module, args: seen.append(("plain", args)))
    layer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(("kwargs", args, kwargs)), with_kwargs=True
    )
    run_forward_pre_hooks(layer, hidden)
    assert [entry[0] for entry in seen] == ["plain", "kwargs"]
    assert seen[0][1][0] is hidden and seen[1][2] == {}
    layer.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    with pytest.raises(ValueError, match="changes the layer's input"):
        run_forward_pre_hooks(layer, hidden)


def test_a_device_check_message_fits_cudas_assert():
    """CUDA's torch._assert_async refuses a message of 255 characters or more on the host,
    before it looks at the value: every check_on_device message is held to that on any device,
    and a CPU check that fails raises ValueError with the message and its details."""
    from del_megatron.device import CUDA_ASSERT_MESSAGE_LIMIT, check_on_device
    from del_megatron.kernels.linear import NOT_PROPORTIONAL

    assert len(NOT_PROPORTIONAL) < CUDA_ASSERT_MESSAGE_LIMIT
    check_on_device(torch.tensor(True), NOT_PROPORTIONAL)
    with pytest.raises(ValueError, match="way out; found 3"):
        check_on_device(torch.tensor(False), "a way out", lambda: "; found 3")
    with pytest.raises(AssertionError, match="message of 255 characters"):
        check_on_device(torch.tensor(True), "x" * CUDA_ASSERT_MESSAGE_LIMIT)
