"""Megatron settings del_megatron refuses, and how a refusal reaches the user.

Each check raises ValueError (or RuntimeError) before iteration 1, naming the cause and the fix
(docs/support.md lists them), so the Python API and Bridge's and NeMo's entries get an exception
to catch. The checks read attributes by name from Megatron-LM's parsed arguments or from a model
config (TransformerConfig, a Megatron-Bridge provider): the flags' dest and the config fields
share their names. They run once: at registration (lm.register_from_args, Bridge's and NeMo's
enable_numerical_loss) and when the loss hook first sees a model (check_model_once).

On Megatron-LM's command line (the patched pretrain_gpt.py and the drop-in), `one_line` turns an
error raised by del_megatron's own code into one line printed by rank 0 to stderr, and an exit
with EXIT_CODE on every rank. Errors raised elsewhere (Megatron-LM's, torch's) keep their
traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from typing import Any, Callable, Iterable, NoReturn, Optional, TypeVar

import torch
import torch.distributed as dist

from . import logits_free as lf
from . import registration as reg

# Fused cross-entropy implementations that still compute the loss through
# LanguageModule.compute_language_model_loss (core 0.16.1 to 0.19.x), where the hook replaces
# them. Any other (Megatron-LM dev's "linear" computes the loss inside the output layer) would
# bypass the hook and train plain cross-entropy.
FUSION_IMPLS_REPLACED = ("native", "te")


def _names(values: Any) -> set:
    """Names in a CUDA-graph scope setting: a string, an enum, or a list of either."""
    if values is None:
        return set()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        values = [values]
    return {getattr(value, "name", str(value)) for value in values}


def check_fusion_impl(settings: Any) -> None:
    """Refuse a fused cross-entropy implementation that bypasses the loss hook (positive list:
    FUSION_IMPLS_REPLACED)."""
    if not getattr(settings, "cross_entropy_loss_fusion", False):
        return
    impl = getattr(settings, "cross_entropy_fusion_impl", "native")
    if impl not in FUSION_IMPLS_REPLACED:
        raise ValueError(
            f"--cross-entropy-fusion-impl {impl} (cross_entropy_fusion_impl={impl!r}) computes "
            "the loss without LanguageModule.compute_language_model_loss, so del_megatron cannot "
            f"apply the numerical loss there; use one of {FUSION_IMPLS_REPLACED} (del_megatron "
            "replaces them with its own kernel) or drop --cross-entropy-loss-fusion"
        )


def uses_full_iteration_cuda_graphs(settings: Any) -> bool:
    """--cuda-graph-impl full_iteration (core >= 0.18), or --cuda-graph-impl local with
    --cuda-graph-scope full_iteration (core 0.16/0.17)."""
    impl = getattr(settings, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        return True
    scopes = _names(getattr(settings, "cuda_graph_scope", None))
    scopes |= _names(getattr(settings, "cuda_graph_modules", None))
    return impl == "local" and "full_iteration" in scopes


def check_cuda_graphs(settings: Any) -> None:
    """Refuse full-iteration CUDA graphs: they capture the loss, and del_megatron keeps
    per-step state in Python (telemetry records, the digit reduction's step counts), which a
    replayed graph would freeze."""
    if uses_full_iteration_cuda_graphs(settings):
        raise ValueError(
            "full-iteration CUDA graphs (--cuda-graph-impl full_iteration, or on core 0.16/0.17 "
            "--cuda-graph-impl local --cuda-graph-scope full_iteration) capture the loss, for "
            "which del_megatron keeps per-step state in Python that a graph replay would "
            "freeze; use per-layer CUDA graphs (--cuda-graph-impl transformer_engine or local "
            "with per-layer modules/scopes, which leave the loss out of the graph) or none"
        )


def check_schedule(settings: Any) -> None:
    """Refuse the combined 1F1B schedule (EP all-to-all overlap): it builds the model's
    schedule plan instead of calling forward, and its loss function sees a detached copy."""
    if getattr(settings, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "--overlap-moe-expert-parallel-comm (overlap_moe_expert_parallel_comm=True) runs "
            "the model through a combined 1F1B schedule plan, outside GPTModel.forward, and hands "
            "the loss function a detached copy of the loss, so del_megatron's loss would go "
            "unreported and its digit reduction unapplied; drop --overlap-moe-expert-parallel-comm "
            "to train with del_megatron"
        )


def check_hybrid_context_parallel(settings: Any) -> None:
    """Refuse hybrid context parallelism (core 0.19) with the "digit" reduction: its schedule
    runs forward_step on a new one-sample iterator per packed sub-sample, so the step
    accounting cannot count the step's digit targets. (The loss itself follows each
    micro-batch's CP group: groups.cp_split.)"""
    if not getattr(settings, "hybrid_context_parallel", False):
        return
    if getattr(settings, "dataloader_inter_document_masking", False) and not getattr(
        settings, "sft", False
    ):
        raise ValueError(
            "--hybrid-context-parallel with --dataloader-inter-document-masking (without --sft): "
            "Megatron-LM's get_batch then splits each packed sequence over the whole CP group "
            "while the micro-batch still carries its hybrid local_cp_size, so the loss cannot "
            "tell which split its tokens are in; drop one of the two flags"
        )
    digit = (getattr(settings, "del_reduction", None) or "digit") == "digit"
    if digit and getattr(settings, "numerical_loss", None) not in (None, "ce"):
        raise ValueError(
            "--hybrid-context-parallel with --del-reduction digit (the default): hybrid context "
            "parallelism "
            "schedules each packed sub-sample on its own one-sample data iterator, so "
            "del_megatron cannot count the step's digit targets for the step-wide digit "
            "reduction; use --del-reduction token --del-digit-share S (`del-megatron check "
            "--data-path` measures S), or drop --hybrid-context-parallel"
        )


# Settings that act only when the output layer itself is called (field -> what they do).
_SHARDS = "shards the output layer's weight and gathers it only when the layer is called"
_READS_LOGITS = (
    "(knowledge distillation) takes the student's logits from the output layer's forward"
)
_NEEDS_THE_OUTPUT_LAYER_CALLED = {
    "use_megatron_fsdp": _SHARDS,
    "use_torch_fsdp2": _SHARDS,
    "logits_load_dir": _READS_LOGITS,
    "logits_save_dir": _READS_LOGITS,
    "export_kd_teacher_load": _READS_LOGITS,
}


def check_logits_free(settings: Any, route: str) -> None:
    """Refuse what the logits-free loss (weight-gradient route `route`) cannot train with."""
    if getattr(settings, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            "--defer-embedding-wgrad-compute defers the output layer's weight gradient to the "
            "end of the step, but the logits-free loss never calls the output layer, so Megatron "
            "would find nothing to compute there (IndexError at the end of step 1); drop "
            "--defer-embedding-wgrad-compute or --del-logits-free"
        )
    for field, needs in _NEEDS_THE_OUTPUT_LAYER_CALLED.items():
        if getattr(settings, field, None):
            flag = "--" + field.replace("_", "-")
            raise ValueError(
                f"{flag} {needs}, and the logits-free loss never calls that layer; drop "
                f"--del-logits-free (the materialised loss is the same) or {flag}"
            )
    check_gtp_weight_remat(settings)
    check_logit_dtype(getattr(settings, "logit_dtype", None), _run_dtype(settings))
    if getattr(settings, "fp16", False) and route == "forward":
        raise ValueError(
            "--fp16 with --del-logits-free forward: that route forms its gradient products before "
            "the loss scale is applied, and in fp16 they can overflow where the materialised "
            "path's do not; use --del-logits-free backward (what 'auto' takes in fp16), or --bf16"
        )


_GTP = (
    "(generalized tensor parallelism with weight rematerialization, core >= 0.19) keeps a "
    "1/{g} shard of the output layer's weight on each rank and all-gathers it only when the "
    "layer is called, which the logits-free loss never does; drop --del-logits-free (the "
    "materialised loss is the same) or set --tensor-parallel-num-weight-shards to the "
    "tensor-parallel size"
)


def check_gtp_weight_remat(settings: Any) -> None:
    """Refuse GTP weight rematerialization of the dense layers (gtp_weight_remat_size > 1, which
    Megatron derives from --tensor-parallel-num-weight-shards): the output layer's weight is a
    shard of its tensor-parallel shard. Expert GTP (the MoE experts only) is not refused."""
    tp = getattr(settings, "tensor_model_parallel_size", None) or 1
    shards = getattr(settings, "tensor_parallel_num_weight_shards", None)
    remat = getattr(settings, "gtp_weight_remat_size", None) or 1
    if remat <= 1 and shards is not None and shards > tp:
        remat = shards // tp  # a config whose __post_init__ has not derived it yet
    if remat > 1:
        shards = shards if shards is not None else tp * remat
        raise ValueError(
            f"--del-logits-free with --tensor-parallel-num-weight-shards {shards} at "
            f"tensor-parallel size {tp} (gtp_weight_remat_size={remat}) " + _GTP.format(g=remat)
        )


_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _dtype(value: Any) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    return _DTYPE_NAMES.get(str(value).lower())


def _run_dtype(settings: Any) -> torch.dtype:
    """The dtype the output layer's input has in this run: bf16/fp16 under --bf16/--fp16
    (Megatron's Float16Module casts the model), else params_dtype (fp32 by default)."""
    if getattr(settings, "bf16", False):
        return torch.bfloat16
    if getattr(settings, "fp16", False):
        return torch.float16
    return _dtype(getattr(settings, "params_dtype", None)) or torch.float32


def check_logit_dtype(logit_dtype: Any, hidden_dtype: Optional[torch.dtype]) -> None:
    """Refuse output logits asked for in another dtype than the output layer's input (Megatron-LM
    dev's --output-logit-dtype: GPTModel's logit_dtype, ColumnParallelLinear's output_dtype):
    the logits-free loss forms its logit chunks in the input's dtype. The same dtype is a no-op
    in Megatron too, and passes."""
    wanted = _dtype(logit_dtype)
    if wanted is None or wanted == hidden_dtype:
        return
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(wanted, str(wanted))
    raise ValueError(
        f"--output-logit-dtype {name} (logit_dtype / the output layer's output_dtype "
        f"{wanted}) asks the output layer for {wanted} logits from {hidden_dtype} hidden "
        "states, but the logits-free loss forms its logits in the hidden states' dtype and "
        "would train on other logits than asked; drop --del-logits-free (the materialised "
        "loss takes the logits as asked, fp32 ones in place) or --output-logit-dtype"
    )


def check_sharded_weight(weight: torch.Tensor) -> None:
    """Refuse an output weight managed by an FSDP wrapper (Megatron-FSDP marks its parameters;
    torch FSDP2 makes them DTensors), or a GTP weight-remat shard (is_gtp_weight_remat, core
    >= 0.19): it is whole only while the layer runs."""
    from torch.distributed.tensor import DTensor

    if hasattr(weight, "__fsdp_param__") or isinstance(weight, DTensor):
        raise ValueError(
            "the output layer's weight is sharded by FSDP (Megatron-FSDP or torch FSDP2) and "
            "gathered only when the layer is called, which the logits-free loss never does; drop "
            "--del-logits-free (the materialised loss is the same) or FSDP"
        )
    if getattr(weight, "is_gtp_weight_remat", False):
        size = getattr(weight, "gtp_remat_size", "g")
        raise ValueError(
            "the output layer's weight is a GTP weight-remat shard: "
            "--tensor-parallel-num-weight-shards " + _GTP.format(g=size)
        )


def check_megatron_settings(settings: Any, logits_free: Optional[str] = None) -> None:
    """Every refusal that applies to `settings` (logits_free: the weight gradient's route, or
    None when the loss keeps its logits)."""
    check_fusion_impl(settings)
    check_cuda_graphs(settings)
    check_schedule(settings)
    check_hybrid_context_parallel(settings)
    if logits_free is not None:
        check_logits_free(settings, logits_free)


FUSION_NAMES = {
    "native": "Megatron's fused cross-entropy (impl 'native')",
    "te": "Transformer Engine's fused cross-entropy (impl 'te')",
}
FUSION_REPLACED_BY = {
    "native": (
        "Megatron's fused cross-entropy (impl 'native') is replaced by del_megatron's "
        "vocab-parallel CE+digit kernel, which computes the loss in fp32 from the same logits"
    ),
    "te": (
        "Transformer Engine's fused cross-entropy (impl 'te') is replaced by del_megatron's "
        "vocab-parallel CE+digit kernel ('compiled' on CUDA, 'recompute' elsewhere). TE's "
        "kernel writes the gradient over the logits in place; del_megatron's keeps the logits "
        "for backward and writes their gradient into a new buffer, so the loss holds one more "
        "[s, b, V/tp] buffer than TE's (2 bytes a logit in bf16: 4 against TE's 2). "
        "--del-logits-free forms no logits at all"
    ),
}
LOGITS_FREE_REPLACES = (
    "%s is replaced by del_megatron's logits-free loss (--del-logits-free, weight-gradient "
    "route '%s'): the output layer's matmul and the CE+digit passes chunked over tokens, with "
    "no [s, b, V/tp] logits or gradient held (less than the fused kernel's logits buffer)"
)


# Megatron-LM #6766 (after core 0.19): LanguageModule.__init__ picks its cross-entropy once,
# through the backend spec provider, and keeps it under this name; the method the hook replaces
# calls it. The config's impl then no longer says which kernel that is (never TE's).
CACHED_CROSS_ENTROPY = "vocab_parallel_cross_entropy"
CACHED_REPLACED_BY = (
    "the cross-entropy this model chose when it was built (%s, impl setting %r) is replaced by "
    "del_megatron's vocab-parallel CE+digit kernel"
)


def cached_cross_entropy(module: Any) -> Optional[Callable]:
    """The cross-entropy function `module` keeps from its construction (Megatron-LM #6766),
    else None."""
    cached = vars(module).get(CACHED_CROSS_ENTROPY) if module is not None else None
    return cached if callable(cached) else None


def fusion_replacement(
    impl: str, logits_free: Optional[str] = None, cached: Optional[Callable] = None
) -> str:
    """The log line saying what replaces fused cross-entropy `impl`, and at what memory
    (logits_free: the weight-gradient route, None when the loss keeps its logits; cached: the
    model's own choice of cross-entropy, named instead of `impl`'s where the model keeps one)."""
    if cached is not None:
        name = f"{getattr(cached, '__module__', '?')}.{getattr(cached, '__qualname__', cached)}"
        if logits_free is not None:
            return LOGITS_FREE_REPLACES % (f"the model's cross-entropy ({name})", logits_free)
        return CACHED_REPLACED_BY % (name, impl)
    if logits_free is not None:
        return LOGITS_FREE_REPLACES % (FUSION_NAMES[impl], logits_free)
    return FUSION_REPLACED_BY[impl]


def check_model_config(config: Any, logits_free: Optional[str] = None, module: Any = None) -> None:
    """Refuse a model config del_megatron cannot train right (check_megatron_settings; logits_free:
    the weight-gradient route, None when the loss keeps its logits), and log once which fused
    cross-entropy it replaces (the one `module`, the model when given, chose at build, where it
    keeps one)."""
    check_megatron_settings(config, logits_free)
    if getattr(config, "cross_entropy_loss_fusion", False):
        impl = getattr(config, "cross_entropy_fusion_impl", "native")
        line = fusion_replacement(impl, logits_free, cached_cross_entropy(module))
        reg.log_once("fusion", "del_megatron: %s", line)


def check_model_once(module: Any) -> None:
    """check_model_config for a model the loss hook sees for the first time in this
    registration (its config and logits-free setting; then nothing for it again), and for
    logits-free its output layer: no bias, no MuP logit multiplier, no FSDP- or GTP-sharded
    weight."""
    registration = reg.current()
    if registration is None or id(module) in registration.checked_models:
        return
    registration.checked_models[id(module)] = module
    if reg.of_model(module) is None:
        return
    route = lf.route_of(module)
    check_model_config(module.config, route, module)
    output_layer = getattr(module, "output_layer", None)
    if route is not None and output_layer is not None:
        lf.check_no_logit_scaling(module.config)
        lf.check_no_bias(output_layer)
        if getattr(module, "share_embeddings_and_output_weights", False):
            check_sharded_weight(module.shared_embedding_or_output_weight())
        elif getattr(output_layer, "weight", None) is not None:
            check_sharded_weight(output_layer.weight)


EXIT_CODE = 2
GRACE_S = 10.0
PREFIX = "del_megatron: "
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFUSALS = (ValueError, RuntimeError)

T = TypeVar("T")


def raised_by_del_megatron(error: BaseException) -> bool:
    """Whether `error` was raised in del_megatron's own code (its innermost frame)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE + os.sep)


def refusal_line(error: BaseException) -> str:
    """The refusal as one line: 'del_megatron: refused: <cause and fix>'."""
    message = " ".join(str(error).split())
    if message.startswith(PREFIX):
        message = message[len(PREFIX) :]
    return f"{PREFIX}refused: {message}"


def exit_refused(error: BaseException) -> NoReturn:
    """Print `error` as one line on rank 0 (stderr), take down the process groups (gloo aborts
    a process that exits with them alive) and exit with EXIT_CODE, without a traceback. The
    other ranks refuse the same flags at the same point: they wait up to GRACE_S first, so that
    torchrun, which stops every rank once one has failed, does not stop rank 0 before its line
    (it reports rank 0 as the failure)."""
    rank_zero = reg.is_rank_zero()
    if rank_zero:
        sys.stdout.flush()
        print(refusal_line(error), file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if not rank_zero:
        time.sleep(GRACE_S)
    raise SystemExit(EXIT_CODE) from None


def one_line(function: Callable[..., T]) -> Callable[..., T]:
    """`function`, with a refusal raised by del_megatron's code turned into exit_refused."""

    @functools.wraps(function)
    def refusing(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except REFUSALS as error:
            if not raised_by_del_megatron(error):
                raise
            exit_refused(error)

    return refusing


def check_when_parsed(parser: argparse.ArgumentParser, check: Callable[[Any], None]) -> None:
    """Run `check(namespace)` on what `parser` parses, as soon as it has parsed it (before
    Megatron-LM validates and prints its arguments), a refusal as one line. argparse's
    parse_args goes through parse_known_args, which is wrapped on this parser only."""
    parse_known_args = parser.parse_known_args

    @functools.wraps(parse_known_args)
    def parse_and_check(*args: Any, **kwargs: Any):
        namespace, rest = parse_known_args(*args, **kwargs)
        one_line(check)(namespace)
        return namespace, rest

    parser.parse_known_args = parse_and_check
