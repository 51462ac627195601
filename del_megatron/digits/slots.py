"""Slot logits of a chunking vocabulary (docs/DEL.md, "Tokenizers that put up to three digits in a
token"), formed from partial sums that add up over vocab shards.

Two rules pick each slot's candidate tokens (RULES). "any": z^(j)_k = logsumexp of the logits of
every number token with at least j digits whose first j - 1 digits are the label's and whose
j-th digit is k. "length": the same over the tokens of the label's own number of digits L only
(the groups below; length_conditioned then adds the per-row offset that makes them
prefix-conditional, outside the kernels). With the 1,110 number tokens' logits laid out by first
digit, x [n, 10, 111] (row d: "d", "d0".."d9", "d00".."d99"; PLACES_BY_POSITION), and the
label's first two digits p, q:

    "any"   z^(1)_k = logsumexp(x[k, :])                                   111 tokens a digit
            z^(2)_k = logsumexp(x[p, 1 + k], x[p, 11 + 10k .. 20 + 10k])    11 tokens
            z^(3)_k = x[p, 11 + 10q + k]                                     one token
    "length" z^(1)_k = logsumexp of row k's L-digit tokens (1, 10 or 100)
            z^(2)_k = x[p, 1 + k] (L = 2), logsumexp(x[p, 11 + 10k .. 20 + 10k]) (L = 3)
            z^(3)_k = x[p, 11 + 10q + k]

A shard holds some of the tokens (the others are -inf in its x). It gives the maxima of its
slot-1 and slot-2 groups (local_maxima: [n, 20], for the MAX all-reduce), then, relative to the
global maxima, its sums of exp and its slot-3 logits (partial_sums: [n, 30], for the SUM
all-reduce); finish() turns the reduced sums into z. gradient() is the gradient of z
back to the layout. Plain torch, nothing read on the host.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .vocab import CODE_LENGTH, NUM_DIGITS

# How a slot's candidate tokens are chosen: "length" (the label's number of digits only, then
# prefix-conditional: docs/DEL.md) or "any" (every length that has the slot, del-megatron 0.2).
# The entry points that read a tokenizer give a chunking one slots only when a rule is asked for
# (--del-slot-logits); the default there is DEL on its single-digit tokens (docs/results.md).
RULES = ("length", "any")
DEFAULT_SLOT_LOGITS = "length"

# Places of the number tokens in DigitVocab.number_tokens() order: digit d at d, two-digit
# value v at TWO + v, three-digit value v at THREE + v (leading zeros kept: "07" is TWO + 7).
TWO, THREE = NUM_DIGITS, NUM_DIGITS + 100
# A row of the layout: the digit, its ten two-digit tokens, its hundred three-digit ones.
ROW = 111
TWO_DIGITS, THREE_DIGITS = slice(1, 11), slice(11, ROW)
# Where a row's tokens of each length sit: LENGTH_OF[c] is the digits of the token at column c.
LENGTH_OF = (1,) + (2,) * 10 + (3,) * 100
SLOTS = 3
# Per row: slot-1 and slot-2 maxima (local_maxima); slot sums and slot-3 logits (partial_sums).
MAXIMA, SUMS = 2 * NUM_DIGITS, SLOTS * NUM_DIGITS


def _places_by_position() -> Tuple[int, ...]:
    places = []
    for d in range(NUM_DIGITS):
        places += [d] + [TWO + 10 * d + k for k in range(10)]
        places += [THREE + 100 * d + k for k in range(100)]
    return tuple(places)


# The place (number_tokens() order) at each of the layout's 1,110 positions.
PLACES_BY_POSITION = _places_by_position()


def label_prefix(target: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int64 [n, 4] for target [n] (codes: DigitVocab.token_codes): the label's first two digits
    (p, q; 0 where it has no such digit), its position in the layout (-1 where the label is not
    a number token) and its number of digits (0 where it is not a number token)."""
    other = codes.numel() - 1
    ids = torch.where((target >= 0) & (target < other), target, other)
    code = codes[ids]
    count = torch.where(code >= CODE_LENGTH, code // CODE_LENGTH, 0)
    value = torch.where(count > 0, code % CODE_LENGTH, 0)
    first_unit = torch.where(count == 3, 100, torch.where(count == 2, 10, 1))
    p = value // first_unit
    q = torch.where(count >= 2, (value // (first_unit // 10).clamp(min=1)) % 10, 0)
    within = torch.where(count == 3, 11 + 10 * q + value % 10, torch.where(count == 2, 1 + q, 0))
    position = torch.where(count > 0, ROW * p + within, -1)
    return torch.stack([p, q, position, count], dim=-1)


def _block(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[n, 111]: the layout row of each row's first digit p [n]."""
    return x.view(-1, NUM_DIGITS, ROW).gather(1, p.view(-1, 1, 1).expand(-1, 1, ROW)).squeeze(1)


def _third(block: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[n, 10]: the three-digit tokens "p q 0".."p q 9" of block [n, 111]."""
    three = block[:, THREE_DIGITS].view(-1, NUM_DIGITS, NUM_DIGITS)
    return three.gather(1, q.view(-1, 1, 1).expand(-1, 1, NUM_DIGITS)).squeeze(1)


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"slot_logits must be one of {RULES}, got {rule!r}")
    return rule


def _row_lengths(device: torch.device) -> torch.Tensor:
    """int64 [111]: the digits of the token at each column of a layout row (LENGTH_OF)."""
    column = torch.arange(ROW, device=device)
    return 1 + (column >= TWO_DIGITS.start).long() + (column >= THREE_DIGITS.start).long()


def _group_length(prefix: torch.Tensor) -> torch.Tensor:
    """[n] the token length of each row's "length" groups: the label's, 3 off number tokens
    (groups that are never used but must stay finite)."""
    length = prefix[:, 3]
    return torch.where(length > 0, length, 3)


def _of_length(x: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """[n, 10, 111] layout values x [n, 1110] with -inf but at each row's label-length tokens."""
    keep = _row_lengths(x.device) == _group_length(prefix).unsqueeze(-1)  # [n, 111]
    return x.view(-1, NUM_DIGITS, ROW).masked_fill(~keep.unsqueeze(1), float("-inf"))


def _two_digit_label(prefix: torch.Tensor) -> torch.Tensor:
    """bool [n, 1]: the label has two digits (its "length" slot-2 groups are single tokens)."""
    return (prefix[:, 3] == 2).unsqueeze(-1)


def _slot2_inputs(block: torch.Tensor, prefix: torch.Tensor, rule: str):
    """(two [n, 10], three [n, 10, 10]): the slot-2 candidates of the label's first-digit row
    block [n, 111], -inf where the rule leaves a token out."""
    two = block[:, TWO_DIGITS]
    three = block[:, THREE_DIGITS].view(-1, NUM_DIGITS, NUM_DIGITS)
    if rule == "length":
        is_two = _two_digit_label(prefix)
        two = two.masked_fill(~is_two, float("-inf"))
        three = three.masked_fill(is_two.unsqueeze(-1), float("-inf"))
    return two, three


def local_maxima(x: torch.Tensor, prefix: torch.Tensor, rule: str = "any") -> torch.Tensor:
    """[n, 20] the maxima of this shard's slot-1 groups, then of its slot-2 groups (-inf where it
    holds none of a group), from layout values x [n, 1110] and prefix [n, 4] (label_prefix)."""
    rows = _of_length(x, prefix) if rule == "length" else x.view(-1, NUM_DIGITS, ROW)
    m1 = rows.amax(dim=-1)
    two, three = _slot2_inputs(_block(x, prefix[:, 0]), prefix, rule)
    return torch.cat([m1, torch.maximum(two, three.amax(dim=-1))], dim=-1)


def partial_sums(
    x: torch.Tensor,
    prefix: torch.Tensor,
    maxima: torch.Tensor,
    held: Optional[torch.Tensor] = None,
    rule: str = "any",
) -> torch.Tensor:
    """[n, 30]: this shard's sums of exp(x - the group's global maximum) for slots 1 and 2, then
    its slot-3 logits (0 for tokens it does not hold). maxima [n, 20]: local_maxima's, reduced
    over the shards. held: bool [1110] layout positions this shard holds (None: all)."""
    n = x.size(0)
    m1, m2 = maxima[:, :NUM_DIGITS], maxima[:, NUM_DIGITS:]
    rows = _of_length(x, prefix) if rule == "length" else x.view(n, NUM_DIGITS, ROW)
    s1 = torch.sub(rows, m1.unsqueeze(-1)).exp_().sum(dim=-1)
    block = _block(x, prefix[:, 0])
    two, three = _slot2_inputs(block, prefix, rule)
    s2 = torch.exp(two - m2) + torch.exp(three - m2.unsqueeze(-1)).sum(dim=-1)
    x3 = _third(block, prefix[:, 1])
    if held is not None:
        held_block = _block(held.expand(n, -1), prefix[:, 0])
        x3 = torch.where(_third(held_block, prefix[:, 1]), x3, 0.0)
    return torch.cat([s1, s2, x3], dim=-1)


def finish(sums: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
    """[n, 30] the slot logits z^(1) | z^(2) | z^(3) from the reduced partial sums [n, 30] and
    maxima [n, 20] (for "length", the groups' before length_conditioned's offsets)."""
    return torch.cat([maxima + torch.log(sums[:, :MAXIMA]), sums[:, MAXIMA:]], dim=-1)


def length_conditioned(z: torch.Tensor, digit: torch.Tensor) -> torch.Tensor:
    """The "length" rule's slot logits [m, 3, 10] from its groups' z [m, 3, 10] (finish) and the
    label's digits [m, 3] (docs/DEL.md): slot j >= 2 becomes log P(digit j = k | the label's
    earlier digits, its length) lifted to one level,

        z^(j)_k = zC^(j)_k - zC^(j-1)_(s_(j-1)) + logsumexp_k zC^(1)_k,

    since logsumexp_k zC^(j)_k = zC^(j-1)_(s_(j-1)). Differentiable; slots past the label's last
    digit hold values to mask, as the groups' do."""
    level = torch.logsumexp(z[:, 0], dim=-1).view(-1, 1, 1)
    earlier = z[:, :-1].gather(-1, digit[:, :-1].unsqueeze(-1))  # [m, 2, 1]
    return torch.cat([z[:, :1], z[:, 1:] - earlier + level], dim=1)


def gradient(
    x: torch.Tensor,
    prefix: torch.Tensor,
    z: torch.Tensor,
    grad_z: Optional[torch.Tensor] = None,
    softmax: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    rule: str = "any",
) -> torch.Tensor:
    """[n, 1110] d(loss)/d(x) over the layout, given the slot logits z [n, 30] that x [n, 1110]
    gave: what their upstream gradient grad_z [n, 30] gives (grad_z^(j)_k * exp(x_t -
    z^(j)_k) for every slot-j candidate t of digit k; slot 3: grad_z^(3)_k itself), plus with
    softmax = (scale, shift, log_sum_exp), each [n], the cross-entropy's scale * exp(x - shift -
    log_sum_exp) (without the target's -scale).

    Under "any" both share one exp over the layout: exp(x - shift - log_sum_exp) = exp(x -
    z^(1)_k) * exp(z^(1)_k - shift - log_sum_exp), where x_t <= z^(1)_k for t in digit k's
    group and z^(1)_k <= shift + log_sum_exp, so neither factor overflows. Under "length" a
    row's slot-1 group leaves tokens out, so the two take an exp each."""
    n = x.size(0)
    z1 = z[:, :NUM_DIGITS]
    g1 = None if grad_z is None else grad_z[:, :NUM_DIGITS].to(x.dtype)
    rows = x.view(n, NUM_DIGITS, ROW)
    if rule == "length":
        if softmax is not None:
            scale, shift, log_sum_exp = softmax
            grad = torch.sub(rows, (shift + log_sum_exp).view(-1, 1, 1)).exp_()
            grad.mul_(scale.view(-1, 1, 1))
        else:
            grad = torch.zeros_like(rows)
        if g1 is not None:
            term = torch.sub(_of_length(x, prefix), z1.unsqueeze(-1)).exp_()
            grad.addcmul_(term, g1.unsqueeze(-1))
    else:
        coef = torch.zeros_like(z1) if g1 is None else g1
        if softmax is not None:
            scale, shift, log_sum_exp = softmax
            ratio = torch.exp(z1 - shift.unsqueeze(-1) - log_sum_exp.unsqueeze(-1))
            coef = coef + scale.unsqueeze(-1) * ratio
        grad = torch.sub(rows, z1.unsqueeze(-1)).exp_()
        grad.mul_(coef.unsqueeze(-1))
    if grad_z is not None:
        _add_later_slots_(grad, x, prefix, z, grad_z.to(x.dtype), rule)
    return grad.view(n, -1)


def _add_later_slots_(
    grad: torch.Tensor,
    x: torch.Tensor,
    prefix: torch.Tensor,
    z: torch.Tensor,
    grad_z: torch.Tensor,
    rule: str,
) -> None:
    """grad [n, 10, 111] += the gradient of slots 2 and 3, in the label's first digit's row."""
    n = x.size(0)
    g2, g3 = grad_z[:, NUM_DIGITS:MAXIMA], grad_z[:, MAXIMA:]
    z2 = z[:, NUM_DIGITS:MAXIMA]
    p, q = prefix[:, 0], prefix[:, 1]
    two, three = _slot2_inputs(_block(x, p), prefix, rule)
    two = torch.exp(two - z2) * g2
    three = torch.exp(three - z2.unsqueeze(-1)) * g2.unsqueeze(-1)
    three.scatter_add_(1, q.view(-1, 1, 1).expand(-1, 1, NUM_DIGITS), g3.unsqueeze(1))
    extra = torch.cat([torch.zeros_like(two[:, :1]), two, three.view(n, -1)], dim=-1)
    grad.scatter_add_(1, p.view(-1, 1, 1).expand(-1, 1, ROW), extra.unsqueeze(1))
