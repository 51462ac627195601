"""What a number token is: one of the ten digits '0'..'9' or, in a vocabulary that cuts numbers
into chunks of up to three digits, one of the 1,100 tokens "00".."99" then "000".."999"; and the
codes DigitVocab.token_codes gives them. Plain constants, no torch, nothing from this package."""

NUM_DIGITS = 10

# Most digits a number token holds in a chunking vocabulary, and how many multi-digit tokens it
# has: "00".."99" then "000".."999" (DigitVocab.multi_digit_ids, in that order).
MAX_TOKEN_DIGITS = 3
NUM_MULTI_DIGIT = 100 + 1000

# Codes of a label in DigitVocab.token_codes: a number token of L digits and value v is
# L * CODE_LENGTH + v; decimal points and other tokens are these.
CODE_LENGTH = 1000
CODE_OTHER = -1
CODE_POINT = -2


def multi_digit_text(index: int) -> str:
    """The text of multi_digit_ids[index]: "00".."99" for 0..99, "000".."999" for 100..1099."""
    return f"{index:02d}" if index < 100 else f"{index - 100:03d}"
