"""The decoder-layer ops: fused_linear, rotary_cache_write, decode_attention (docs/kernels.md).

CPU: the reference ops against float64 computations written here, rounded to the input dtype
where the semantics round, over odd sizes, every option and the cache edges. Bad inputs: one test
per class. opcheck on each device; the attention cases on each device too. GPU: the CUDA ops
against the CPU ops on the same inputs at real models' shapes, CUDA-graph replay at another cache
length, no host sync.
"""
import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F

from flashhead_ext import ops
from flashhead_ext.graphs import capture_graph
from helpers import (DEVICES, DTYPES, at_odd_offset, check_no_backward, expect_compiled, generator, raw_call,
                     required_tensor_arguments)

device_params = pytest.mark.parametrize("device", DEVICES)
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=str)

# Outputs are O(1) and in the input dtype: a few of its ulps. The float32 sums run in another order
# than float64 or than another device's, which moves a rounded result by an ulp at times.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=5e-3, atol=5e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

LINEAR_OPTIONS = ["plain", "norm", "gated", "residual", "norm+residual", "gated+residual", "bias", "norm+bias+residual"]


def randn(g, *shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


def on(args: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def clone(args: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def assert_close(actual, expected, dtype, what):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), equal_nan=True, msg=lambda m: f"{what}: {m}",
                               **TOL[dtype])


# ---- inputs (keyword arguments of the ops; the names are the schema's) ---------------------------

def linear_args(M, K, N, option, dtype, eps=0.1):
    """A large eps by default: an op that dropped it would be off by far more than the tolerance."""
    g = generator("fused_linear", M, K, N, option, str(dtype))
    gated = "gated" in option
    return dict(
        x=randn(g, M, 2 * K if gated else K, dtype=dtype),
        weight=randn(g, N, K, dtype=dtype, scale=K ** -0.5),
        norm_weight=randn(g, K, dtype=dtype, scale=0.3, shift=1.0) if "norm" in option else None,
        eps=eps, gated=gated,
        residual=randn(g, M, N, dtype=dtype) if "residual" in option else None,
        bias=randn(g, N, dtype=dtype) if "bias" in option else None,
    )


def rotary_tables(g, max_len, hd, dtype):
    # Random angles: bounded like real tables, but every position's row differs in every column.
    angles = torch.rand(max_len, hd, generator=g, dtype=torch.float64) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_args(M, H, KV, hd, max_len, length, qk_norm, dtype):
    g = generator("rotary", M, H, KV, hd, max_len, length, qk_norm, str(dtype))
    cos, sin = rotary_tables(g, max_len, hd, dtype)
    norm = (lambda: randn(g, hd, dtype=dtype, scale=0.3, shift=1.0)) if qk_norm else (lambda: None)
    return dict(qkv=randn(g, M, (H + 2 * KV) * hd, dtype=dtype), cos=cos, sin=sin, length=torch.tensor(length),
                k_cache=randn(g, KV, max_len, hd, dtype=dtype), v_cache=randn(g, KV, max_len, hd, dtype=dtype),
                num_heads=H, q_norm=norm(), k_norm=norm(), eps=1e-6)


def attention_args(M, H, KV, hd, max_len, length, dtype, scale=None):
    g = generator("attention", M, H, KV, hd, max_len, length, str(dtype))
    return dict(q=randn(g, M, H, hd, dtype=dtype), k_cache=randn(g, KV, max_len, hd, dtype=dtype),
                v_cache=randn(g, KV, max_len, hd, dtype=dtype), length=torch.tensor(length), scale=scale)


# ---- float64 references, written from the semantics --------------------------------------------

def rms_norm64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.double()


def fused_linear64(x, weight, norm_weight, eps, gated, residual, bias=None, activation="silu"):
    """``activation``: the gate's, "silu" or "gelu_tanh" (decoder_step's Gemma-3 option)."""
    t = x.dtype
    h = x
    if norm_weight is not None:
        h = rms_norm64(x, norm_weight, eps).to(t)
    if gated:
        gate, up = x.double().chunk(2, dim=1)
        activated = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        h = (activated.to(t).double() * up).to(t)
    y = h.double() @ weight.double().T
    y = (y if bias is None else y + bias.double()).to(t)  # rounded once, after the bias
    return y if residual is None else (residual.double() + y.double()).to(t)


def rotary_cache_write64(qkv, cos, sin, length, k_cache, v_cache, num_heads, q_norm, k_norm, eps):
    """(q, k_cache, v_cache) after the write, as new tensors."""
    t = qkv.dtype
    kv, max_len, hd = k_cache.shape
    q, k, v = qkv.view(qkv.shape[0], -1, hd).split([num_heads, kv, kv], dim=1)
    if q_norm is not None:
        q, k = rms_norm64(q, q_norm, eps).to(t), rms_norm64(k, k_norm, eps).to(t)
    q_out = torch.full(q.shape, float("nan"), dtype=t)
    k_out, v_out = k_cache.clone(), v_cache.clone()
    for i in range(qkv.shape[0]):
        pos = int(length) + i
        if not 0 <= pos < max_len:
            continue
        c, s = cos[pos].double(), sin[pos].double()

        def rotate(x):
            turned = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1).double()
            return ((x.double() * c).to(t).double() + turned * s).to(t)

        q_out[i], k_out[:, pos], v_out[:, pos] = rotate(q[i]), rotate(k[i]), v[i]
    return q_out, k_out, v_out


def decode_attention64(q, k_cache, v_cache, length, scale, window=0, softcap=0.0):
    """``window`` > 0: only the last ``window`` visible keys (decoder_step's sliding-window layers);
    ``softcap`` > 0: scaled scores capped as ``softcap * tanh(s / softcap)`` (decoder_step's Gemma-2 cap)."""
    tokens, heads, hd = q.shape
    kv, max_len, _ = k_cache.shape
    scale = hd ** -0.5 if scale is None else scale
    out = torch.full((tokens, heads, hd), float("nan"), dtype=torch.float64)
    for i in range(tokens):
        visible = min(int(length) + i, max_len - 1) + 1
        if visible <= 0:
            continue
        first = max(0, visible - window) if window > 0 else 0
        k = k_cache[:, first:visible].double().repeat_interleave(heads // kv, dim=0)  # [heads, keys, hd]
        v = v_cache[:, first:visible].double().repeat_interleave(heads // kv, dim=0)
        scores = scale * torch.einsum("hd,hkd->hk", q[i].double(), k)
        weights = torch.softmax(softcap * torch.tanh(scores / softcap) if softcap > 0 else scores, dim=-1)
        out[i] = torch.einsum("hk,hkd->hd", weights, v)
    return out.view(tokens, heads * hd).to(q.dtype)


def check_rotary(got, expected, before, length, dtype):
    """``got``/``expected``: (q, k_cache, v_cache) after the write; ``before``: the caches before it."""
    assert_close(got[0], expected[0], dtype, "q")
    max_len = before[0].shape[1]
    written = [p for p in range(length, length + got[0].shape[0]) if 0 <= p < max_len]
    kept = [p for p in range(max_len) if p not in written]
    for name, cache, want, old in zip(("k_cache", "v_cache"), got[1:], expected[1:], before):
        cache = cache.cpu()
        assert torch.equal(cache[:, kept], old[:, kept]), f"{name}: a position outside the new tokens' changed"
        if name == "v_cache":  # values are copied, not computed
            assert torch.equal(cache[:, written], want[:, written]), "v_cache: written values differ"
        else:
            assert_close(cache[:, written], want[:, written], dtype, name)


def run_rotary(args):
    """The op on ``args`` (caches written in place): (q, k_cache, v_cache)."""
    q = ops.rotary_cache_write(**args)
    return q, args["k_cache"], args["v_cache"]


# ---- CPU against float64 -----------------------------------------------------------------------

# (M, K, N): M in 1, 3, 7, 16; odd K and N.
LINEAR_SHAPES = [(1, 97, 203), (3, 203, 97), (7, 16, 5), (16, 97, 64)]


@dtype_params
@pytest.mark.parametrize("option", LINEAR_OPTIONS)
@pytest.mark.parametrize("M,K,N", LINEAR_SHAPES)
def test_fused_linear(M, K, N, option, dtype):
    args = linear_args(M, K, N, option, dtype)
    out = ops.fused_linear(**args)
    assert out.shape == (M, N) and out.dtype == dtype
    assert_close(out, fused_linear64(**args), dtype, "out")


@device_params
@dtype_params
def test_eps_zero_is_a_valid_norm_epsilon(dtype, device):
    # eps >= 0 is the contract: 0 normalizes by the root mean square alone (rows drawn nonzero), in
    # fused_linear's norm and rotary_cache_write's q/k norms; a check that refused it passed every
    # other test, which drew eps from 1e-6 up.
    args = on(linear_args(3, 17, 5, "norm+residual", dtype, eps=0.0), device)
    assert_close(ops.fused_linear(**args), fused_linear64(**args), dtype, "fused_linear")
    args = on({**rotary_args(3, 4, 2, 10, 9, 2, True, dtype), "eps": 0.0}, device)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    expected = rotary_cache_write64(**clone(args))
    check_rotary(run_rotary(args), expected, before, 2, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_linear_rounds_once_after_the_bias(dtype):
    # The bias joins the float32 sum before its one rounding to the input dtype. Dyadic inputs make
    # every float32 sum exact in any order, so the result is exactly the float64 value rounded once:
    # rounding the product first and adding the bias in the input dtype differs by an ulp at times.
    g = generator("fused_linear rounds once", str(dtype))
    M, K, N = 5, 9, 13
    x = torch.randint(-127, 128, (M, K), generator=g).double() / 128
    weight = torch.randint(-127, 128, (N, K), generator=g).double() / 128
    bias = torch.randint(-255, 256, (N,), generator=g).double() / 4096
    want = (x @ weight.t() + bias).to(dtype)
    got = ops.fused_linear(x.to(dtype), weight.to(dtype), bias=bias.to(dtype))
    assert torch.equal(got, want)
    # The inputs can tell the two apart: rounding twice gives other bits here.
    twice = (x @ weight.t()).to(dtype).float().add(bias.float()).to(dtype)
    assert not torch.equal(twice, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_linear_gate_rounds_the_activation_then_the_product(dtype):
    # h = silu(gate) * up in the input dtype (docs/kernels.md): silu rounded, then the product. An
    # identity weight makes each output one product, so the result shows h's bits.
    g = generator("fused_linear gate rounds twice", str(dtype))
    M, K = 5, 37
    x = randn(g, M, 2 * K, dtype=dtype, scale=2.0)
    gate, up = x.chunk(2, dim=1)
    want = F.silu(gate) * up
    assert torch.equal(ops.fused_linear(x, torch.eye(K, dtype=dtype), gated=True), want)
    # The inputs can tell the two apart: one rounding of the float32 product gives other bits here.
    assert not torch.equal((F.silu(gate.float()) * up.float()).to(dtype), want)


def test_ops_record_no_history_under_no_grad():
    # Under torch.no_grad a result takes no grad_fn, as torch's own ops: a backward through it would
    # otherwise raise the op's "not implemented" instead of torch's "does not require grad".
    args = rotary_args(2, 4, 2, 8, 10, 3, True, torch.float32)
    with torch.no_grad():
        out = ops.fused_linear(args["qkv"].requires_grad_(), torch.ones(5, 64))
        q = ops.rotary_cache_write(**args)
    assert out.grad_fn is None and not out.requires_grad
    assert q.grad_fn is None and not q.requires_grad


@pytest.mark.parametrize("cache", ["k_cache", "v_cache"])
def test_length_must_not_share_memory_with_the_caches(cache):
    # length is read while the caches are written: its 8 bytes inside a cache are refused too.
    args = rotary_args(1, 2, 1, 8, 6, 0, False, torch.float32)
    length = args[cache].view(-1)[-2:].view(torch.int64).view(())
    length.fill_(1)
    args["length"] = length
    expect(ValueError, f"length must not share memory with {cache}", "rotary_cache_write", args)


@device_params
def test_fused_linear_static_weight_same_result(device):
    # static_weight only lets the CUDA kernel read the weight before the previous kernel has ended.
    args = on(linear_args(5, 97, 64, "norm+bias+residual", torch.bfloat16), device)
    out = ops.fused_linear(**args)
    assert torch.equal(ops.fused_linear(**args, static_weight=True), out)
    # A weight that is not contiguous is copied first, by the kernel just before the GEMV.
    strided = args["weight"].t().contiguous().t()
    assert not strided.is_contiguous()
    assert torch.equal(ops.fused_linear(**{**args, "weight": strided}, static_weight=True), out)


@device_params
@pytest.mark.parametrize("option", LINEAR_OPTIONS)
def test_fused_linear_without_tokens(option, device):
    # As F.linear: x [0, K] gives [0, N].
    args = on(linear_args(3, 97, 64, option, torch.bfloat16), device)
    args = {name: value[:0] if name in ("x", "residual") and value is not None else value for name, value in args.items()}
    out = ops.fused_linear(**args)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16 and out.device == args["x"].device


@device_params
def test_cache_writes_act_like_in_place_ops(device):
    # Like torch's in-place ops: a write into a leaf that requires grad raises; a written cache's
    # version goes up, so a backward that saved its old values raises instead of using the new ones;
    # and a written cache (or its view) that requires grad takes the op's history, whose backward raises.
    args = on(rotary_args(2, 6, 1, 8, 10, 3, False, torch.float32), device)
    for cache in ("k_cache", "v_cache"):  # named: torch's own words name no argument
        with pytest.raises(RuntimeError, match=f"flashhead.rotary_cache_write: {cache} is written in place: a leaf "
                                               "Variable that requires grad is being used in an in-place operation"):
            ops.rotary_cache_write(**{**args, cache: args[cache].clone().requires_grad_()})
    weight = torch.ones((), device=device, requires_grad=True)
    k_cache = args["k_cache"] * weight
    loss = (k_cache * k_cache).sum()  # saves k_cache for its backward
    versions = k_cache._version, args["v_cache"]._version
    ops.rotary_cache_write(**{**args, "k_cache": k_cache})
    assert (k_cache._version, args["v_cache"]._version) == (versions[0] + 1, versions[1] + 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    for written in (lambda cache: cache, lambda cache: cache.unsqueeze(0)[0]):  # the cache, or a view of it
        k_cache = args["k_cache"] * weight
        ops.rotary_cache_write(**{**args, "k_cache": written(k_cache)})
        with pytest.raises(RuntimeError, match="derivative for flashhead::rotary_cache_write is not implemented"):
            k_cache.sum().backward()


def test_layout_does_not_change_the_bits():
    # The CPU references: a qkv laid out column-major (q_norm's sums ran over strided heads) and
    # a one-token product with an operand at an odd element offset (BLAS took another path) gave
    # other last bits than their contiguous copies.
    rotary = rotary_args(3, 4, 2, 8, 12, 2, True, torch.float32)
    want = ops.rotary_cache_write(**clone(rotary))
    assert torch.equal(ops.rotary_cache_write(**dict(clone(rotary), qkv=rotary["qkv"].t().contiguous().t())), want)
    linear = linear_args(1, 16, 24, "norm", torch.float32)
    want = ops.fused_linear(**linear)
    for name in ("x", "weight"):
        assert torch.equal(ops.fused_linear(**dict(linear, **{name: at_odd_offset(linear[name])})), want), name
    # The gated activation over strided halves of a column-major x (silu's strided loop rounds
    # otherwise than its vectorised one).
    for M in (3, 7):
        gated = linear_args(M, 24, 12, "gated", torch.float32)
        want = ops.fused_linear(**gated)
        assert torch.equal(ops.fused_linear(**dict(gated, x=gated["x"].t().contiguous().t())), want), M


def test_fused_linear_options_matter():
    # Each option changes the result by far more than the tolerance (the test above can fail).
    base = linear_args(7, 97, 64, "norm+bias+residual", torch.float32)
    out = ops.fused_linear(**base)
    for change in (dict(norm_weight=None), dict(residual=None), dict(bias=None), dict(eps=1e-6)):
        assert not torch.allclose(ops.fused_linear(**{**base, **change}), out, **TOL[torch.float32]), change


# (M, H, KV, hd, max_len, length)
ROTARY_CASES = [
    (1, 4, 2, 16, 40, 0),
    (3, 6, 1, 64, 40, 37),    # the last three positions
    (7, 8, 8, 128, 50, 20),
    (16, 4, 2, 64, 16, 0),    # fills the cache
    (5, 6, 1, 16, 33, 31),    # positions 33..35 are beyond the cache: NaN q rows, no write
    (4, 8, 8, 16, 20, -2),    # positions -2, -1 likewise
    (3, 4, 2, 16, 20, 20),    # every position beyond
]


@dtype_params
@pytest.mark.parametrize("qk_norm", [False, True], ids=["no-qk-norm", "qk-norm"])
@pytest.mark.parametrize("M,H,KV,hd,max_len,length", ROTARY_CASES)
def test_rotary_cache_write(M, H, KV, hd, max_len, length, qk_norm, dtype):
    args = rotary_args(M, H, KV, hd, max_len, length, qk_norm, dtype)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    expected = rotary_cache_write64(**clone(args))
    got = run_rotary(args)
    assert got[0].shape == (M, H, hd) and got[0].dtype == dtype
    in_range = torch.tensor([0 <= length + i < max_len for i in range(M)])
    assert torch.equal(got[0].isnan().all(2).all(1), ~in_range) and not got[0][in_range].isnan().any()
    check_rotary(got, expected, before, length, dtype)


def test_rotary_cache_write_norms_matter():
    args = rotary_args(3, 4, 2, 16, 20, 5, True, torch.float32)
    q = ops.rotary_cache_write(**clone(args))
    q_plain = ops.rotary_cache_write(**{**clone(args), "q_norm": None, "k_norm": None})
    assert not torch.allclose(q, q_plain, **TOL[torch.float32])


# (M, H, KV, hd, max_len, length, scale)
ATTENTION_CASES = [
    (1, 4, 2, 16, 40, 0, None),     # a single visible key
    (3, 6, 1, 64, 40, 37, None),
    (7, 8, 8, 128, 50, 20, 0.37),
    (16, 4, 2, 64, 16, 0, None),
    (5, 6, 1, 16, 33, 31, None),    # rows 2.. are beyond the cache: they see every key
    (4, 8, 8, 16, 20, -2, 0.37),    # rows 0, 1 see no key: NaN
    (17, 4, 2, 32, 48, 9, None),    # 34 rows of a KV head: CUDA tiles of 3 rows, the last one of 1
    (16, 64, 1, 16, 24, 3, None),   # 1024 rows of a KV head: CUDA tiles of 32 rows
]


@device_params
@dtype_params
@pytest.mark.parametrize("M,H,KV,hd,max_len,length,scale", ATTENTION_CASES)
def test_decode_attention(M, H, KV, hd, max_len, length, scale, dtype, device):
    args = attention_args(M, H, KV, hd, max_len, length, dtype, scale)
    out = ops.decode_attention(**on(args, device)).cpu()
    assert out.shape == (M, H * hd) and out.dtype == dtype
    assert torch.equal(out.isnan().all(1), torch.tensor([length + i < 0 for i in range(M)]))
    assert_close(out, decode_attention64(**args), dtype, "out")


@device_params
@dtype_params
def test_decode_attention_reads_exactly_the_visible_keys(dtype, device):
    # Changing the key or value at position p changes exactly the rows that see p (length + i >= p).
    M, length, max_len = 6, 9, 24
    args = on(attention_args(M, 4, 2, 16, max_len, length, dtype), device)
    base = ops.decode_attention(**args)
    g = generator("visible", str(dtype))
    for pos in [0, length - 1, *range(length, length + M + 1), max_len - 1]:
        sees = torch.tensor([length + i >= pos for i in range(M)])
        for name in ("k_cache", "v_cache"):
            changed = dict(args)
            changed[name] = args[name].clone()
            changed[name][:, pos] = randn(g, 2, 16, dtype=dtype, scale=3.0, shift=2.0).to(device)
            out = ops.decode_attention(**changed)
            same = (out == base).all(1).cpu()
            assert torch.equal(same, ~sees), f"{name} at {pos}: rows unchanged {same.tolist()}, see it {sees.tolist()}"


@device_params
@dtype_params
@pytest.mark.parametrize("stale", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_decode_attention_ignores_non_finite_entries_past_the_visible_keys(stale, dtype, device):
    # Not even NaN or inf (memory from torch.empty, a rejected draft's NaN) may reach a row from a
    # position it does not see; a weight of 0 does not cancel them (0 * inf and 0 * NaN are NaN).
    # Positions 9..23 share the CUDA kernel's split of 32 keys with the visible ones.
    M, length, max_len = 3, 6, 24
    args = on(attention_args(M, 4, 2, 16, max_len, length, dtype), device)
    expected = ops.decode_attention(**args)
    for name in ("k_cache", "v_cache"):
        args[name][:, length + M:] = stale
    torch.testing.assert_close(ops.decode_attention(**args), expected, rtol=0, atol=0)


@device_params
@pytest.mark.parametrize("length", [2**63 - 1, 2**62, 2**31])
def test_decode_attention_far_past_the_cache_sees_it_all(length, device):
    # Token i's last visible key is min(length + i, max_len - 1); length + i must not overflow.
    args = on(attention_args(5, 4, 2, 16, 24, 24, torch.float32), device)
    whole = ops.decode_attention(**args)
    far = ops.decode_attention(**dict(args, length=torch.tensor(length, device=device)))
    assert not far.isnan().any() and torch.equal(far, whole)


# ---- bad inputs: the exception type and a message naming the argument --------------------------

M_, K_, N_, H_, KV_, HD_, MAX_LEN_ = 3, 8, 5, 4, 2, 8, 12


def valid_args(device):
    g = generator("bad-inputs")
    r = lambda *shape: randn(g, *shape, dtype=torch.float32).to(device)
    return dict(
        x=r(M_, K_), weight=r(N_, K_), norm_weight=r(K_), gated=False, residual=r(M_, N_), bias=r(N_), eps=1e-6,
        static_weight=False,
        qkv=r(M_, (H_ + 2 * KV_) * HD_), cos=r(MAX_LEN_, HD_), sin=r(MAX_LEN_, HD_),
        length=torch.tensor(2, device=device), k_cache=r(KV_, MAX_LEN_, HD_), v_cache=r(KV_, MAX_LEN_, HD_),
        num_heads=H_, q_norm=r(HD_), k_norm=r(HD_), q=r(M_, H_, HD_), scale=0.5,
    )


USES = {
    "fused_linear": ("x", "weight", "norm_weight", "eps", "gated", "residual", "bias", "static_weight"),
    "rotary_cache_write": ("qkv", "cos", "sin", "length", "k_cache", "v_cache", "num_heads", "q_norm", "k_norm", "eps"),
    "decode_attention": ("q", "k_cache", "v_cache", "length", "scale"),
}


def call(op, args):
    return getattr(ops, op)(**{name: args[name] for name in USES[op]})


def cases(*names):
    return [(op, name) for op in USES for name in names if name in USES[op]]


def expect(error, fragment, op, args):
    with pytest.raises(error, match=re.escape(fragment)):
        call(op, args)


@device_params
@pytest.mark.parametrize("op", list(USES))
def test_valid_arguments_are_accepted(op, device):
    call(op, valid_args(device))  # the baseline every bad-input test below perturbs


@device_params
@pytest.mark.parametrize("op,name", cases("x", "weight", "norm_weight", "residual", "bias", "qkv", "cos", "sin", "length",
                                          "k_cache", "v_cache", "q_norm", "k_norm", "q"))
def test_non_tensor_argument(op, name, device):
    args = valid_args(device)
    args[name] = args[name].tolist()
    expect(TypeError, f"{name} must be a torch.Tensor", op, args)


@device_params
@pytest.mark.parametrize("op,name", [("fused_linear", "x"), ("rotary_cache_write", "qkv"), ("decode_attention", "q")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_unsupported_dtype(op, name, dtype, device):
    args = valid_args(device)
    args[name] = args[name].to(dtype)
    expect(TypeError, f"{name} must be float16, bfloat16 or float32", op, args)


@device_params
@pytest.mark.parametrize("op,name", cases("weight", "norm_weight", "residual", "bias", "cos", "sin", "k_cache", "v_cache",
                                          "q_norm", "k_norm"))
def test_mixed_dtypes(op, name, device):
    args = valid_args(device)
    args[name] = args[name].to(torch.bfloat16)
    expect(TypeError, f"{name} must have the dtype of", op, args)


@device_params
@pytest.mark.parametrize("op,name", cases("x", "weight", "qkv", "k_cache", "q"))
def test_wrong_rank(op, name, device):
    args = valid_args(device)
    value = args[name]
    args[name] = value.unsqueeze(0)
    expect(ValueError, f"{name} must be a {value.dim()}-D tensor", op, args)


@pytest.mark.parametrize("op,name", cases("x", "weight", "qkv", "k_cache", "q"))
def test_wrong_rank_compiled(op, name):
    # Fewer dimensions: the fake kernels index the sizes they read (more reach the C++ checks).
    args = valid_args("cpu")
    value = args[name]
    args[name] = value[0]
    expect_compiled(f"{name} must be a {value.dim()}-D tensor", functools.partial(call, op), args)


@pytest.mark.parametrize("num_heads", [0, -2])
def test_num_heads_below_one_compiled(num_heads):
    args = valid_args("cpu")
    args["num_heads"] = num_heads
    expect_compiled("num_heads must be", functools.partial(call, "rotary_cache_write"), args)


# (op, changed arguments from the valid ones, message fragment)
SHAPE_CASES = [
    ("fused_linear", lambda a: dict(x=a["x"][:, :-1]), f"x must have in_features = {K_} columns"),
    # The message names gated, which is what a caller may have set by mistake.
    ("fused_linear", lambda a: dict(gated=True, norm_weight=None),
     f"x must have 2 * in_features (gated: gate then up) = {2 * K_} columns for weight of shape [{N_}, {K_}]"),
    ("fused_linear", lambda a: dict(weight=a["weight"][:, :-1]), f"for weight of shape [{N_}, {K_ - 1}]"),
    ("fused_linear", lambda a: dict(weight=a["weight"][:0]), f"weight must be non-empty, got shape [0, {K_}]"),
    ("fused_linear", lambda a: dict(norm_weight=a["norm_weight"][:-1]), f"norm_weight must have shape [{K_}]"),
    ("fused_linear", lambda a: dict(residual=a["residual"][:, :-1]), f"residual must have shape [x.size(0), weight.size(0)] = [{M_}, {N_}]"),
    ("fused_linear", lambda a: dict(bias=a["bias"][None]), f"bias must have shape [weight.size(0)] = [{N_}]"),
    ("rotary_cache_write", lambda a: dict(qkv=a["qkv"][:, :-HD_]), "qkv must have (num_heads + 2 * num_kv_heads)"),
    # No tokens: an error here and in decode_attention (fused_linear gives [0, N], as F.linear).
    ("rotary_cache_write", lambda a: dict(qkv=a["qkv"][:0]), "columns and at least one row, got shape [0, "),
    ("rotary_cache_write", lambda a: dict(cos=a["cos"][:-1]), f"cos must have shape [{MAX_LEN_}, {HD_}]"),
    ("rotary_cache_write", lambda a: dict(sin=a["sin"][:, :-1]), f"sin must have shape [{MAX_LEN_}, {HD_}]"),
    ("rotary_cache_write", lambda a: dict(q_norm=a["q_norm"][:-1]), f"q_norm must have shape [{HD_}]"),
    ("rotary_cache_write", lambda a: dict(k_norm=a["k_norm"][None]), f"k_norm must have shape [{HD_}]"),
    ("rotary_cache_write", lambda a: dict(k_norm=None), "q_norm and k_norm must be given together"),
    ("rotary_cache_write", lambda a: dict(v_cache=a["v_cache"][:, :-1]), "k_cache and v_cache must have one shape"),
    ("rotary_cache_write", lambda a: dict(k_cache=a["k_cache"][:, :0], v_cache=a["v_cache"][:, :0]),
     "k_cache must be non-empty"),
    ("decode_attention", lambda a: dict(q=a["q"][:, :, :-1]), f"head_dim {HD_}], got shape [{M_}, {H_}, {HD_ - 1}]"),
    ("decode_attention", lambda a: dict(q=a["q"][:, :-1]), f"q must be [tokens >= 1, a multiple of num_kv_heads ({KV_})"),
    ("decode_attention", lambda a: dict(q=a["q"][:0]), f"q must be [tokens >= 1, a multiple of num_kv_heads ({KV_})"),
    ("decode_attention", lambda a: dict(v_cache=a["v_cache"][:-1]), "k_cache and v_cache must have one shape"),
]


@device_params
@pytest.mark.parametrize("op,change,fragment", SHAPE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SHAPE_CASES)])
def test_shape_mismatch(op, change, fragment, device):
    args = valid_args(device)
    args.update(change(args))
    expect(ValueError, fragment, op, args)


@device_params
def test_odd_head_dim(device):
    args = valid_args(device)
    for name in ("k_cache", "v_cache", "cos", "sin", "q_norm", "k_norm"):
        args[name] = args[name][..., :-1].contiguous()
    args["qkv"] = args["qkv"][:, :(H_ + 2 * KV_) * (HD_ - 1)]
    expect(ValueError, f"head_dim (k_cache.size(2)) must be even for rotary embeddings, got {HD_ - 1}",
           "rotary_cache_write", args)


@device_params
@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_written_in_place_must_be_contiguous(name, device):
    args = valid_args(device)
    expected = call("decode_attention", args)
    args[name] = args[name].transpose(0, 1).contiguous().transpose(0, 1)  # same shape, heads not outermost
    expect(ValueError, "k_cache and v_cache must be contiguous", "rotary_cache_write", args)
    assert torch.equal(call("decode_attention", args), expected)  # reading a strided cache is fine


@device_params
@pytest.mark.parametrize("overlap", ["same", "partial", "another-storage", "adjacent"])
def test_caches_written_in_place_must_not_share_memory(overlap, device):
    # One buffer for both caches would hold the values over the keys, silently.
    args = valid_args(device)
    kv, max_len, hd = args["k_cache"].shape
    size = kv * max_len * hd
    if overlap == "same":
        args["v_cache"] = args["k_cache"]
    elif overlap == "another-storage":  # the same memory through a second storage object
        args["v_cache"] = torch.utils.dlpack.from_dlpack(args["k_cache"])
        assert args["v_cache"].untyped_storage() is not args["k_cache"].untyped_storage()
    else:  # [KV, max_len, hd] views in one buffer: one position apart, or back to back
        shift = hd if overlap == "partial" else size
        buffer = torch.zeros(size + shift, dtype=args["k_cache"].dtype, device=device)
        args["k_cache"], args["v_cache"] = buffer[:size].view(kv, max_len, hd), buffer[shift:].view(kv, max_len, hd)
    if overlap == "adjacent":
        call("rotary_cache_write", args)  # back to back is apart
        return
    expect(ValueError, "k_cache and v_cache must not share memory", "rotary_cache_write", args)
    call("decode_attention", args)  # reading one cache as both is allowed


@device_params
@pytest.mark.parametrize("name,cache", [("qkv", "k_cache"), ("cos", "v_cache"), ("q_norm", "k_cache")])
def test_inputs_must_not_share_memory_with_the_caches_written(name, cache, device):
    # The same values, held in the cache's last elements: on CUDA a block's cache write could land
    # where another block still reads them (qkv here fills the whole cache).
    args = valid_args(device)
    value = args[name]
    args[name] = args[cache].flatten()[-value.numel():].copy_(value.flatten()).view(value.shape)
    expect(ValueError, f"{name} must not share memory with {cache}", "rotary_cache_write", args)
    call("decode_attention", args)  # an op that only reads the caches takes them


@device_params
def test_decoder_op_with_one_tensor_on_meta(device):
    args = valid_args(device)
    args["k_cache"] = args["k_cache"].to("meta")
    expect(ValueError, "k_cache must be on the same device as", "rotary_cache_write", args)


@pytest.mark.gpu
@pytest.mark.parametrize("op,name", [(op, name) for op in USES for name in USES[op]
                                     if name not in ("eps", "gated", "static_weight", "num_heads", "scale")])
def test_wrong_device(op, name):
    args = valid_args("cuda")
    args[name] = args[name].cpu()
    with pytest.raises(ValueError, match="must be on the same device as") as error:
        call(op, args)
    assert name in str(error.value)


# (length on device d, error, fragment): every way a cache length can be malformed.
BAD_LENGTHS = [
    pytest.param(lambda d: torch.tensor(2, dtype=torch.int32, device=d), TypeError, "length must be an int64 tensor", id="int32"),
    pytest.param(lambda d: torch.tensor(2.0, device=d), TypeError, "length must be an int64 tensor", id="float"),
    pytest.param(lambda d: torch.tensor([2, 3], device=d), ValueError, "length must hold exactly one value", id="two-values"),
    pytest.param(lambda d: torch.empty(0, dtype=torch.int64, device=d), ValueError, "length must hold exactly one value",
                 id="empty"),
    pytest.param(lambda d: 2, TypeError, "length must be a torch.Tensor", id="python-int"),
]


@device_params
@pytest.mark.parametrize("op", ["rotary_cache_write", "decode_attention"])
@pytest.mark.parametrize("length,error,fragment", BAD_LENGTHS)
def test_bad_length(op, length, error, fragment, device):
    args = valid_args(device)
    args["length"] = length(device)
    expect(error, fragment, op, args)


def bad_num_heads_cases(heads: int, kv_heads: int, kv_dim: int) -> list:
    """(num_heads, error, fragment) for ops whose k_cache holds num_kv_heads in dimension kv_dim."""
    multiple = "num_heads must be a positive multiple of num_kv_heads"
    # kv_heads << 60: the shape products the checks compare would overflow int64.
    return [(heads + 1, ValueError, f"{multiple} ({kv_heads}, k_cache.size({kv_dim})) up to 65536, got {heads + 1}"),
            (0, ValueError, multiple), (-kv_heads, ValueError, multiple), (kv_heads << 60, ValueError, "up to 65536"),
            (kv_heads * 65537, ValueError, "up to 65536"),
            (float(heads), TypeError, "num_heads must be a Python int"), (True, TypeError, "num_heads must be a Python int")]


@device_params
@pytest.mark.parametrize("num_heads,error,fragment", bad_num_heads_cases(H_, KV_, 0))
def test_bad_num_heads(num_heads, error, fragment, device):
    args = valid_args(device)
    args["num_heads"] = num_heads
    expect(error, fragment, "rotary_cache_write", args)


@device_params
def test_num_heads_at_the_bound_passes_the_shared_checks(device):
    # ops.NUM_HEADS_MAX itself passes the checks both devices share (one token, two KV heads of
    # head_dim 8: 1M elements of q). The CPU runs it; CUDA's grid holds 65,535 heads
    # (test_cuda_grid_limits), so there the kernel's own limit is what refuses it.
    args = valid_args(device)
    heads = ops.NUM_HEADS_MAX
    args.update(num_heads=heads, qkv=randn(generator("num_heads bound"), 1, (heads + 2 * KV_) * HD_,
                                           dtype=torch.float32).to(device))
    if device == "cpu":
        q = call("rotary_cache_write", args)
        assert q.shape == (1, heads, HD_) and torch.isfinite(q).all()
    else:
        expect(ValueError, f"the CUDA kernel takes at most 65535 heads (num_heads + num_kv_heads), got {heads} + {KV_}",
               "rotary_cache_write", args)
    args["num_heads"] = heads + KV_
    expect(ValueError, f"up to {heads}, got {heads + KV_}", "rotary_cache_write", args)


@device_params
def test_norm_and_gated_together(device):
    args = valid_args(device)
    args.update(gated=True, x=torch.cat([args["x"], args["x"]], dim=1))
    expect(ValueError, "norm_weight and gated cannot be combined", "fused_linear", args)


@device_params
@pytest.mark.parametrize("op,name,value,error,fragment", [
    *[(op, "eps", v, ValueError, "eps must be a finite number >= 0") for op in ("fused_linear", "rotary_cache_write")
      for v in (float("nan"), float("inf"), -1e-6)],
    *[("decode_attention", "scale", v, ValueError, "scale must be in (0, 1e+06]")
      for v in (float("nan"), float("inf"), 0.0, -0.5, 1.01e6, 1e300)],
    ("fused_linear", "eps", "small", TypeError, "eps must be a Python float or int"),
    ("rotary_cache_write", "eps", None, TypeError, "eps must be a Python float or int"),
    ("decode_attention", "scale", "big", TypeError, "scale must be a Python float or int"),
    ("fused_linear", "gated", 1, TypeError, "gated must be a bool"),
    ("fused_linear", "static_weight", 1, TypeError, "static_weight must be a bool"),
], ids=repr)
def test_bad_scalars(op, name, value, error, fragment, device):
    args = valid_args(device)
    args[name] = value
    expect(error, fragment, op, args)


@device_params
def test_attention_scale_bound_is_ops_attention_scale_max(device):
    # The fast decoder refuses its kernel bodies by this constant; it must be the kernels' own bound.
    args = dict(valid_args(device), scale=ops.ATTENTION_SCALE_MAX)
    call("decode_attention", args)
    args["scale"] = math.nextafter(ops.ATTENTION_SCALE_MAX, math.inf)
    expect(ValueError, "scale must be in (0, 1e+06]", "decode_attention", args)


@device_params
def test_raw_ops_check_too(device):
    # The C++ checks guard torch.ops.flashhead callers that bypass the Python wrappers.
    a = valid_args(device)
    raw = torch.ops.flashhead
    with pytest.raises(ValueError, match=re.escape("norm_weight and gated cannot be combined")):
        raw.fused_linear(torch.cat([a["x"], a["x"]], 1), a["weight"], a["norm_weight"], 1e-6, True, None)
    with pytest.raises(TypeError, match=re.escape("length must be an int64 tensor")):
        raw.rotary_cache_write(a["qkv"], a["cos"], a["sin"], a["length"].int(), a["k_cache"], a["v_cache"], H_, None,
                               None, 1e-6)
    with pytest.raises(ValueError, match=re.escape("scale must be in (0, 1e+06]")):
        raw.decode_attention(a["q"], a["k_cache"], a["v_cache"], a["length"], 0.0)


@device_params
@pytest.mark.parametrize("op,name", [(op, name) for op in USES for name in required_tensor_arguments(op)])
def test_raw_op_with_none_for_a_tensor(op, name, device):
    # torch.ops passes None as an undefined tensor: named here, not "Unimplemented scalar type".
    with pytest.raises(TypeError, match=re.escape(f"{name} must be a tensor, got None")):
        raw_call(op, valid_args(device), **{name: None})


def test_default_scale_is_inverse_sqrt_head_dim():
    args = attention_args(3, 4, 2, 16, 20, 5, torch.float32)
    assert torch.equal(ops.decode_attention(**args), ops.decode_attention(**{**args, "scale": 0.25}))


# ---- opcheck -----------------------------------------------------------------------------------

OPCHECK_CASES = {
    "fused_linear-norm+residual": ("fused_linear", lambda: linear_args(3, 16, 5, "norm+residual", torch.bfloat16)),
    "fused_linear-gated": ("fused_linear", lambda: linear_args(1, 7, 9, "gated", torch.float16)),
    "fused_linear-plain": ("fused_linear", lambda: linear_args(4, 8, 3, "plain", torch.float32)),
    "fused_linear-bias": ("fused_linear", lambda: linear_args(2, 16, 7, "norm+bias+residual", torch.bfloat16)),
    "rotary_cache_write-qk-norm": ("rotary_cache_write", lambda: rotary_args(3, 4, 2, 16, 12, 4, True, torch.bfloat16)),
    "rotary_cache_write": ("rotary_cache_write", lambda: rotary_args(2, 6, 1, 8, 10, 0, False, torch.float32)),
    "decode_attention": ("decode_attention", lambda: {**attention_args(5, 4, 2, 16, 12, 3, torch.float16), "scale": 0.25}),
}


@device_params
@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case, device):
    op, make = OPCHECK_CASES[case]
    torch.library.opcheck(getattr(torch.ops.flashhead, op).default, (), on(make(), device))


@device_params
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case,grad_input", [("fused_linear-norm+residual", "x"), ("rotary_cache_write-qk-norm", "qkv"),
                                             ("decode_attention", "q")])
def test_backward_through_an_op_raises(case, grad_input, compiled, device):
    op, make = OPCHECK_CASES[case]
    check_no_backward(op, getattr(torch.ops.flashhead, op).default, on(make(), device), grad_input, under_compile=compiled)


# ---- GPU: the CUDA ops against the CPU references ----------------------------------------------

# (name, K, N, option): projections of Qwen3-0.6B (D 1024, 16 q / 8 kv heads of 128,
# intermediate 3072), SmolLM2-135M (D 576, 9 / 3 heads of 64, intermediate 1536) and a 32B-like
# down projection (K 25600, D 5120); Qwen2.5-0.5B's biased qkv (D 896, 14 / 2 heads of 64).
GPU_LINEAR_CASES = [
    ("qwen3-qkv", 1024, 4096, "norm"), ("qwen3-o", 2048, 1024, "residual"), ("qwen3-gate_up", 1024, 6144, "norm"),
    ("qwen3-down", 3072, 1024, "gated+residual"), ("qwen3-plain-odd-N", 1024, 4099, "plain"),
    ("smollm2-qkv", 576, 960, "norm"), ("smollm2-o", 576, 576, "residual"), ("smollm2-gate_up", 576, 3072, "norm"),
    ("smollm2-down", 1536, 576, "gated+residual"), ("smollm2-norm+residual-odd-N", 576, 97, "norm+residual"),
    ("smollm2-gated", 1536, 576, "gated"),
    ("qwen2.5-0.5b-qkv-bias", 896, 1152, "norm+bias"), ("qwen2.5-bias-odd-N", 896, 97, "bias"),
]
# (name, H, KV, hd, qk_norm); qwen3-32b and mqa64: attention tiles of several query rows (up to 32).
GPU_HEAD_CONFIGS = [("qwen3", 16, 8, 128, True), ("smollm2", 9, 3, 64, False), ("hd256", 4, 1, 256, True),
                    ("qwen3-32b", 64, 8, 128, True), ("mqa64", 64, 1, 64, False)]
GPU_MAX_LEN = 1024
# (M, length): lengths 0, 1, 500, 1000, the last position, and tokens running past the cache.
GPU_STEPS = [(1, 0), (16, 0), (7, 1), (3, 500), (16, 1000), (1, 1023), (9, 1020)]


@pytest.mark.gpu
@dtype_params
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("name,K,N,option", GPU_LINEAR_CASES, ids=[c[0] for c in GPU_LINEAR_CASES])
def test_cuda_fused_linear(name, K, N, option, M, dtype):
    args = linear_args(M, K, N, option, dtype, eps=1e-6)
    assert_close(ops.fused_linear(**on(args, "cuda")), ops.fused_linear(**args), dtype, name)


@pytest.mark.gpu
@dtype_params
def test_cuda_fused_linear_32b_down_projection(dtype):
    args = linear_args(8, 25600, 5120, "gated+residual", dtype)
    assert_close(ops.fused_linear(**on(args, "cuda")), ops.fused_linear(**args), dtype, "32b-down")


@pytest.mark.gpu
@dtype_params
@pytest.mark.parametrize("M,length", GPU_STEPS)
@pytest.mark.parametrize("name,H,KV,hd,qk_norm", GPU_HEAD_CONFIGS, ids=[c[0] for c in GPU_HEAD_CONFIGS])
def test_cuda_rotary_cache_write(name, H, KV, hd, qk_norm, M, length, dtype):
    args = rotary_args(M, H, KV, hd, GPU_MAX_LEN, length, qk_norm, dtype)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    got = run_rotary(on(args, "cuda"))
    check_rotary(got, run_rotary(args), before, length, dtype)


@pytest.mark.gpu
@dtype_params
@pytest.mark.parametrize("M,length", GPU_STEPS)
@pytest.mark.parametrize("name,H,KV,hd,qk_norm", GPU_HEAD_CONFIGS, ids=[c[0] for c in GPU_HEAD_CONFIGS])
def test_cuda_decode_attention(name, H, KV, hd, qk_norm, M, length, dtype):
    args = attention_args(M, H, KV, hd, GPU_MAX_LEN, length, dtype)
    assert_close(ops.decode_attention(**on(args, "cuda")), ops.decode_attention(**args), dtype, name)


def smollm2_step_args(dtype, M=5):
    """One attention block of SmolLM2 on the GPU: weights, caches and a device length."""
    H, KV, hd, D = 9, 3, 64, 576
    rotary = on(rotary_args(M, H, KV, hd, GPU_MAX_LEN, 3, False, dtype), "cuda")
    g = generator("smollm2-step", str(dtype))
    weights = {k: randn(g, *shape, dtype=dtype, scale=shape[-1] ** -0.5).cuda()
               for k, shape in (("qkv", ((H + 2 * KV) * hd, D)), ("o", (D, H * hd)))}
    return rotary, weights, randn(g, M, D, dtype=dtype).cuda(), randn(g, D, dtype=dtype, scale=0.3, shift=1.0).cuda()


def attention_block(rotary, weights, x, norm_weight):
    qkv = ops.fused_linear(x, weights["qkv"], norm_weight=norm_weight)
    q = ops.rotary_cache_write(**{**rotary, "qkv": qkv})
    o = ops.decode_attention(q, rotary["k_cache"], rotary["v_cache"], rotary["length"])
    return ops.fused_linear(o, weights["o"], residual=x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_graph_replay_at_another_length(dtype):
    rotary, weights, x, norm_weight = smollm2_step_args(dtype)
    initial = (rotary["k_cache"].clone(), rotary["v_cache"].clone())

    def restore():
        rotary["k_cache"].copy_(initial[0])
        rotary["v_cache"].copy_(initial[1])

    outputs = []
    graph = capture_graph(lambda: outputs.append(attention_block(rotary, weights, x, norm_weight)), prepare=restore)
    for length in (3, 500, 0, 1000, 1020):
        rotary["length"].fill_(length)  # the graph reads the length at replay
        restore()
        graph.replay()
        replayed = (outputs[-1].clone(), rotary["k_cache"].clone(), rotary["v_cache"].clone())
        restore()
        eager = attention_block(rotary, weights, x, norm_weight)
        # Exactly equal (same kernels); at 1020 the last token is beyond the cache: NaN rows.
        torch.testing.assert_close(replayed[0], eager, rtol=0, atol=0, equal_nan=True, msg=f"length {length}")
        assert torch.equal(replayed[1], rotary["k_cache"]) and torch.equal(replayed[2], rotary["v_cache"])


# CUDA's grid takes at most 65,535 blocks in y and z: fused_linear's blocks of 8 tokens,
# rotary_cache_write's heads, decode_attention's KV heads and its tiles of up to 32 query rows a KV
# head. (id, the op's outputs as a tuple, its arguments for a size, the largest size it runs, the
# message one past it.)
GRID_LIMIT_CASES = [
    ("fused_linear-tokens", lambda args: (ops.fused_linear(**args),),
     lambda M: linear_args(M, 8, 8, "residual", torch.bfloat16), 524280,
     "the CUDA kernel takes at most 524280 tokens (x.size(0)), got 524281"),
    ("rotary-heads", run_rotary, lambda H: rotary_args(1, H, 1, 2, 4, 1, False, torch.bfloat16), 65534,
     "the CUDA kernel takes at most 65535 heads (num_heads + num_kv_heads), got 65535 + 1"),
    ("attention-kv-heads", lambda args: (ops.decode_attention(**args),),
     lambda KV: attention_args(1, KV, KV, 8, 4, 2, torch.bfloat16), 65535,
     "the CUDA kernel takes at most 65535 KV heads (k_cache.size(0)), got 65536"),
    ("attention-tiles", lambda args: (ops.decode_attention(**args),),
     lambda H: attention_args(1, H, 1, 8, 4, 2, torch.bfloat16), 65535 * 32,
     "the CUDA kernel takes at most 65535 tiles of a KV head's query rows, got 65536"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,outputs,build,limit,message", GRID_LIMIT_CASES, ids=[c[0] for c in GRID_LIMIT_CASES])
def test_cuda_grid_limits(name, outputs, build, limit, message):
    args = build(limit)
    for got, expected in zip(outputs(on(args, "cuda")), outputs(clone(args))):
        assert_close(got, expected, torch.bfloat16, f"{name} at the limit")
    with pytest.raises(ValueError, match=re.escape(message)):
        outputs(on(build(limit + 1), "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("op,change,fragment", [
    ("fused_linear", lambda a: dict(x=a["x"][:1].expand(2**40, -1), residual=None),
     "the number of tokens (x.size(0)) is 1099511627776"),
    ("rotary_cache_write", lambda a: dict(qkv=a["qkv"][:1].expand(2**40, -1)),
     "the number of tokens (qkv.size(0)) is 1099511627776"),
    ("decode_attention", lambda a: dict(q=a["q"][:1].expand(2**40, -1, -1)), "tokens * num_heads (q.size(0) * q.size(1)) is"),
], ids=["fused_linear", "rotary_cache_write", "decode_attention"])
def test_cuda_limits_are_checked_before_inputs_are_copied(op, change, fragment):
    # A stride-0 input of a size past the kernels' int indices is refused by name, as the CPU ops
    # take it. The checks came after the inputs' contiguous copies, which allocated it whole (or
    # failed to) first, and named no argument.
    args = valid_args("cuda")
    args.update(change(args))
    expect(ValueError, fragment, op, args)


@pytest.mark.gpu
def test_cuda_no_host_sync():
    rotary, weights, x, norm_weight = smollm2_step_args(torch.bfloat16)
    gate_up = randn(generator("gate_up"), x.shape[0], 2 * 576, dtype=torch.bfloat16).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attention_block(rotary, weights, x, norm_weight)  # every op but the two below
        ops.fused_linear(gate_up, weights["o"], gated=True, residual=x)
        ops.rotary_cache_write(**{**rotary, "q_norm": norm_weight[:64], "k_norm": norm_weight[64:128]})
    finally:
        torch.cuda.set_sync_debug_mode("default")


def write_layer_one(qkv, cos, sin, length, k_caches, v_caches):
    return ops.rotary_cache_write(qkv, cos, sin, length, k_caches[1], v_caches[1], H_)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [
    False,
    pytest.param(True, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason="pytorch/pytorch#198068: inductor drops a mutated "
                                               "view's symbolic storage offset (the README's note; remove both once fixed)")),
], ids=["static", "dynamic"])
def test_compiled_cache_write_into_a_layer_view(dynamic):
    # Stacked per-layer caches, one layer's view written (the fast decoder's fused body does this).
    g = generator("cache-views")
    args = valid_args("cpu")
    stacked = {name: randn(g, 2, KV_, MAX_LEN_, HD_, dtype=torch.float32) for name in ("k_caches", "v_caches")}
    expected = {name: cache.clone() for name, cache in stacked.items()}
    inputs = [args[name] for name in ("qkv", "cos", "sin", "length")]
    q_eager = write_layer_one(*inputs, expected["k_caches"], expected["v_caches"])
    torch._dynamo.reset()
    q = torch.compile(write_layer_one, fullgraph=True, dynamic=dynamic)(*inputs, stacked["k_caches"], stacked["v_caches"])
    assert torch.equal(q, q_eager)
    for name in stacked:
        assert torch.equal(stacked[name], expected[name]), name
