"""The logits-free path (numerical_linear_loss) equals the materialised-logits path."""

import pytest
import torch

import del_megatron as dm

from . import linear_workers
from .cases import PADDED_VOCAB_SIZE, SPLIT_VOCAB, TOKEN_FORM

CFG = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, **TOKEN_FORM)
LABELS = torch.zeros(2, 5, dtype=torch.long)

CASES = [
    pytest.param(tp, check, id=f"tp{tp}-{check.removeprefix('check_')}")
    for tp in (1, 2, 4)
    for check in linear_workers.checks_for(tp)
]


@pytest.mark.parametrize("tp, check", CASES)
def test_logits_free_equals_materialised(gloo, tp, check):
    gloo(tp).run(getattr(linear_workers, check), 4321 + tp)


def test_logits_free_under_tensor_sequence_and_context_parallelism(gloo):
    workers = gloo(4, tensor_model_parallel_size=2, context_parallel_size=2)
    workers.run(linear_workers.check_tp_sp_and_cp, 99)


@pytest.mark.parametrize(
    "hidden, weight, labels, kwargs, error, match",
    [
        (torch.randn(5, 2), torch.randn(64, 4), LABELS, {}, ValueError, r"hidden must be \[seq"),
        (torch.randn(5, 2, 4), torch.randn(64, 3), LABELS, {}, ValueError, r"weight must be"),
        (torch.randn(5, 2, 4), torch.randn(64), LABELS, {}, ValueError, r"weight must be"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4, dtype=torch.float64),
            LABELS,
            {},
            TypeError,
            "share one floating dtype",
        ),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS.t(), {}, ValueError, r"labels must be"),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS.float(), {}, TypeError, "integer tensor"),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS + 64, {}, ValueError, "outside the voc"),
        (torch.randn(5, 2, 4), torch.randn(8, 4), LABELS, {}, ValueError, "vocab"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"chunk_tokens": 0},
            ValueError,
            "chunk",
        ),
        (torch.randn(5, 2, 4), [[1.0]], LABELS, {}, TypeError, "weight must be a torch.Tensor"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"kernel": "softmax"},
            ValueError,
            "one kernel, 'linear'",
        ),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS, {"kernel": "x"}, ValueError, "one of"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"inplace": True},
            ValueError,
            "keeps no logits",
        ),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"weight_gradient": "sideways"},
            ValueError,
            r"weight_gradient must be one of \('auto', 'forward', 'backward'\)",
        ),
    ],
)
def test_bad_input_is_refused(hidden, weight, labels, kwargs, error, match):
    with pytest.raises(error, match=match):
        dm.numerical_linear_loss(hidden, weight, labels, CFG, **kwargs)


def test_default_chunk_holds_no_more_than_256_mib_of_logits_nor_an_eighth_of_the_tokens():
    from del_megatron.kernels.linear import default_chunk_tokens

    assert default_chunk_tokens(151936, 4096) == 441  # 256 MiB of fp32 logits
    assert default_chunk_tokens(151936 // 2, 4096) == 512  # TP 2: an eighth of the tokens
    assert default_chunk_tokens(151936, 100) == 13
    assert default_chunk_tokens(PADDED_VOCAB_SIZE, 10**6) * PADDED_VOCAB_SIZE * 4 <= 256 * 2**20
    assert default_chunk_tokens(2**40, 10**6) == 1
    assert default_chunk_tokens(64, 5) == 1


def test_default_tile_holds_no_more_than_256_mib_of_logits_nor_an_eighth_of_the_shard():
    from del_megatron.kernels.linear import default_tile_columns

    assert default_tile_columns(151936, 4096) == 16384  # 256 MiB of fp32 logits
    assert default_tile_columns(151936 // 2, 4096) == 9496  # TP 2: an eighth of the shard
    assert default_tile_columns(PADDED_VOCAB_SIZE, 69) == 8
    assert default_tile_columns(5, 10**9) == 1


V = 151936


@pytest.mark.parametrize(
    "tokens, local_vocab, hidden_size, dtype, route",
    [
        (4096, V, 512, torch.bfloat16, "forward"),  # 6 V h bytes = 3/16 of 4 N V: the bound
        (4096, V, 513, torch.bfloat16, "backward"),
        (4096, V, 1024, torch.bfloat16, "backward"),
        (4096, V // 2, 1024, torch.bfloat16, "backward"),
        (16384, V, 2048, torch.bfloat16, "forward"),
        (4096, V, 1024, torch.float16, "backward"),
        (4096, V, 8192, torch.float32, "forward"),  # the accumulator is the gradient
        (4096, V, 8192, torch.float64, "forward"),
        (8192, 128256, 4096, torch.bfloat16, "backward"),  # a 7B model, micro-batch 1 x 8192
        # TP 8, h 8192, 32768 tokens: the backward route's fp32 [N, h] would be larger
        (32768, V // 8, 8192, torch.bfloat16, "forward"),
    ],
)
def test_auto_weight_gradient_route_holds_the_smaller_buffers(
    tokens, local_vocab, hidden_size, dtype, route
):
    from del_megatron.kernels.linear import resolve_weight_gradient

    assert resolve_weight_gradient("auto", tokens, local_vocab, hidden_size, dtype) == route
    for forced in ("forward", "backward") if dtype != torch.float16 else ("backward",):
        assert resolve_weight_gradient(forced, tokens, local_vocab, hidden_size, dtype) == forced


@pytest.mark.parametrize(
    "tokens, local_vocab, hidden_size", [(4096, V, 512), (16384, V, 2048), (32768, V // 8, 8192)]
)
def test_fp16_takes_the_backward_route_and_refuses_the_forward_one(
    tokens, local_vocab, hidden_size
):
    """In fp16 the "forward" route's products, formed before the loss scale, could overflow where
    the materialised path's do not: "auto" takes "backward" where bf16 takes "forward", and
    "forward" asked for is refused, naming the way out."""
    from del_megatron.kernels.linear import resolve_weight_gradient

    args = (tokens, local_vocab, hidden_size)
    assert resolve_weight_gradient("auto", *args, torch.bfloat16) == "forward"
    assert resolve_weight_gradient("auto", *args, torch.float16) == "backward"
    with pytest.raises(ValueError, match="in fp16 use the 'backward' route"):
        resolve_weight_gradient("forward", *args, torch.float16)
    hidden = torch.randn(5, 2, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="before the loss scale is applied"):
        dm.numerical_linear_loss(
            hidden, torch.randn(64, 4, dtype=torch.float16), LABELS, CFG, weight_gradient="forward"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ["forward", "backward"])
@pytest.mark.parametrize("loss_mask", [False, True])
def test_a_weight_gradient_sink_takes_the_gradient_in_fp32(dtype, route, loss_mask):
    """weight_gradient_into: the weight's gradient is added to the sink's fp32 accumulator (what
    was there stays) and backward returns the sink's placeholder; the hidden's gradient is
    unchanged. In fp32 the accumulator gets what autograd would have returned; in bf16, the
    products formed in fp32 from the same bf16 gradient of the logits, which is closer to the
    fp64 product than the bf16 gradient autograd returns."""
    from del_megatron.kernels.linear import WeightGradientSink, weight_gradient_into

    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(16, 3, 32, generator=gen).to(dtype)
    weight = (torch.randn(PADDED_VOCAB_SIZE, 32, generator=gen) / 4).to(dtype)
    labels = torch.randint(0, PADDED_VOCAB_SIZE, (3, 16), generator=gen)
    mask = (torch.rand(3, 16, generator=gen) > 0.2).float() if loss_mask else None
    upstream = mask if loss_mask else torch.rand(3, 16, generator=gen)

    def run(sink):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if sink is not None:
            sink = sink._replace(weight=w)
        with weight_gradient_into(sink):
            loss = dm.numerical_linear_loss(
                h, w, labels, CFG, loss_mask=mask, weight_gradient=route, chunk_tokens=5
            )
        (loss * upstream).sum().backward()
        return h.grad, w.grad

    want_hidden, want_weight = run(None)
    before = torch.randn(weight.shape, generator=gen)
    accumulator, placeholder = before.clone(), torch.full(weight.shape, 7.0, dtype=dtype)
    got_hidden, got_weight = run(WeightGradientSink(None, accumulator, lambda: placeholder))
    assert torch.equal(got_hidden, want_hidden)
    assert torch.equal(got_weight, placeholder)
    added = accumulator - before
    if dtype == torch.float32:
        torch.testing.assert_close(added, want_weight, rtol=1e-5, atol=1e-6)
    else:
        exact = run_fp64_weight_gradient(hidden, weight, labels, mask, upstream)
        ours, rounded = (added - exact).abs().max(), (want_weight.double() - exact).abs().max()
        assert ours < rounded, (ours, rounded)


def test_without_a_backward_no_gradient_is_formed_in_forward(monkeypatch):
    """Evaluation (no_grad, or inputs that need no gradient) on the "forward" route with a loss
    mask: the loss is the same and no gradient buffer ([V/tp, h] accumulator) is made."""
    from del_megatron.kernels import linear

    made = []
    new = linear._EarlyGradients.new
    monkeypatch.setattr(
        linear._EarlyGradients, "new", classmethod(lambda cls, *a: made.append(1) or new(*a))
    )
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(5, 2, 8, generator=gen), torch.randn(PADDED_VOCAB_SIZE, 8)
    labels, mask = torch.randint(0, PADDED_VOCAB_SIZE, (2, 5), generator=gen), torch.ones(2, 5)

    def loss(h, w):
        return dm.numerical_linear_loss(
            h, w, labels, CFG, loss_mask=mask, weight_gradient="forward"
        )

    trained = loss(hidden.requires_grad_(True), weight)
    assert made == [1]
    with torch.no_grad():
        evaluated = loss(hidden, weight)
    assert torch.equal(evaluated, trained.detach()) and made == [1]
    assert torch.equal(loss(hidden.detach(), weight), evaluated) and made == [1]


def run_fp64_weight_gradient(hidden, weight, labels, mask, upstream):
    """The weight's gradient through the materialised path in fp64 from the same inputs."""
    h, w = hidden.double(), weight.double().requires_grad_(True)
    logits = torch.matmul(h, w.t())
    loss = dm.numerical_lm_loss(labels, logits, CFG)
    (loss * upstream.double()).sum().backward()
    return w.grad


def _fused_wgrad_stand_in(calls: list):
    """What apex's fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 does (a cuBLAS GEMM with
    fp32 compute and beta = 1, row-major operands): d_weight [out, in] += d_output [n, out]^T @
    input [n, in], formed in fp32; records each call's dtypes and contiguity."""
    import types

    def wgrad_gemm_accum_fp32(input, d_output, d_weight):
        calls.append((input.dtype, d_output.dtype, d_weight.dtype, input.is_contiguous()))
        assert d_output.is_contiguous() and d_weight.is_contiguous()
        d_weight.add_(torch.matmul(d_output.t().float(), input.float()))

    module = types.ModuleType("fused_weight_gradient_mlp_cuda")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    return module


def _install_fused_wgrad(monkeypatch, calls: list, device_types=("cuda", "cpu")) -> None:
    """The stand-in importable as Megatron imports it, and (tests only) handed CPU tensors."""
    import sys

    from del_megatron.kernels import linear

    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", _fused_wgrad_stand_in(calls))
    monkeypatch.setattr(
        linear, "_fused_wgrad", getattr(linear, "_NOT_IMPORTED", None), raising=False
    )
    monkeypatch.setattr(linear, "FUSED_WGRAD_DEVICE_TYPES", device_types, raising=False)


def test_the_exact_product_takes_the_fastest_route_the_device_has(monkeypatch):
    """exact_product_route: bf16/fp16 operands into an fp32 accumulator take Megatron's fused
    weight-gradient extension where it imports (CUDA only), else one in-place
    addmm(..., out_dtype=float32), else torch.mm(..., out_dtype=float32) in slices, else the
    operands upcast (every CPU); each probe runs once per device. Each route adds the same
    product as the fp64 one (the GEMMs are emulated on the CPU: no CPU kernel exists)."""
    from del_megatron.kernels import linear

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert linear.exact_product_route(cpu, torch.bfloat16, torch.float32) == "upcast"
    assert linear._probe_fp32_output_gemm(cpu) is False  # torch has no CPU kernel for it
    assert linear._probe_fp32_output_addmm(cpu) is False
    probed = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA here
    monkeypatch.setattr(linear, "_FP32_OUTPUT_GEMM", {})
    monkeypatch.setattr(linear, "_FP32_OUTPUT_ADDMM", {})
    monkeypatch.setattr(linear, "_probe_fp32_output_gemm", lambda d: probed.append(d) or True)
    monkeypatch.setattr(linear, "_probe_fp32_output_addmm", lambda d: probed.append(d) or False)
    for _ in range(2):
        assert linear.exact_product_route(cuda, torch.bfloat16, torch.float32) == (
            "fp32-output GEMM"
        )
    assert probed == [cuda, cuda]  # each probe once per device
    assert linear.exact_product_route(cuda, torch.float16, torch.float32) == "fp32-output GEMM"
    assert linear.exact_product_route(cuda, torch.float32, torch.float32) == "upcast"
    assert linear.exact_product_route(cuda, torch.bfloat16, torch.float64) == "upcast"
    monkeypatch.setattr(linear, "_FP32_OUTPUT_ADDMM", {cuda: True})
    assert linear.exact_product_route(cuda, torch.bfloat16, torch.float32) == "fp32-output addmm"
    calls = []
    _install_fused_wgrad(monkeypatch, calls, device_types=("cuda",))
    assert linear.exact_product_route(cuda, torch.bfloat16, torch.float32) == "fused wgrad GEMM"
    assert linear.exact_product_route(cpu, torch.bfloat16, torch.float32) == "upcast"

    gen = torch.Generator().manual_seed(4)
    grad = torch.randn(64, 300, generator=gen).bfloat16()  # [tokens, V/tp], a = grad.t()
    b = torch.randn(64, 48, generator=gen).bfloat16()
    start = torch.randn(300, 48, generator=gen)
    want = start.double() + grad.t().double() @ b.double()
    results = {}
    for route in ("upcast", "fused wgrad GEMM"):
        monkeypatch.setattr(linear, "exact_product_route", lambda *a, route=route: route)
        results[route] = start.clone()
        linear._add_product_(results[route], grad.t(), b, exact=True)
    assert calls == [(torch.bfloat16, torch.bfloat16, torch.float32, True)]
    seen, real_mm = [], torch.mm

    def mm(x, y, out_dtype=None):
        seen.append(("mm", x.dtype, y.dtype, out_dtype))
        return real_mm(x.to(out_dtype), y.to(out_dtype))

    def addmm(acc, x, y, out_dtype=None, out=None):
        seen.append(("addmm", x.dtype, y.dtype, out_dtype, out is acc))
        return out.add_(real_mm(x.to(out_dtype), y.to(out_dtype)))

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(linear, "WEIGHT_SLICE_BYTES", 48 * 4 * 100)  # 3 slices of 100 rows
    for route in ("fp32-output GEMM", "fp32-output addmm"):
        monkeypatch.setattr(linear, "exact_product_route", lambda *a, route=route: route)
        results[route] = start.clone()
        linear._add_product_(results[route], grad.t(), b, exact=True)
    assert seen == [("mm", torch.bfloat16, torch.bfloat16, torch.float32)] * 3 + [
        ("addmm", torch.bfloat16, torch.bfloat16, torch.float32, True)
    ]
    for route, got in results.items():
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5, msg=route)


class _Gemms(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the GEMMs dispatched (aten mm/addmm, any overload)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _main_grad_forward_route(hidden, weight, labels, accumulator, chunk_tokens=None):
    """numerical_linear_loss on the "forward" route with an fp32 main_grad sink, forward and
    backward, under a loss mask of ones; the GEMMs counted in forward."""
    from del_megatron.kernels.linear import WeightGradientSink, weight_gradient_into

    mask = torch.ones(labels.shape)
    sink = WeightGradientSink(weight, accumulator, lambda: None)
    with _Gemms() as gemms, weight_gradient_into(sink):
        loss = dm.numerical_linear_loss(
            hidden, weight, labels, CFG, loss_mask=mask, weight_gradient="forward",
            chunk_tokens=chunk_tokens, validate=False,
        )  # fmt: skip
    (loss * mask).sum().backward()
    return gemms.count


@pytest.mark.parametrize("route", ["fused wgrad GEMM", "fp32-output addmm"])
def test_the_forward_routes_fp32_main_grad_product_is_one_gemm_per_token_chunk(monkeypatch, route):
    """Audit G3: on the "forward" route the exact (fp32 main_grad) weight-gradient product of a
    token chunk is one GEMM adding into the fp32 accumulator, as Megatron's fused
    wgrad_gemm_accum_fp32 is one per micro-batch, not one GEMM and one add per 8 MiB slice (75
    pairs a chunk at TP 4, V 151936, h 4096). Counted under FakeTensorMode at that shape (N
    16384: 10 chunks); the fused extension is a stand-in and the in-place addmm the fake's meta
    kernel (CUDA-only in torch). Per chunk: the logits, grad_hidden and that one product."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from del_megatron.kernels import linear

    calls = []
    if route == "fused wgrad GEMM":
        _install_fused_wgrad(monkeypatch, calls)
    else:
        monkeypatch.setattr(linear, "fp32_output_addmm", lambda device: True, raising=False)
        monkeypatch.setattr(linear, "exact_product_route", lambda *a: route)
    tokens, local_vocab, h = 16384, 151936 // 4, 4096
    chunks = -(-tokens // linear.default_chunk_tokens(local_vocab, tokens))
    with FakeTensorMode():
        hidden = torch.empty(tokens, 1, h, dtype=torch.bfloat16).requires_grad_(True)
        weight = torch.empty(local_vocab, h, dtype=torch.bfloat16).requires_grad_(True)
        labels = torch.zeros(1, tokens, dtype=torch.long)
        gemms = _main_grad_forward_route(hidden, weight, labels, torch.zeros(local_vocab, h))
    assert chunks == 10
    assert gemms == 3 * chunks, gemms  # with the fused stand-in, its own GEMM among them
    if route == "fused wgrad GEMM":
        assert len(calls) == chunks + 1, calls  # and one in backward: the digit columns


def test_the_fused_main_grad_product_is_exact(monkeypatch):
    """With the fused extension (stand-in) the forward route's main_grad gets the fp32 product
    of the same bf16 gradient of the logits: closer to the fp64 gradient than the bf16 one
    autograd returns, as on the upcast route."""
    calls = []
    _install_fused_wgrad(monkeypatch, calls)
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(16, 3, 32, generator=gen).bfloat16()
    weight = (torch.randn(PADDED_VOCAB_SIZE, 32, generator=gen) / 4).bfloat16()
    labels = torch.randint(0, PADDED_VOCAB_SIZE, (3, 16), generator=gen)
    accumulator = torch.zeros(weight.shape)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    _main_grad_forward_route(h, w, labels, accumulator, chunk_tokens=10)
    assert len(calls) == 5 + 1  # one per chunk of 10 of the 48 tokens, one for the digits
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = dm.numerical_linear_loss(h, w, labels, CFG, loss_mask=torch.ones(3, 16))
    loss.sum().backward()
    exact = run_fp64_weight_gradient(hidden, weight, labels, torch.ones(3, 16), torch.ones(3, 16))
    ours, rounded = (accumulator - exact).abs().max(), (w.grad.double() - exact).abs().max()
    assert ours < rounded, (ours, rounded)
