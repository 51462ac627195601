"""Megatron-LM's pretrain_gpt.py with the del_megatron numerical losses: the drop-in.

Run it from a Megatron-LM checkout (or with MEGATRON_LM_DIR naming one) exactly like
pretrain_gpt.py, as a module of the installed package, with the extra flags:

    cd Megatron-LM
    torchrun ... -m del_megatron.megatron.pretrain_gpt_del <usual pretrain_gpt.py flags> \\
        --numerical-loss del --del-alpha 0.1

and for the token reduction, the share `del-megatron check --data-path` measured (0.05 here):

    torchrun ... -m del_megatron.megatron.pretrain_gpt_del <usual pretrain_gpt.py flags> \\
        --numerical-loss del --del-alpha 0.1 --del-reduction token --del-digit-share 0.05

(examples/pretrain_gpt_del.py is the same, by path.) Digit ids come from the run's tokenizer
unless --del-digit-token-ids is given. It imports Megatron-LM's own pretrain_gpt.py as a module
(its main does not run) and follows each release's argument API:
`pretrain(extra_args_provider=...)` (core <= 0.17), `parse_and_validate_args(...)` +
`pretrain(full_config, model_provider, ...)` (core 0.18) and `pretrain(full_config)` with a model
config instead of a provider (core 0.19). Tested against Megatron-LM core_v0.16.1, core_v0.18.0
and core_v0.19.0 and the development heads main and dev (tests/e2e, docs/testing.md). It may
also be launched from a tree that our patch already changed: each of its wrappers then acts
once.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import types
from functools import partial
from typing import Any

# For Megatron-LM's startup timing report, as pretrain_gpt.py takes it: before Megatron-LM's
# imports (main() makes them).
_PROGRAM_START_TIME = time.time()
ENV_DIR = "MEGATRON_LM_DIR"


def megatron_lm_dir() -> str:
    """The Megatron-LM checkout: MEGATRON_LM_DIR, else the current directory."""
    return os.path.abspath(os.environ.get(ENV_DIR) or os.getcwd())


def import_pretrain_gpt() -> types.ModuleType:
    """Megatron-LM's pretrain_gpt.py as a module, with its checkout first on sys.path (so that
    its `megatron` package is the one imported). A clear error when there is none."""
    folder = megatron_lm_dir()
    if not os.path.isfile(os.path.join(folder, "pretrain_gpt.py")):
        where = (
            f"{ENV_DIR}={folder}" if os.environ.get(ENV_DIR) else f"the current directory {folder}"
        )
        raise SystemExit(
            f"del_megatron.megatron.pretrain_gpt_del: no pretrain_gpt.py in {where}; run it from "
            f"a Megatron-LM checkout or set {ENV_DIR} to one"
        )
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    return importlib.import_module("pretrain_gpt")


def main() -> None:
    pretrain_gpt = import_pretrain_gpt()
    import megatron.training
    from megatron.core.enums import ModelType
    from megatron.training import arguments, get_args, get_tokenizer, pretrain

    from . import lm

    set_startup_timestamps = getattr(megatron.training, "set_startup_timestamps", None)
    if set_startup_timestamps is not None:  # as pretrain_gpt.py's main, once its imports are done
        set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())

    lm.install(pretrain_gpt)  # loss_func: telemetry, digit reduction; forward_step: counting
    extra = lm.chain_extra_args(
        getattr(pretrain_gpt, "add_modelopt_args", None)
        if getattr(pretrain_gpt, "has_nvidia_modelopt", False)
        else None,
        lm.add_arguments,
    )
    lm.help_with_flags(extra)
    builder = getattr(pretrain_gpt, "gpt_builder", None)
    base_provider = pretrain_gpt.model_provider
    if builder is not None:
        base_provider = partial(base_provider, builder)
    model_provider = lm.wrap_model_provider(base_provider, get_args, get_tokenizer)
    datasets = pretrain_gpt.train_valid_test_datasets_provider
    datasets.is_distributed = True
    common = dict(get_embedding_ranks=getattr(pretrain_gpt, "get_embedding_ranks", None))
    common = {k: v for k, v in common.items() if v is not None}
    restart = getattr(pretrain_gpt, "inprocess_restart", None)
    if restart is not None:  # as pretrain_gpt.py's main: NVRx in-process restart when asked
        pretrain, common["store"] = restart.maybe_wrap_for_inprocess_restart(pretrain)
    args_defaults = {"tokenizer_type": "GPT2BPETokenizer"}

    if hasattr(arguments, "parse_and_validate_args"):  # core >= 0.18
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        args = arguments.parse_and_validate_args(
            extra_args_provider=extra, args_defaults=args_defaults
        )
        # Settle the loss now, from the tokenizer the run will build: a tokenizer without
        # single-digit tokens stops here, before any training.
        lm.register_from_args(args, pretrain_gpt.build_tokenizer(args))
        if hasattr(pretrain_gpt, "gpt_config_from_args"):  # core >= 0.19: no model provider
            full_config = pretrain_cfg_container_from_args(args, _model_config(pretrain_gpt, args))
            provider = {}
        else:
            full_config = pretrain_cfg_container_from_args(args)
            provider = {"model_provider": base_provider}
        pretrain(
            full_config,
            train_valid_test_dataset_provider=datasets,
            model_type=ModelType.encoder_or_decoder,
            forward_step_func=pretrain_gpt.forward_step,
            **provider,
            **common,
        )
    else:  # core <= 0.17
        pretrain(
            datasets,
            model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_defaults=args_defaults,
            extra_args_provider=extra,
            **common,
        )
    lm.destroy_process_groups()


def _model_config(pretrain_gpt: types.ModuleType, args: Any) -> Any:
    """The model config pretrain_gpt.py's main builds (core >= 0.19), ModelOpt's when enabled."""
    modelopt = getattr(pretrain_gpt, "has_nvidia_modelopt", False)
    if modelopt and hasattr(pretrain_gpt, "maybe_enable_modelopt"):
        pretrain_gpt.maybe_enable_modelopt(args)
    if modelopt and getattr(args, "modelopt_enabled", False):
        return pretrain_gpt.gpt_config_from_args(
            args, model_config_cls=pretrain_gpt.ModelOptModelConfig
        )
    return pretrain_gpt.gpt_config_from_args(args)


if __name__ == "__main__":
    main()
