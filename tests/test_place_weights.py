"""place_weights against the table of docs/DEL.md, its run rules, and the reference; DIST2's
place weights against its authors' grouping (docs/DEL.md, "DIST2Loss")."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import del_megatron as dm
from del_megatron.digits.numbers import dist2_weights, number_layout
from del_megatron.reference import reference_place_weights

# Token ids of a toy tokenizer: digits 0..9 are ids 20..29, '.' is 7 (and 8, a second '.' id).
VOCAB = dm.DigitVocab(digit_ids=range(20, 30), decimal_point_ids=[7, 8])
SPACE, EOD, IGNORE = 3, 0, -100


def encode(text: str):
    ids = {".": 7, ",": 8, " ": SPACE, "|": EOD, "_": IGNORE}
    return [ids[c] if c in ids else 20 + int(c) for c in text]


def weights_of(text: str):
    return dm.place_weights(torch.tensor([encode(text)]), VOCAB)[0].tolist()


F1, F2, F3, F4, F5 = (1.02 ** -(d + 1) for d in range(1, 6))

SPEC_TABLE = [
    ("5", [2]),
    ("123", [6, 4, 2]),
    ("12.34", [4, 2, 0, 0.96117, 0.94232]),
    ("0.5", [2, 0, 0.96117]),
    ("3.14159", [2, 0, 0.96117, 0.94232, 0.92385, 0.90573, 0.88797]),
    ("1.2.3", [2, 0, 0.96117, 0, 0.92385]),
    (".5", [0, 2]),
    ("12.", [4, 2, 0]),
]


@pytest.mark.parametrize("text,expected", SPEC_TABLE)
def test_spec_table(text, expected):
    assert weights_of(text) == pytest.approx(expected, abs=5e-6)


def test_fraction_weights_are_exact_powers():
    expected = torch.tensor([2, 0, F1, F2, F3, F4, F5], dtype=torch.float32).tolist()
    assert weights_of("3.14159") == expected  # correctly rounded to fp32


def test_runs_break_at_non_numbers_eod_ignored_and_row_ends():
    # "12 3" is two numbers; '|' is EOD; '_' an ignored label; the row end closes "45".
    assert weights_of("12 3|7_89 45") == pytest.approx([4, 2, 0, 2, 0, 2, 0, 4, 2, 0, 4, 2])
    rows = torch.tensor([encode("123"), encode("456")])
    assert dm.place_weights(rows, VOCAB).tolist() == [[6, 4, 2], [6, 4, 2]]


def test_second_decimal_point_id_counts_and_run_starting_with_point_is_integer():
    assert weights_of("1,5") == pytest.approx([2, 0, F1])
    # A run that starts with '.' has no fractional part: points occupy places, weigh 0.
    assert weights_of(".7.") == pytest.approx([0, 4, 0])
    assert weights_of("..5") == pytest.approx([0, 0, 2])


def test_ignored_labels_weigh_zero_and_other_ignore_index():
    labels = torch.tensor([[21, -1, 22]])
    assert dm.place_weights(labels, VOCAB, ignore_index=-1).tolist() == [[2, 0, 2]]


def dist2_weights_of(text: str):
    return dist2_weights(number_layout(torch.tensor([encode(text)]), VOCAB))[0, :, 0].tolist()


# DIST2 as its authors ran it: only digits form runs; a '.' ends one, and the fractional digits
# form their own run, weighed like an integer from its last digit (docs/DEL.md).
DIST2_TABLE = [
    ("3.14159", [1, 0, 5, 4, 3, 2, 1]),  # the example of docs/DEL.md
    ("5", [1]),
    ("123", [3, 2, 1]),
    ("12.34", [2, 1, 0, 2, 1]),
    ("0.5", [1, 0, 1]),
    ("123.45 6", [3, 2, 1, 0, 2, 1, 0, 1]),
    ("1.2.3", [1, 0, 1, 0, 1]),
    (".5", [0, 1]),
    ("12.", [2, 1, 0]),
    ("..25", [0, 0, 2, 1]),
    ("1,234", [1, 0, 3, 2, 1]),  # the second '.' id splits too
    ("12|34", [2, 1, 0, 2, 1]),  # EOD ends a run
    ("12_34", [2, 1, 0, 2, 1]),  # so does an ignored label
]


@pytest.mark.parametrize("text,expected", DIST2_TABLE)
def test_dist2_weights_follow_its_authors_grouping(text, expected):
    assert dist2_weights_of(text) == expected
    labels = torch.tensor([encode(text)])
    assert reference_place_weights(labels, VOCAB, scheme="dist2")[0].tolist() == expected


def test_dist2_runs_stop_at_packed_document_starts():
    labels = torch.tensor([encode("1234")])
    doc_start = torch.tensor([[True, False, True, False]])
    layout = number_layout(labels, VOCAB, doc_start=doc_start)
    assert dist2_weights(layout)[0, :, 0].tolist() == [2, 1, 2, 1]


def test_compat_switch_joins_numbers_across_ignored_positions():
    labels = torch.tensor([encode("12__34")])
    fixed = reference_place_weights(labels, VOCAB)[0].tolist()
    public_code = reference_place_weights(labels, VOCAB, join_across_ignored=True)[0].tolist()
    assert fixed == [4, 2, 0, 0, 4, 2]
    assert public_code == [8, 6, 0, 0, 4, 2]


def test_vectorised_without_host_sync():
    # Meta tensors hold no data: a .item(), .tolist() or data-dependent shape would raise.
    labels = torch.tensor([encode("1.5 22")]).to("meta")
    weights = dm.place_weights(labels, VOCAB)
    assert weights.device.type == "meta"
    assert weights.dtype == torch.float32 and weights.shape == labels.shape


label_alphabet = st.sampled_from([20, 21, 25, 29, 7, 8, SPACE, EOD, IGNORE])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(label_alphabet, min_size=1, max_size=40), min_size=1, max_size=4))
def test_property_matches_reference(rows):
    width = max(len(r) for r in rows)
    labels = torch.tensor([r + [SPACE] * (width - len(r)) for r in rows])
    ours = dm.place_weights(labels, VOCAB).double()
    torch.testing.assert_close(ours, reference_place_weights(labels, VOCAB), rtol=1e-7, atol=0)
    layout = number_layout(labels, VOCAB)
    ref_dist2 = reference_place_weights(labels, VOCAB, scheme="dist2")
    torch.testing.assert_close(dist2_weights(layout)[..., 0].double(), ref_dist2, rtol=0, atol=0)
    public_code = reference_place_weights(labels, VOCAB, scheme="dist2", join_across_ignored=True)
    assert torch.equal(public_code, ref_dist2) or bool((labels == IGNORE).any())
