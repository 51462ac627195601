"""README's pretrain_gpt.py command lines parse with Megatron-LM's own parse_args and our flags
(megatron-core 0.19's megatron.training: tests/conftest.py collects this file where it
imports)."""

import argparse
import sys

from del_megatron.megatron.lm import add_arguments

from .docs_snippets import DOCS, command_lines


def test_every_pretrain_gpt_line_parses_with_megatron_lms_parser(monkeypatch):
    """The flags of README's torchrun line, Megatron-LM's and ours, through Megatron-LM's own
    parse_args with our add_arguments (megatron-core 0.19's megatron.training)."""
    from megatron.training import arguments

    lines = [argv for doc in DOCS for argv in command_lines(doc) if "pretrain_gpt.py" in argv]
    assert lines
    for argv in lines:
        flags = argv[argv.index("pretrain_gpt.py") + 1 :]
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
        args = arguments.parse_args(extra_args_provider=add_arguments)
        assert args.numerical_loss == "del" and args.tensor_model_parallel_size == 4
        add_arguments(argparse.ArgumentParser()).parse_known_args(flags)
