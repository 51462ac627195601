"""The code README.md and docs/api.md show runs: every Python block executes on small inputs
(labels, logits, a tokenizer the tests already have), and every command line's flags parse with
the real parsers: `del-megatron check`'s here, Megatron-LM's own with our flags added in
tests/test_docs_megatron_flags.py (where megatron.training imports: the Python 3.12
environment). README's Megatron-Bridge block runs in the Bridge layer
(tests/bridge_workers/readme.py)."""

import pytest
import torch

from .docs_snippets import (
    DOCS,
    command_lines,
    docstring_examples,
    example_commands,
    python_blocks,
    substitute,
)
from .sentencepiece_models import train_sentencepiece_models

S = 16


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    return train_sentencepiece_models(tmp_path_factory.mktemp("sp"))["split"]


@pytest.fixture(scope="module")
def paths(sentencepiece_model, tmp_path_factory):
    """The docs' example paths -> files the tests have: a SentencePiece model for Llama-2's,
    Llama-3.2's tokenizer folder for a Hugging Face model's."""
    from .test_tokenizers import LLAMA3_TOKENIZER

    return {
        "/data/llama2/tokenizer.model": sentencepiece_model,
        "/data/Qwen2.5-7B": str(LLAMA3_TOKENIZER.parent),
    }


def namespace(sentencepiece_model) -> dict:
    """The inputs a block uses and does not define: labels [1, S] with numbers in them, logits
    [S, 1, V], a tokenizer, packed-sequence bounds, the output layer's input and weight."""
    import sentencepiece as spm

    tok = spm.SentencePieceProcessor(model_file=sentencepiece_model)
    ids = tok.encode("x = 12.5 + 407, then 3", out_type=int)
    labels = torch.tensor([(ids * S)[:S]])
    vocab_size, hidden = tok.get_piece_size(), 8
    gen = torch.Generator().manual_seed(0)
    return {
        "tok": tok,
        "labels": labels,
        "logits": torch.randn(S, 1, vocab_size, generator=gen),
        "tp_group": None,
        "cp_group": None,
        "cu": torch.tensor([0, 7, S], dtype=torch.int32),
        "hidden": torch.randn(S, 1, hidden, generator=gen),
        "weight": torch.randn(vocab_size, hidden, generator=gen),
        "loss_mask": torch.ones(1, S),
    }


@pytest.mark.parametrize("doc", DOCS)
def test_every_python_block_runs(doc, sentencepiece_model, paths):
    blocks = [b for b in python_blocks(doc) if "megatron.bridge" not in b]
    assert blocks, doc
    scope = namespace(sentencepiece_model)
    for block in blocks:
        for shown, real in paths.items():
            block = block.replace(f'"{shown}"', repr(real))
        exec(compile(block, doc, "exec"), scope)
        loss = scope.get("loss")
        assert loss is None or bool(torch.isfinite(loss).all()), block


def commands(program: str):
    return [argv for doc in DOCS for argv in command_lines(doc) if program in argv[:4]]


def test_every_check_line_parses_and_runs(paths, capsys):
    from del_megatron.tools.cli import build_parser, main

    lines = commands("check")
    assert len(lines) >= 2
    for argv in lines:
        argv = substitute(argv[1:], paths)  # after `del-megatron`
        build_parser().parse_args(argv)
        assert main(argv) == 0, argv
    capsys.readouterr()


# The weights an example may show: the default and the ones a paper's run applied (DEL 0.1,
# 1.28, 2.56; NTL's 0.3), so that an example never teaches a stale unit (docs/DEL.md).
EXAMPLE_WEIGHTS = {0.1, 0.3, 1.28, 2.56}


def test_every_docstring_example_is_held(sentencepiece_model):
    """Every command line or Python example in a docstring of the package: a module it runs
    exists; del-megatron lines parse with its parser; a --numerical-loss line's flags pass
    Megatron-LM's parser as our flags extend it (refusals included); a Python example's calls of
    del_megatron bind to the real signatures, with settings NumericalLossConfig accepts and a
    weight the docs teach."""
    import argparse
    import ast
    import importlib
    import importlib.util
    import inspect

    from del_megatron.config import check_settings
    from del_megatron.megatron import lm
    from del_megatron.tools.cli import build_parser

    examples = docstring_examples()
    kinds = {kind for _, kind, _ in examples}
    assert kinds == {"command", "python"} and len(examples) >= 8, examples
    for where, kind, block in examples:
        if kind == "command":
            for argv in example_commands(block):
                if "-m" in argv:
                    module = argv[argv.index("-m") + 1]
                    assert importlib.util.find_spec(module) is not None, (where, module)
                if argv[0] == "del-megatron":
                    mine = {"tok.model": sentencepiece_model}
                    build_parser().parse_args([mine.get(a, a) for a in argv[1:]])
                if "--numerical-loss" in argv:
                    flags = argv[argv.index("--numerical-loss") :]
                    lm.add_arguments(argparse.ArgumentParser()).parse_args(flags)
            continue
        tree = ast.parse(block)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("del_megatron"):
                module = importlib.import_module(node.module)
                imported.update({a.asname or a.name: getattr(module, a.name) for a in node.names})
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in imported
        ]
        assert imported and calls, (where, block)
        for call in calls:
            fn = imported[call.func.id]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            inspect.signature(fn).bind(*[object()] * len(call.args), **kwargs)
            settings = {k: v for k, v in kwargs.items() if k in ("loss", "alpha", "reduction")}
            check_settings(**settings)
            assert kwargs.get("alpha", 0.1) in EXAMPLE_WEIGHTS, (where, kwargs)
