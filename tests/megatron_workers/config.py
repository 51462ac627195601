"""CFG: the DEL configuration the checks register (token reduction, the toy GPT's
vocabulary)."""

from __future__ import annotations

import del_megatron as dm

from ..cases import TOKEN_FORM
from ..gpt_helpers import GPT_VOCAB

CFG = dm.NumericalLossConfig(loss="del", alpha=0.5, vocab=GPT_VOCAB, **TOKEN_FORM)
