"""Megatron-LM's pretrain scripts run with the numerical losses: one drop-in for
`pretrain_gpt.py` (GPTModel), `pretrain_hybrid.py` (HybridModel) and `pretrain_mamba.py`
(MambaModel at core_v0.16.1; from core_v0.18.0 a wrapper that runs pretrain_hybrid.py).

`run(SCRIPTS[name])` imports Megatron-LM's own script as a module (its `__main__` does not run),
wraps its loss_func and forward_step (lm.install), adds the `--numerical-loss` / `--del-*` flags
and calls Megatron-LM's `pretrain()` as that script's `__main__` does, in each release's argument
API: `pretrain(extra_args_provider=...)` (core <= 0.17), `parse_and_validate_args(...)` +
`pretrain(full_config, model_provider, ...)` (core 0.18) and `pretrain(full_config)` with a model
config in place of a provider (core >= 0.19). A script is named by what differs between the
three (`Script`); everything else is one code path.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import types
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, Optional

# For Megatron-LM's startup timing report, as the scripts take it: before Megatron-LM's imports.
_PROGRAM_START_TIME = time.time()
ENV_DIR = "MEGATRON_LM_DIR"


@dataclass(frozen=True)
class Script:
    """What one Megatron-LM pretrain script names differently: its module (`pretrain_gpt`), the
    model class it trains (`GPTModel`), its model builder passed to model_provider
    (`gpt_builder`), the function that makes its model config from the arguments (core >= 0.18:
    `gpt_config_from_args`) and ModelOpt's config class for it."""

    module: str
    model_class: str
    builder: str
    config_from_args: Optional[str]
    modelopt_config: str


SCRIPTS: Dict[str, Script] = {
    "pretrain_gpt": Script(
        "pretrain_gpt", "GPTModel", "gpt_builder", "gpt_config_from_args", "ModelOptModelConfig"
    ),
    "pretrain_hybrid": Script(
        "pretrain_hybrid",
        "HybridModel",
        "hybrid_builder",
        "hybrid_config_from_args",
        "ModelOptHybridModelConfig",
    ),
    "pretrain_mamba": Script(  # core_v0.16.1's own; later trees' runs pretrain_hybrid.py
        "pretrain_mamba", "MambaModel", "mamba_builder", None, "ModelOptHybridModelConfig"
    ),
}


def megatron_lm_dir() -> str:
    """The Megatron-LM checkout: MEGATRON_LM_DIR, else the current directory."""
    return os.path.abspath(os.environ.get(ENV_DIR) or os.getcwd())


def import_script(script: Script) -> types.ModuleType:
    """Megatron-LM's `<script.module>.py` as a module, with its checkout first on sys.path (so
    that its `megatron` package is the one imported); a clear error when there is none. A
    script that only runs another one (pretrain_mamba.py from core_v0.18.0 runs
    pretrain_hybrid.py) is followed to that one, as its `__main__` would."""
    folder = megatron_lm_dir()
    if not os.path.isfile(os.path.join(folder, f"{script.module}.py")):
        where = (
            f"{ENV_DIR}={folder}" if os.environ.get(ENV_DIR) else f"the current directory {folder}"
        )
        raise SystemExit(
            f"del_megatron.megatron.{script.module}_del: no {script.module}.py in {where}; run it "
            f"from a Megatron-LM checkout or set {ENV_DIR} to one"
        )
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    module = importlib.import_module(script.module)
    if not hasattr(module, "forward_step") and script.module == "pretrain_mamba":
        return import_script(SCRIPTS["pretrain_hybrid"])
    return module


def run(script: Script) -> None:
    """Run Megatron-LM's `script` with the numerical-loss flags (the drop-in's main)."""
    module = import_script(script)
    script = SCRIPTS[module.__name__]  # pretrain_mamba.py may have been followed to another
    import megatron.training
    from megatron.core.enums import ModelType
    from megatron.training import arguments, get_args, get_tokenizer, pretrain

    from . import lm

    set_startup_timestamps = getattr(megatron.training, "set_startup_timestamps", None)
    if set_startup_timestamps is not None:  # as the script's main, once its imports are done
        set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())

    lm.install(module)  # loss_func: telemetry, digit reduction; forward_step: counting
    modelopt = getattr(module, "has_nvidia_modelopt", False)
    extra = lm.chain_extra_args(
        getattr(module, "add_modelopt_args", None) if modelopt else None, lm.add_arguments
    )
    lm.help_with_flags(extra)
    builder = getattr(module, script.builder, None)
    base_provider = getattr(module, "model_provider", None)
    if builder is not None and base_provider is not None:
        base_provider = partial(base_provider, builder)
    datasets = module.train_valid_test_datasets_provider
    datasets.is_distributed = True
    common = dict(get_embedding_ranks=getattr(module, "get_embedding_ranks", None))
    common = {k: v for k, v in common.items() if v is not None}
    requires_provider = _requires_provider(pretrain)  # read before any wrapper hides it
    restart = getattr(module, "inprocess_restart", None)
    if restart is not None:  # as the script's main: NVRx in-process restart when asked
        pretrain, common["store"] = restart.maybe_wrap_for_inprocess_restart(pretrain)
    args_defaults = {"tokenizer_type": "GPT2BPETokenizer"}

    if hasattr(arguments, "parse_and_validate_args"):  # core >= 0.18
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        args = arguments.parse_and_validate_args(
            extra_args_provider=extra, args_defaults=args_defaults
        )
        # Settle the loss now, from the tokenizer the run will build: a tokenizer without
        # single-digit tokens stops here, before any training.
        lm.register_from_args(args, module.build_tokenizer(args))
        check_model_class(module, script, args)
        model_config = _model_config(module, script, args)
        if model_config is not None:
            full_config = pretrain_cfg_container_from_args(args, model_config)
        else:
            full_config = pretrain_cfg_container_from_args(args)
        # A model provider where the script has no model config (pretrain_gpt.py at core
        # 0.18) or pretrain() requires one (core 0.18's pretrain_hybrid.py passes both);
        # core >= 0.19 builds the model from the config.
        wants_provider = model_config is None or requires_provider
        provider = {"model_provider": base_provider} if wants_provider else {}
        pretrain(
            full_config,
            train_valid_test_dataset_provider=datasets,
            model_type=ModelType.encoder_or_decoder,
            forward_step_func=module.forward_step,
            **provider,
            **common,
        )
    else:  # core <= 0.17
        check = partial(check_model_class, module, script)
        model_provider = lm.wrap_model_provider(base_provider, get_args, get_tokenizer, check)
        pretrain(
            datasets,
            model_provider,
            ModelType.encoder_or_decoder,
            module.forward_step,
            args_defaults=args_defaults,
            extra_args_provider=extra,
            **common,
        )
    lm.destroy_process_groups()


def check_model_class(module: types.ModuleType, script: Script, args: Any) -> None:
    """Refuse, before any model is built, what the script's model class cannot run: the
    logits-free loss on a model whose forward takes no output_processor (HybridModel and
    MambaModel), in one line on rank 0. GPTModel's is refused by the megatron-core it needs
    (refusals.check_megatron_settings)."""
    from . import logits_free, refusals

    if script.model_class == "GPTModel":  # its refusal names the megatron-core it needs
        return
    model_class = getattr(module, script.model_class, None)
    if getattr(args, "del_logits_free", False) and model_class is not None:
        refusals.one_line(logits_free.check_model_class_supports)(model_class)


def _requires_provider(pretrain: Any) -> bool:
    """Whether Megatron-LM's pretrain() has a model_provider parameter without a default."""
    import inspect

    parameter = inspect.signature(pretrain).parameters.get("model_provider")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _model_config(module: types.ModuleType, script: Script, args: Any) -> Any:
    """The model config the script's main builds (ModelOpt's when enabled), or None where it
    builds none (pretrain_gpt.py before core 0.19)."""
    if script.config_from_args is None:
        return None
    config_from_args = getattr(module, script.config_from_args, None)
    if config_from_args is None:
        return None
    modelopt = getattr(module, "has_nvidia_modelopt", False)
    if modelopt and hasattr(module, "maybe_enable_modelopt"):
        module.maybe_enable_modelopt(args)
    if modelopt and getattr(args, "modelopt_enabled", False):
        return config_from_args(args, model_config_cls=getattr(module, script.modelopt_config))
    return config_from_args(args)
