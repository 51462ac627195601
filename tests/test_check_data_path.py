"""`del-megatron check --data-path`: the digit share of Megatron indexed datasets, checked
against counts made here without the package's functions, and the claim behind the flags it
prints: under either reduction alpha is the weight on the mean term over digit targets."""

import argparse
import re

import numpy as np
import pytest
import torch

from del_megatron.tools.cli import main

SHARE = re.compile(r"^digit share of --data-path: (\S+) of label positions", re.M)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared demo dataset (digit-splitting SentencePiece): (prefix, tokenizer path)."""
    from del_megatron.tools.demo.data import PREFIX, prepare

    out = tmp_path_factory.mktemp("data")
    prepare(str(out), corpus=None, tokenizer=None, num_docs=400, num_eval=4, seed=3)
    return str(out / PREFIX), str(out / "tokenizer.model")


def _sp_digit_ids(tokenizer: str):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    return [sp.piece_to_id(str(d)) for d in range(10)], sp.get_piece_size()


def _stream(prefix: str) -> np.ndarray:
    """Every token of the dataset, its documents one after another (the .idx's own order)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))])


def _counts(prefix: str, digit_ids) -> tuple:
    """(digit targets, label positions): every token is one label position (GPTDataset packs
    documents back to back, so a document's first token is the target after the one before)."""
    tokens = _stream(prefix)
    return int(np.isin(tokens, digit_ids).sum()), tokens.size


def _write(prefix: str, docs) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def sparse(prepared, tmp_path_factory):
    """A second dataset of the same vocabulary with few digits (about 5% of the tokens)."""
    digit_ids, vocab_size = _sp_digit_ids(prepared[1])
    others = np.setdiff1d(np.arange(3, vocab_size), digit_ids)
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(300):
        n = int(rng.integers(5, 60))
        doc = rng.choice(others, n)
        digits = rng.random(n) < 0.05
        doc[digits] = rng.choice(digit_ids, int(digits.sum()))
        docs.append(doc)
    prefix = str(tmp_path_factory.mktemp("sparse") / "sparse_text_document")
    _write(prefix, docs)
    return prefix


def _check(capsys, tokenizer: str, *data_path: str, extra=()) -> str:
    assert main(["check", "--tokenizer", tokenizer, "--data-path", *data_path, *extra]) == 0
    return capsys.readouterr().out


def _printed_share(out: str) -> str:
    (share,) = SHARE.findall(out)
    return share


def test_the_share_is_the_count_of_digit_targets(prepared, capsys):
    prefix, tokenizer = prepared
    digits, tokens = _counts(prefix, _sp_digit_ids(tokenizer)[0])
    out = _check(capsys, tokenizer, prefix)
    assert _printed_share(out) == f"{digits / tokens:.4g}"
    assert f"{tokens:,} tokens in 400 of 400 documents of {prefix}" in out
    assert out.rstrip().endswith(f"--del-reduction token --del-digit-share {digits / tokens:.3g}")


def test_a_blend_weighs_each_dataset_as_megatron_does(prepared, sparse, capsys):
    prefix, tokenizer = prepared
    digit_ids = _sp_digit_ids(tokenizer)[0]
    (d1, t1), (d2, t2) = _counts(prefix, digit_ids), _counts(sparse, digit_ids)
    assert d1 / t1 > 3 * d2 / t2  # two different shares
    out = _check(capsys, tokenizer, "0.6", prefix, "1.4", sparse)  # weights 0.3 and 0.7
    assert _printed_share(out) == f"{0.3 * d1 / t1 + 0.7 * d2 / t2:.4g}"
    # No weights: Megatron blends by dataset size, so every token weighs the same.
    out = _check(capsys, tokenizer, prefix, sparse)
    assert _printed_share(out) == f"{(d1 + d2) / (t1 + t2):.4g}"
    assert "as Megatron blends prefixes without weights" in out


def test_a_sample_reads_whole_documents_spread_over_the_dataset(prepared, capsys):
    prefix, tokenizer = prepared
    digits, tokens = _counts(prefix, _sp_digit_ids(tokenizer)[0])
    out = _check(capsys, tokenizer, prefix, extra=["--sample-tokens", str(tokens // 4)])
    read = re.search(r"\(([\d,]+) tokens in ([\d,]+) of 400 documents", out)
    n_read, n_docs = (int(g.replace(",", "")) for g in read.groups())
    assert 0.2 * tokens < n_read < 0.3 * tokens and 60 < n_docs < 140
    assert abs(float(_printed_share(out)) - digits / tokens) < 0.03
    assert _check(capsys, tokenizer, prefix, extra=["--sample-tokens", str(tokens // 4)]) == out


def test_a_chunking_vocab_counts_every_digit_of_a_number_token(tmp_path):
    """Three-digit tokens count 3, two-digit ones 2 (ids: '0'..'9' 0-9, '.' 10, '00'..'99'
    11-110, '000'..'999' 111-1110, other tokens above)."""
    from del_megatron.digits.data_share import blend_share
    from del_megatron.digits.vocab import DigitVocab

    vocab = DigitVocab(range(10), [10], range(11, 1111))
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 1300, int(rng.integers(1, 40))) for _ in range(50)]
    prefix = str(tmp_path / "chunked")
    _write(prefix, docs)
    ids = np.concatenate(docs)
    digits = (ids < 10).sum() + 2 * ((ids >= 11) & (ids < 111)).sum()
    digits += 3 * ((ids >= 111) & (ids < 1111)).sum()
    assert blend_share([prefix], vocab).share == pytest.approx(digits / ids.size, rel=1e-12)


def _flags(out: str, start: str) -> list:
    (line,) = [ln for ln in out.splitlines() if ln.startswith(start)]
    return line[line.index("--numerical-loss") :].split()


def _config(flags):
    """NumericalLossConfig from `flags`, parsed with Megatron-LM's flag definitions."""
    from del_megatron.megatron.flags import add_arguments, config_from_args

    return config_from_args(add_arguments(argparse.ArgumentParser()).parse_args(flags))


@pytest.fixture
def one_thread():
    """The oracle runs thousands of ten-element ops: on a loaded machine, intra-op threads
    cost far more than they give (seconds, not milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_printed_flags_weigh_the_mean_digit_term_by_alpha(prepared, capsys, one_thread):
    """The weight on the mean DEL term over digit targets, measured with the fp64 oracle:
    w = (mean loss - mean CE) / (sum of terms / digit targets)."""
    from del_megatron import numerical_lm_loss
    from del_megatron.reference import reference_lm_loss

    prefix, tokenizer = prepared
    digit_ids, vocab_size = _sp_digit_ids(tokenizer)
    out = _check(capsys, tokenizer, prefix, extra=["--alpha", "0.2"])
    assert out.count("alpha is the weight on the mean term over digit targets") == 1
    digit_route = _flags(out, "add to pretrain_gpt.py or pretrain_hybrid.py: ")
    token_route = _flags(out, "or the token route")
    assert "--del-reduction digit" in " ".join(digit_route)
    share = float(token_route[token_route.index("--del-digit-share") + 1])
    old_route = list(token_route)  # the old meaning: the term over all loss tokens
    old_route[old_route.index("--del-digit-share") + 1] = "1"
    digit_cfg, token_cfg, old_cfg = map(_config, (digit_route, token_route, old_route))
    assert list(digit_cfg.vocab.digit_ids) == digit_ids == list(token_cfg.vocab.digit_ids)

    # 64 sequences of 256 labels, spread over the dataset's packed stream, as GPTDataset cuts
    stream = _stream(prefix)
    starts = np.linspace(0, stream.size - 257, 64).astype(np.int64)
    labels = torch.from_numpy(np.stack([stream[s + 1 : s + 257] for s in starts]))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 64, vocab_size, dtype=torch.float64, generator=generator)
    n_digits = int(np.isin(labels.numpy(), digit_ids).sum())
    batch_share = n_digits / labels.numel()
    ce, term = reference_lm_loss(labels, logits, digit_cfg.vocab, "del")
    mean_term = term.sum() / n_digits

    def weight(cfg) -> float:
        return float((numerical_lm_loss(labels, logits, cfg).mean() - ce.mean()) / mean_term)

    assert weight(digit_cfg) == pytest.approx(0.2, rel=1e-5)
    w_token = weight(token_cfg)
    assert w_token == pytest.approx(0.2 * batch_share / share, rel=1e-5)
    assert w_token == pytest.approx(0.2, rel=0.1)
    # Old: alpha x the batch's share on the mean digit term, far from alpha.
    w_old = weight(old_cfg)
    assert w_old == pytest.approx(0.2 * batch_share, rel=1e-5)
    assert abs(w_old - 0.2) > 0.5 * 0.2


@pytest.mark.parametrize(
    "data_path, message",
    [
        (["{missing}"], "{missing}.bin and {missing}.idx not found; a prefix is"),
        (["{prefix}.bin"], "did you mean '{prefix}'?"),
        (["{garbage}"], "'{garbage}': not a Megatron indexed dataset (bad header"),
        (["{truncated}"], "'{truncated}': not a Megatron indexed dataset"),
        (["0.3", "{prefix}", "0.7"], "odd weight/prefix list"),
        (["{prefix}", "0.3", "{prefix}", "0.7"], "mixes weights and prefixes"),
        (["0", "{prefix}", "1", "{prefix}"], "weight '0' must be a finite number > 0"),
        (["-0.5", "{prefix}", "1", "{prefix}"], "weight '-0.5' must be a finite number > 0"),
        (["nan", "{prefix}", "1", "{prefix}"], "weight 'nan' must be a finite number > 0"),
        (["1", "{prefix}", "inf", "{prefix}"], "weight 'inf' must be a finite number > 0"),
    ],
)
def test_bad_data_paths_are_one_line_errors(prepared, tmp_path, capsys, data_path, message):
    prefix, tokenizer = prepared
    names = dict(prefix=prefix, missing=str(tmp_path / "no_such_text_document"))
    names.update(garbage=str(tmp_path / "garbage"), truncated=str(tmp_path / "truncated"))
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as fh:
            content = fh.read()
        (tmp_path / ("garbage" + ext)).write_bytes(b"not a dataset")
        (tmp_path / ("truncated" + ext)).write_bytes(content[:12])
    argv = ["check", "--tokenizer", tokenizer, "--data-path"]
    assert main(argv + [p.format(**names) for p in data_path]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("del-megatron check: error: --data-path")
    assert message.format(**names) in captured.err


def test_a_data_path_needs_a_tokenizer_with_digit_ids(prepared, capsys):
    """A tokenizer that cannot serve DEL exits 1 (check's code for it), --data-path or not."""
    argv = ["check", "--tokenizer-type", "NullTokenizer", "--data-path", prepared[0]]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == [
        "NullTokenizer has no text, so no digit tokens can be found in it: pass "
        "--del-digit-token-ids with the ids your data uses for '0'..'9' (and "
        "--del-decimal-point-token-ids for '.')",
        "--data-path not measured: counting digit targets needs a tokenizer with digit ids",
    ]
