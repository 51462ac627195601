"""The "linear" kernel: the output-layer matmul and the recompute kernel's two passes, chunked
over tokens, so that the [N, V/tp] logits never exist.

Each chunk of rows is multiplied out in the input dtype (as the output layer gives its logits),
reduced to its cross-entropy, digit logits and log normaliser by the recompute kernel's passes
(a few MiB converted to fp32 at a time, so a bf16 chunk has no fp32 twin), and dropped.

The gradients take one of two routes (plan.weight_gradient):
- "forward": given the per-row weights the caller reduces ce by (Megatron's loss mask), forward
  also turns each chunk, in place, into its gradient and multiplies it into grad_hidden [N, h]
  and into an fp32 grad_weight accumulator [V/tp, h] held until backward, which only scales
  them (3 matmuls in all, the materialised path's count). The upstream gradient of ce must then
  be proportional to those weights (checked on the device: NOT_PROPORTIONAL). Without them, or
  on a second backward, backward multiplies each chunk out again.
- "backward": backward multiplies the logits out again one vocab tile [N, t] at a time, turns
  each into its gradient and multiplies it into its rows of grad_weight (written once, in the
  weight's dtype) and into an fp32 grad_hidden [N, h] (4 matmuls; nothing [V/tp, h] but the
  gradient itself; any upstream gradient).
"auto" takes "forward" while its buffers are small beside the materialised logits or no larger
than the "backward" route's: resolve_weight_gradient is the rule.

A caller that keeps its own fp32 gradient accumulator for the weight (Megatron's main_grad under
gradient-accumulation fusion) hands it over with `weight_gradient_into(...)`: backward then adds
the weight's gradient there, its products formed in the accumulator's dtype (never rounded to the
weight's) and added by one GEMM a token chunk where the device has one: Megatron's fused
wgrad_gemm_accum_fp32 where it imports, else torch.addmm(..., out_dtype=float32) in place
(exact_product_route). It returns what the caller's protocol asks for in place of the gradient.

Per chunk the collectives are those of the recompute kernel (the shard-size check rides on the
first chunk's MAX); backward adds one SUM all-reduce of grad_hidden [N, h] over the
tensor-parallel group, as Megatron's ColumnParallelLinear does.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..device import check_on_device
from . import recompute
from .common import KernelPlan, NumberColumns, TargetRows, compute_dtype, rows_per_chunk

# Rows of a chunk when the caller gives no chunk size: as many as LINEAR_CHUNK_BYTES of fp32
# logits hold (the chunk itself is in the input dtype: 128 MiB of bf16), and no more than
# 1/LINEAR_MIN_CHUNKS of the tokens, so that a chunk stays small beside the [N, V/tp] logits and
# gradient of the materialised path (1/16 of them) at any vocab shard size.
LINEAR_CHUNK_BYTES = 256 * 2**20
LINEAR_MIN_CHUNKS = 8

NOT_PROPORTIONAL = (
    "numerical_linear_loss, 'forward' weight-gradient route: the upstream gradient is not "
    "proportional to loss_mask (reduce the loss as sum(loss * loss_mask) times a scalar, as "
    "Megatron's loss_func does), or pass weight_gradient='backward', or no loss_mask"
)

# Bytes of a gradient product (grad_weight's, or grad_hidden's on the "backward" route) formed
# at a time when it is added to an accumulator of another dtype (a bf16 product into an fp32
# accumulator; on a CPU the add makes an fp32 copy of it too).
WEIGHT_SLICE_BYTES = 8 * 2**20

# How far (in units of the dtype's eps, relative to the largest entry) the upstream gradient of
# ce may stray from c * ce_weights for the gradients formed in forward to be used.
SCALE_TOLERANCE = 32


WEIGHT_GRADIENTS = ("auto", "forward", "backward")
DEFAULT_WEIGHT_GRADIENT = "auto"

FP16_FORWARD = (
    "the 'forward' weight-gradient route forms its gradient products in forward, before the "
    "loss scale is applied, and in fp16 they can overflow where the materialised path's do not "
    "(a dynamic loss scale cannot cure that); in fp16 use the 'backward' route (what 'auto' "
    "takes), or bf16"
)


class WeightGradientSink(NamedTuple):
    """Where backward puts the weight's gradient instead of returning it: `accumulator`
    [V/tp, h] (the caller's, e.g. Megatron's fp32 main_grad) gets it added, and backward
    returns `returned()` as the weight's gradient (None, or a placeholder the caller's protocol
    wants). `weight` is the tensor whose gradient it takes."""

    weight: torch.Tensor
    accumulator: torch.Tensor
    returned: Callable[[], Optional[torch.Tensor]]


_weight_gradient_sink: contextvars.ContextVar = contextvars.ContextVar(
    "del_megatron_weight_gradient_sink", default=None
)


@contextlib.contextmanager
def weight_gradient_into(sink: Optional[WeightGradientSink]) -> Iterator[None]:
    """The LinearDigitCrossEntropy calls made inside (with sink.weight as their weight) put
    that weight's gradient into sink.accumulator in backward (WeightGradientSink). None: no
    sink (the gradient is returned as usual)."""
    token = _weight_gradient_sink.set(sink)
    try:
        yield
    finally:
        _weight_gradient_sink.reset(token)


def _slab(extent: int, across: int) -> int:
    """How much of `extent` one piece takes: LINEAR_CHUNK_BYTES of fp32 [piece, across] at most,
    and no more than 1/LINEAR_MIN_CHUNKS of extent."""
    return max(1, min(rows_per_chunk(across, LINEAR_CHUNK_BYTES), -(-extent // LINEAR_MIN_CHUNKS)))


def default_chunk_tokens(local_vocab: int, tokens: int) -> int:
    """Rows of a chunk when the caller gives no chunk size, for `tokens` rows in all."""
    return _slab(tokens, local_vocab)


def default_tile_columns(local_vocab: int, tokens: int) -> int:
    """Columns of a vocab tile of the "backward" route, for `tokens` rows: the same bounds."""
    return _slab(local_vocab, tokens)


def resolve_weight_gradient(
    requested: str, tokens: int, local_vocab: int, hidden_size: int, dtype: torch.dtype
) -> str:
    """The route `requested` names. "auto": "forward" (3 matmuls) while the buffers it holds,
    the fp32 accumulator [V/tp, h] and below fp32 the gradient's copy in `dtype`, are within
    3/16 of the materialised path's [N, V/tp] logits and gradient (so that with one chunk, 1/16
    of them, beside they stay within a quarter), or no larger than the "backward" route's: its
    gradient [V/tp, h] and its accumulator (and copy) for grad_hidden [N, h]. In fp32 that is
    always "forward" (its accumulator is the gradient itself); in bf16, "backward" for
    h > N/8 unless N is large beside V/tp. In fp16 always "backward"; "forward" is refused
    there (FP16_FORWARD)."""
    if requested not in WEIGHT_GRADIENTS:
        raise ValueError(f"weight_gradient must be one of {WEIGHT_GRADIENTS}, got {requested!r}")
    if dtype == torch.float16:
        if requested == "forward":
            raise ValueError(FP16_FORWARD)
        return "backward"
    if requested != "auto":
        return requested
    size = dtype.itemsize
    accumulator = 8 if dtype == torch.float64 else 4
    held = accumulator + (size if size < accumulator else 0)
    forward = local_vocab * hidden_size * held
    backward = local_vocab * hidden_size * size + tokens * hidden_size * held
    materialised = 2 * tokens * local_vocab * size
    return "forward" if 16 * forward <= 3 * materialised or forward <= backward else "backward"


# None: the passes over a chunk are torch.compile'd on CUDA and eager elsewhere; True/False
# forces one (tests run the compiled passes on CPU).
COMPILED_PASSES: Optional[bool] = None


def chunk_passes(
    hidden: torch.Tensor, columns: int, chunk_rows: int
) -> Tuple[Callable, Callable, int]:
    """The recompute kernel's two passes for a [chunk_rows, columns] block and the rows each
    takes at once: compiled, one fused kernel over the whole block (no fp32 copy of it; on CUDA
    a few MiB a launch would cost more than the matmul), or eager over recompute's
    EAGER_CHUNK_BYTES of fp32 at a time (cache-sized on a CPU)."""
    compiled = hidden.is_cuda if COMPILED_PASSES is None else COMPILED_PASSES
    if compiled:
        return (*recompute.passes(compiled=True), chunk_rows)
    return (*recompute.passes(compiled=False), recompute.default_chunk_tokens(columns))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A token chunk: [c, h] x [V/tp, h] -> [c, V/tp] in the input dtype, as the materialised
    output layer gives them; the passes over them convert a few MiB at a time to fp32."""
    return torch.matmul(hidden, weight.t())


def _tile_logits(hidden: torch.Tensor, weight_tile: torch.Tensor) -> torch.Tensor:
    """A vocab tile: [N, h] x [t, h] -> [N, t] in the input dtype."""
    return torch.matmul(hidden, weight_tile.t())


class LinearDigitCrossEntropy(torch.autograd.Function):
    """(hidden [N, h], weight [V/tp, h], target [N], plan) -> (ce [N], digit_logits [N, W]).

    Keeps nothing [N, V/tp]; plan.inplace must be False (there are no logits to overwrite).
    plan.weight_gradient ("forward" or "backward") is the route of the weight gradient (module
    docstring).

    Saves hidden, weight and a few [N] vectors; backward multiplies the logits out again, by
    token chunk ("forward") or by vocab tile ("backward"): 4 matmuls in all, the materialised
    path's 3 plus one.

    "forward" with plan.ce_weights w [N]: forward also forms each chunk's unscaled gradient
    (softmax - onehot) * w and multiplies it into grad_hidden [N, h] and an fp32 grad_weight
    accumulator [V/tp, h] (3 matmuls in all). The upstream gradient of ce must be c * w for one
    scalar c (Megatron's loss_func: sum(loss * loss_mask) times a scale; checked on the device,
    no host sync): backward scales them by c and adds the digit logits' gradient ([N, W],
    through ten columns). A second backward takes the recompute route.
    """

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, plan: KernelPlan
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        dtype, device, n = compute_dtype(hidden), hidden.device, hidden.size(0)
        rows = TargetRows.of(target, plan.shard, plan.ignore_index, plan.validate)
        ce = torch.empty(n, dtype=dtype, device=device)
        out = torch.empty(n, plan.numbers.out_width, dtype=dtype, device=device)
        # The softmax is exp((logits - shift) - log_sum_exp): exact for logits of any size.
        shift = torch.empty(n, dtype=dtype, device=device)
        log_sum_exp = torch.empty_like(shift)
        sink = _weight_gradient_sink.get()
        sink = sink if sink is not None and sink.weight is weight else None
        early = None
        if plan.ce_weights is not None and plan.weight_gradient == "forward":
            early = _EarlyGradients.new(hidden, weight, plan)
        step = plan.chunk_tokens
        first_pass, second_pass, sub_step = chunk_passes(hidden, weight.size(0), step)
        numbers = plan.numbers.for_labels(target)
        kept = []  # numbers.forward_values, chunk by chunk
        for start in range(0, n, step):
            part = slice(start, start + step)
            logits, chunk_rows = _chunk_logits(hidden[part], weight), rows.rows(part)
            chunk_numbers = numbers.rows(part)
            ce[part], out[part], shift[part], log_sum_exp[part], values = recompute.statistics(
                logits, chunk_rows, plan, chunk_numbers, first_pass, sub_step,
                plan.validate and start == 0,
            )  # fmt: skip
            kept.append(chunk_numbers.forward_values(out[part], values))
            if early is not None:
                # The chunk becomes its gradient in place.
                recompute.gradient_into(
                    logits,
                    logits,
                    shift[part],
                    log_sum_exp[part],
                    chunk_rows,
                    chunk_numbers.with_forward(values, out[part]),
                    second_pass,
                    sub_step,
                    early.ce_weights[part],
                    None,
                )
                _add_chunk_gradients_(
                    logits,
                    hidden[part],
                    weight,
                    early.grad_hidden[part],
                    early.grad_weight,
                    sink is not None,
                )
            del logits
        # What backward's recomputed logits take the target and number columns' gradient
        # from: the digit logits, or a chunking vocab's layout values.
        target_prob = torch.exp(-ce)
        forward_numbers = torch.cat(kept)
        numbers = numbers.with_forward(forward_numbers, out)
        ctx.save_for_backward(
            hidden, weight, shift, log_sum_exp, target_prob, forward_numbers, *rows,
            *numbers.saved(),
        )  # fmt: skip
        # Intermediates of forward alone, kept on ctx: backward scales them in place and drops
        # them (a second backward recomputes).
        ctx.plan, ctx.early, ctx.sink = plan, early, sink
        ctx.set_materialize_grads(False)
        return ce, out

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        hidden, weight, shift, log_sum_exp, target_prob, forward_numbers, *rest = ctx.saved_tensors
        plan, rows, early, grads = ctx.plan, TargetRows(*rest[:3]), ctx.early, None
        sink = ctx.sink
        numbers = plan.numbers.from_saved(tuple(rest[3:]))
        saved = _BackwardInputs(
            shift, log_sum_exp, rows, plan, (target_prob, forward_numbers), numbers
        )
        ctx.early = None
        if early is not None:
            scale = early.scale_for(grad_ce, rows)
            grads = early.scaled_(scale, grad_digits, hidden, weight, saved, sink is not None)
            del early
        if grads is None:
            recomputed = _recomputed_gradients if plan.weight_gradient == "forward" else _by_tile
            grads = recomputed(hidden, weight, saved, grad_ce, grad_digits, sink)
        grad_hidden, grad_weight = grads
        plan.shard.all_reduce(grad_hidden, dist.ReduceOp.SUM)
        if sink is not None:
            if grad_weight is not None:  # _by_tile added it already
                sink.accumulator.add_(grad_weight)
            return grad_hidden, sink.returned(), None, None
        return grad_hidden, grad_weight.to(weight.dtype), None, None


class _BackwardInputs(NamedTuple):
    """What backward forms the gradient of a block of logits from: the row maxima (shift) [N],
    the log-sum-exp of the logits minus them [N], the target rows, the plan, the target
    probability [N] and the number columns' values as forward formed them
    (recompute.gradient_into's forward_values), and the number columns bound to forward's
    (NumberColumns.with_forward)."""

    shift: torch.Tensor
    log_sum_exp: torch.Tensor
    rows: TargetRows
    plan: KernelPlan
    forward_values: Tuple[torch.Tensor, torch.Tensor]
    numbers: NumberColumns


def _recomputed_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    saved: _BackwardInputs,
    grad_ce: Optional[torch.Tensor],
    grad_digits: Optional[torch.Tensor],
    sink: Optional[WeightGradientSink] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each chunk multiplied out again and turned into this rank's share of grad_hidden [N, h]
    (summed over the group by the caller) and grad_weight [V/tp, h] in the compute dtype (its
    products formed in that dtype when a sink takes it)."""
    shift, log_sum_exp, rows, plan, (target_prob, forward_numbers), numbers = saved
    step = plan.chunk_tokens
    _, second_pass, sub_step = chunk_passes(hidden, weight.size(0), step)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=shift.dtype, device=weight.device)
    for start in range(0, hidden.size(0), step):
        part = slice(start, start + step)
        logits = _chunk_logits(hidden[part], weight)
        # The chunk becomes its gradient in place, in the logits' dtype, as the materialised
        # path hands it to the output layer.
        recompute.gradient_into(
            logits,
            logits,
            shift[part],
            log_sum_exp[part],
            rows.rows(part),
            numbers.rows(part),
            second_pass,
            sub_step,
            None if grad_ce is None else grad_ce[part],
            None if grad_digits is None else grad_digits[part],
            (target_prob[part], forward_numbers[part]),
        )
        _add_chunk_gradients_(
            logits, hidden[part], weight, grad_hidden[part], grad_weight, sink is not None
        )
        del logits
    return grad_hidden, grad_weight


def _by_tile(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    saved: _BackwardInputs,
    grad_ce: Optional[torch.Tensor],
    grad_digits: Optional[torch.Tensor],
    sink: Optional[WeightGradientSink] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The "backward" route: each vocab tile of the logits [N, t] multiplied out again, turned
    in place into its gradient and multiplied into its rows of grad_weight [V/tp, h] (the
    weight's dtype, written once: one matmul over all N rows, as the materialised output layer
    forms it; with a sink, added to the sink's accumulator in its dtype instead, and None
    returned) and into this rank's share of grad_hidden [N, h] (summed over the tiles in the
    compute dtype; over the group by the caller)."""
    shift, log_sum_exp, rows, plan, forward_values, numbers = saved
    n, local_vocab = hidden.size(0), weight.size(0)
    # What the number columns' gradient needs once for all tiles (a chunking vocab's gradient
    # over the whole layout, from forward's values; each tile picks its own).
    scale = recompute.upstream_scale(grad_ce, rows, shift)
    numbers = numbers.for_tiles(shift, log_sum_exp, scale, rows.onehot_column(), grad_digits)
    tile = default_tile_columns(local_vocab, n)
    _, second_pass, sub_step = chunk_passes(hidden, tile, n)
    grad_weight = torch.empty_like(weight) if sink is None else None
    # The sink's products are formed in its dtype: hidden converted once, not per tile.
    hidden_for_sink = None if sink is None else _exact_operand(hidden, sink.accumulator.dtype)
    grad_hidden = torch.zeros(hidden.shape, dtype=shift.dtype, device=hidden.device)
    for start in range(0, local_vocab, tile):
        end = min(start + tile, local_vocab)
        logits = _tile_logits(hidden, weight[start:end])
        recompute.gradient_into(
            logits,
            logits,
            shift,
            log_sum_exp,
            rows.within(start, end),
            numbers.within(start, end),
            second_pass,
            sub_step,
            grad_ce,
            grad_digits,
            forward_values,
        )
        if sink is None:
            torch.matmul(logits.t(), hidden, out=grad_weight[start:end])
        else:
            _add_product_(sink.accumulator[start:end], logits.t(), hidden_for_sink, exact=True)
        _add_product_(grad_hidden, logits, weight[start:end])
        del logits
    return grad_hidden.to(hidden.dtype), grad_weight


# device -> whether torch.mm(..., out_dtype=torch.float32) multiplies half-precision operands
# there (fp32_output_gemm), and whether torch.addmm(..., out_dtype=torch.float32, out=acc) adds
# such a product into an fp32 accumulator in place (fp32_output_addmm).
_FP32_OUTPUT_GEMM: Dict[torch.device, bool] = {}
_FP32_OUTPUT_ADDMM: Dict[torch.device, bool] = {}

# Device types on which Megatron's fused weight-gradient extension (apex's
# fused_weight_gradient_mlp_cuda, a cuBLAS GEMM with beta = 1) may be handed tensors.
FUSED_WGRAD_DEVICE_TYPES: Tuple[str, ...] = ("cuda",)
FUSED_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"
_NOT_IMPORTED = object()
_fused_wgrad: object = _NOT_IMPORTED

# On CUDA a product is formed this much at a time where no fused route exists (each piece is a
# GEMM and an add launched from the host; a few MiB each would be launch-bound).
CUDA_SLICE_BYTES = 256 * 2**20


def fused_wgrad_module() -> Optional[object]:
    """Megatron's fused weight-gradient extension (fused_weight_gradient_mlp_cuda, from apex, as
    megatron.core.tensor_parallel.layers imports it), or None where it does not import. Imported
    once per process."""
    global _fused_wgrad
    if _fused_wgrad is _NOT_IMPORTED:
        try:
            _fused_wgrad = importlib.import_module(FUSED_WGRAD_MODULE)
        except ImportError:
            _fused_wgrad = None
    return _fused_wgrad


def _probe_fp32_output_gemm(device: torch.device) -> bool:
    """One tiny bf16 GEMM with fp32 output on `device`; False where torch has no such kernel.
    Reads no value (no host sync)."""
    ones = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    try:
        product = torch.mm(ones, ones, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return product.dtype == torch.float32


def _probe_fp32_output_addmm(device: torch.device) -> bool:
    """One tiny torch.addmm(acc, bf16, bf16, out_dtype=float32, out=acc) on `device`, its result
    read once (a host sync, once per device): False where torch refuses an fp32 accumulator
    beside bf16 operands (older CUDA builds ask self to share the operands' dtype) or does not
    add in place."""
    ones = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    # 1 + 2**-12 is an fp32 value bf16 cannot hold: a product rounded through bf16 shows.
    accumulator = torch.full((16, 16), 1 + 2**-12, dtype=torch.float32, device=device)
    try:
        torch.addmm(accumulator, ones, ones, out_dtype=torch.float32, out=accumulator)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.all(accumulator == 17 + 2**-12))


def _probed(
    cache: Dict[torch.device, bool], device: torch.device, probe: Callable, reads_values: bool
) -> bool:
    """probe(device) for a CUDA device, once per device; False off CUDA. While tensors are fake
    or traced nothing is kept, and a probe that reads values is not run (False), nor while a
    CUDA graph is captured."""
    if device.type != "cuda":
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    known = cache.get(device)
    if known is None:
        from torch._guards import detect_fake_mode

        if detect_fake_mode() is not None or torch.compiler.is_compiling():
            return False if reads_values else probe(device)
        if reads_values and torch.cuda.is_current_stream_capturing():
            return False
        known = cache[device] = probe(device)
    return known


def fp32_output_gemm(device: torch.device) -> bool:
    """Whether `device` multiplies bf16/fp16 operands into an fp32 product in one GEMM
    (torch.mm's out_dtype: CUDA builds of torch >= 2.8; never on a CPU). Probed once per
    device."""
    return _probed(_FP32_OUTPUT_GEMM, device, _probe_fp32_output_gemm, reads_values=False)


def fp32_output_addmm(device: torch.device) -> bool:
    """Whether `device` adds the fp32 product of bf16/fp16 operands into an fp32 accumulator in
    one in-place GEMM (torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc): CUDA builds
    of recent torch; never on a CPU). Probed once per device."""
    return _probed(_FP32_OUTPUT_ADDMM, device, _probe_fp32_output_addmm, reads_values=True)


# The exact routes of _add_product_, fastest first.
FUSED_WGRAD = "fused wgrad GEMM"
FP32_OUTPUT_ADDMM = "fp32-output addmm"
FP32_OUTPUT_GEMM = "fp32-output GEMM"
UPCAST = "upcast"


def exact_product_route(
    device: torch.device, operand_dtype: torch.dtype, accumulator_dtype: torch.dtype
) -> str:
    """How a product of `operand_dtype` operands is added to an `accumulator_dtype` accumulator
    when it must be formed in the accumulator's dtype (the exact path of _add_product_):
    - "fused wgrad GEMM": bf16/fp16 into fp32 by Megatron's fused extension
      (fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32, as Megatron's own layers do under
      gradient-accumulation fusion): one GEMM adding into the accumulator;
    - "fp32-output addmm": the same by torch.addmm(..., out_dtype=torch.float32) in place;
    - "fp32-output GEMM": the product formed by torch.mm(..., out_dtype=torch.float32) in
      slices, each added;
    - "upcast": the operands converted to the accumulator's dtype first (in slices)."""
    half = operand_dtype in (torch.bfloat16, torch.float16)
    if not (half and accumulator_dtype == torch.float32):
        return UPCAST
    if device.type in FUSED_WGRAD_DEVICE_TYPES and fused_wgrad_module() is not None:
        return FUSED_WGRAD
    return _unfused_route(device)


def _unfused_route(device: torch.device) -> str:
    """exact_product_route for bf16/fp16 operands into fp32, without the fused extension."""
    if fp32_output_addmm(device):
        return FP32_OUTPUT_ADDMM
    if fp32_output_gemm(device):
        return FP32_OUTPUT_GEMM
    return UPCAST


def _exact_operand(b: torch.Tensor, accumulator_dtype: torch.dtype) -> torch.Tensor:
    """b as the exact path of _add_product_ multiplies it (converted once by callers that use
    it for many products)."""
    if exact_product_route(b.device, b.dtype, accumulator_dtype) == UPCAST:
        return b.to(accumulator_dtype)
    return b


def _slice_bytes(device: torch.device) -> int:
    """Bytes of a product formed at a time on the sliced paths of _add_product_."""
    return CUDA_SLICE_BYTES if device.type == "cuda" else WEIGHT_SLICE_BYTES


def _add_product_(
    accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor, exact: bool = False
) -> None:
    """accumulator [m, h] += a [m, k] @ b [k, h] (grad_hidden from a vocab tile; grad_weight
    from a chunk's gradient, a = grad.t()). In one dtype, addmm_ needs no temporary. With
    `exact`, the product is formed in the accumulator's dtype (exact_product_route): one fused
    GEMM adding into it where the device has one, else in slices. Otherwise it is formed in
    a's dtype, in slices. A slice is WEIGHT_SLICE_BYTES of the product (CUDA_SLICE_BYTES on
    CUDA), never [m, h] whole beside the accumulator; the upcast path converts a a slice at a
    time and b once."""
    if a.dtype == accumulator.dtype and b.dtype == accumulator.dtype:
        accumulator.addmm_(a, b)
        return
    route = exact_product_route(a.device, a.dtype, accumulator.dtype) if exact else None
    if route == FUSED_WGRAD and not accumulator.is_contiguous():
        route = _unfused_route(a.device)  # the extension writes a row-major [m, h]
    if route not in (None, UPCAST):
        b = b.to(a.dtype)  # no-op where the caller passed it as _exact_operand gives it
    if route == FUSED_WGRAD:
        # d_weight [m, h] += d_output [k, m]^T @ input [k, h], each row-major (no copy for the
        # callers' a = grad.t() and b = hidden)
        fused_wgrad_module().wgrad_gemm_accum_fp32(b.contiguous(), a.t().contiguous(), accumulator)
        return
    if route == FP32_OUTPUT_ADDMM:
        torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, out=accumulator)
        return
    upcast = route == UPCAST
    if upcast:
        b = b.to(accumulator.dtype)
    # bytes of one row of the product as it is formed
    row_bytes = b.size(1) * (accumulator.element_size() if exact else b.element_size())
    rows = max(1, _slice_bytes(a.device) // row_bytes)
    for start in range(0, accumulator.size(0), rows):
        part = slice(start, start + rows)
        if upcast:
            accumulator[part].addmm_(a[part].to(accumulator.dtype), b)
        elif exact:
            accumulator[part].add_(torch.mm(a[part], b, out_dtype=accumulator.dtype))
        else:
            accumulator[part].add_(torch.matmul(a[part], b))


def _add_chunk_gradients_(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    exact: bool = False,
) -> None:
    """A chunk's gradient of the logits grad [c, V/tp] (the hidden's dtype) into its rows of
    grad_hidden [c, h] (written) and into the accumulator grad_weight [V/tp, h] (added; with
    `exact` its product formed in the accumulator's dtype, _add_product_)."""
    torch.matmul(grad, weight, out=grad_hidden)
    _add_product_(grad_weight, grad.t(), hidden, exact)


class _EarlyGradients(NamedTuple):
    """The gradients formed in forward for upstream gradient ce_weights: ce_weights [N] (as the
    caller gave them; ignored rows count as 0), grad_hidden [N, h] (this rank's share, the
    hidden's dtype) and grad_weight [V/tp, h] (fp32/fp64, the accumulator)."""

    ce_weights: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor

    @classmethod
    def new(cls, hidden: torch.Tensor, weight: torch.Tensor, plan: KernelPlan) -> _EarlyGradients:
        dtype = compute_dtype(hidden)
        return cls(
            plan.ce_weights.to(dtype),
            torch.empty_like(hidden),
            torch.zeros(weight.shape, dtype=dtype, device=weight.device),
        )

    def scale_for(self, grad_ce: Optional[torch.Tensor], rows: TargetRows) -> torch.Tensor:
        """c [] with grad_ce == c * ce_weights on the rows that count, checked on the device
        (check_on_device: NOT_PROPORTIONAL otherwise; a non-finite grad_ce passes, and its
        gradients are non-finite as the materialised path's would be)."""
        if grad_ce is None:
            return torch.zeros((), dtype=self.ce_weights.dtype, device=self.ce_weights.device)
        dtype = self.ce_weights.dtype
        # in fp64, so that the fit's own rounding stays far below the tolerance
        weights = torch.where(rows.valid, self.ce_weights, 0.0).double()
        grad = torch.where(rows.valid, grad_ce.to(dtype), 0.0).double()
        norm = weights.square().sum()
        scale = torch.where(norm > 0, (grad * weights).sum() / norm.clamp(min=1e-300), 0.0)
        misfit = (grad - scale * weights).abs().amax()
        tolerance = SCALE_TOLERANCE * torch.finfo(dtype).eps * grad.abs().amax()
        check_on_device(~(misfit > tolerance), NOT_PROPORTIONAL)
        return scale.to(dtype)

    def scaled_(
        self,
        scale: torch.Tensor,
        grad_digits: Optional[torch.Tensor],
        hidden: torch.Tensor,
        weight: torch.Tensor,
        saved: _BackwardInputs,
        exact: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """grad_hidden and grad_weight for upstream scale * ce_weights and grad_digits [N, W];
        scales the accumulator in place (it is spent). exact: the number columns' product is
        formed in the accumulator's dtype too."""
        grad_weight = self.grad_weight.mul_(scale)
        grad_hidden = (self.grad_hidden.to(scale.dtype) * scale).to(hidden.dtype)
        numbers = saved.numbers
        if grad_digits is not None and numbers.columns:
            columns = numbers.column_index(hidden.device)
            digit_grad = numbers.term_gradient(grad_digits).to(hidden.dtype)
            grad_hidden.add_(torch.matmul(digit_grad, weight.index_select(0, columns)))
            if exact:
                product = torch.zeros(
                    (digit_grad.size(1), hidden.size(1)), dtype=grad_weight.dtype,
                    device=grad_weight.device,
                )  # fmt: skip
                _add_product_(product, digit_grad.t(), hidden, exact=True)
            else:
                product = torch.matmul(digit_grad.t(), hidden).to(grad_weight.dtype)
            grad_weight.index_add_(0, columns, product)
        return grad_hidden, grad_weight


class SequenceParallelGather(torch.autograd.Function):
    """hidden [s/tp, b, h], this rank's contiguous slice of the positions (Megatron's sequence
    parallelism) -> [s, b, h], the whole sequence, on every rank of `group`.

    Backward returns this rank's rows of the gradient and communicates nothing: the linear
    kernel's backward has already summed grad_hidden over the group (a reduce-scatter here
    would count it tp times)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, group) -> torch.Tensor:
        pieces = [torch.empty_like(hidden) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, hidden.contiguous(), group=group)
        ctx.rows, ctx.rank = hidden.size(0), dist.get_rank(group)
        return torch.cat(pieces, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows], None
