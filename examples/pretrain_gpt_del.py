"""Megatron-LM's pretrain_gpt.py with the del_megatron numerical losses: a drop-in.

Run it from a Megatron-LM checkout (or set MEGATRON_LM_DIR) exactly like pretrain_gpt.py, with
the extra flags:

    torchrun ... examples/pretrain_gpt_del.py <usual pretrain_gpt.py flags> \
        --numerical-loss del --del-alpha 0.01 [--del-reduction token|digit]

Digit ids come from the run's tokenizer unless --del-digit-token-ids is given. Works with
Megatron-LM's argument APIs: `pretrain(extra_args_provider=...)` (core <= 0.17),
`parse_and_validate_args(...)` + `pretrain(full_config, model_provider, ...)` (core 0.18) and
`pretrain(full_config)` with a model config instead of a provider (core 0.19). Tested against
Megatron-LM core_v0.16.1, core_v0.18.0 and core_v0.19.0 (tests/e2e).
"""

import os
import sys
from functools import partial

sys.path.insert(0, os.environ.get("MEGATRON_LM_DIR", os.getcwd()))

import pretrain_gpt  # noqa: E402  (Megatron-LM's own script, as a module: its main does not run)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import arguments, get_args, get_tokenizer, pretrain  # noqa: E402

from del_megatron.megatron import lm  # noqa: E402


def main() -> None:
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
            full_config = pretrain_cfg_container_from_args(
                args, pretrain_gpt.gpt_config_from_args(args)
            )
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


if __name__ == "__main__":
    main()
