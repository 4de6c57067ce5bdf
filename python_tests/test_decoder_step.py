"""decoder_step: one token through every layer of a decoder, weights stacked per layer (docs/kernels.md).

Its semantics are the composition, layer by layer, of fused_linear, rotary_cache_write and
decode_attention. CPU: the op against a float64 computation of that composition (the float64
references of test_decoder_ops, rounded where the semantics round) over odd sizes, GQA groups,
with and without q/k norms and the cache edges; and bitwise against the composition of the CPU
ops themselves. Bad inputs: one test per class. opcheck on each device. GPU: the CUDA op (one
persistent kernel) against the CPU op on the same inputs at real models' shapes, consecutive
steps, CUDA-graph replay at another length, no host sync, the CUDA-only size limits.
"""
import math
import re

import pytest
import torch

from flashhead_ext import ops
from flashhead_ext.graphs import capture_graph
from helpers import DEVICES, DTYPES, at_odd_offset, check_no_backward, generator, required_tensor_arguments
from test_decoder_ops import (BAD_LENGTHS, TOL, bad_num_heads_cases, decode_attention64, fused_linear64, randn, rms_norm64,
                              rotary_cache_write64, rotary_tables)

device_params = pytest.mark.parametrize("device", DEVICES)
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=str)

# The C++ argument name of each key of the Python API's weights mapping.
WEIGHT_ARG = {"qkv": "qkv_weight", "o": "o_weight", "gate_up": "gate_up_weight", "down": "down_weight",
              "attn_norm": "attn_norm", "mlp_norm": "mlp_norm", "q_norm": "q_norm", "k_norm": "k_norm",
              "qkv_bias": "qkv_bias", "post_attn_norm": "post_attn_norm", "post_mlp_norm": "post_mlp_norm"}


def to(args: dict, device) -> dict:
    """``args`` (and its weights mapping) on ``device``: new tensors, so the caches are copies."""
    return {k: to(v, device) if isinstance(v, dict) else v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}


def clone(args: dict) -> dict:
    return {k: clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}


# ---- inputs (keyword arguments of ops.decoder_step) -------------------------------------------

def step_args(L, D, I, H, KV, hd, max_len, length, qk_norm, dtype, eps=1e-6, scale=None, key=(), qkv_bias=False,
              gemma=False, softcap=0.0):
    """Random seeded weights scaled by fan_in^-0.5 (values stay O(1) through the layers), random
    (stale) caches, random rotary tables and norm weights around 1; q/k/v biases (Qwen2) drawn
    next, then with ``gemma`` Gemma-3's options: post-norms, GELU, the even layers sliding over a
    window of a third of the cache with their own rotary tables, and the input scaled by
    sqrt(hidden_size) cast to the dtype, as Gemma-3 scales its embeddings. Drawn last, so the other
    values are those of the same arguments without them. ``softcap``: Gemma-2's cap on the attention
    scores (these scores are O(1): a cap of 50, as Gemma-2's, would change nothing here)."""
    g = generator("decoder_step", L, D, I, H, KV, hd, max_len, length, qk_norm, str(dtype), *key)
    weight = lambda rows, cols: randn(g, L, rows, cols, dtype=dtype, scale=cols ** -0.5)
    norm = lambda n: randn(g, L, n, dtype=dtype, scale=0.3, shift=1.0)
    weights = dict(qkv=weight((H + 2 * KV) * hd, D), o=weight(D, H * hd), gate_up=weight(2 * I, D),
                   down=weight(D, I), attn_norm=norm(D), mlp_norm=norm(D))
    if qk_norm:
        weights.update(q_norm=norm(hd), k_norm=norm(hd))
    cos, sin = rotary_tables(g, max_len, hd, dtype)
    args = dict(x=randn(g, 1, D, dtype=dtype), weights=weights,
                k_cache=randn(g, L, KV, max_len, hd, dtype=dtype), v_cache=randn(g, L, KV, max_len, hd, dtype=dtype),
                cos=cos, sin=sin, length=torch.tensor(length), num_heads=H, eps=eps, scale=scale)
    if qkv_bias:
        weights["qkv_bias"] = randn(g, L, (H + 2 * KV) * hd, dtype=dtype, scale=0.5)
    if gemma:
        weights.update(post_attn_norm=norm(D), post_mlp_norm=norm(D))
        sliding_cos, sliding_sin = rotary_tables(g, max_len, hd, dtype)
        args.update(activation="gelu_tanh", sliding_window=max(1, max_len // 3), sliding_layers=tuple(range(0, L, 2)),
                    sliding_cos=sliding_cos, sliding_sin=sliding_sin, input_scale=torch.tensor(D ** 0.5).to(dtype).item())
    if softcap:
        args["attn_softcap"] = softcap
    return args


def layer_norms(weights, i):
    return {name: weights[name][i] if weights.get(name) is not None else None for name in ("q_norm", "k_norm")}


# ---- references -------------------------------------------------------------------------------

def decoder_step64(x, weights, k_cache, v_cache, cos, sin, length, num_heads, eps, scale, activation="silu",
                   sliding_window=0, sliding_layers=(), sliding_cos=None, sliding_sin=None, input_scale=1.0,
                   attn_softcap=0.0):
    """(out, k_cache, v_cache) as new tensors: the float64 references of each op, composed per layer
    (Gemma-3's options: each output normed before its residual add, rounded like the ops; the input
    scaled and rounded to its dtype first; Gemma-2's capped attention scores)."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    t = x.dtype
    x = (x.double() * input_scale).to(t)

    def add(x, out, post_norm):
        return (x.double() + rms_norm64(out, post_norm, eps).to(t).double()).to(t)

    for i in range(k_cache.shape[0]):
        bias = weights["qkv_bias"][i] if "qkv_bias" in weights else None
        sliding = i in sliding_layers
        tables = (sliding_cos, sliding_sin) if sliding and sliding_cos is not None else (cos, sin)
        post = "post_attn_norm" in weights
        qkv = fused_linear64(x, weights["qkv"][i], weights["attn_norm"][i], eps, False, None, bias)
        norms = layer_norms(weights, i)
        q, k_out[i], v_out[i] = rotary_cache_write64(qkv, *tables, length, k_out[i], v_out[i], num_heads,
                                                     norms["q_norm"], norms["k_norm"], eps)
        o = decode_attention64(q, k_out[i], v_out[i], length, scale, window=sliding_window if sliding else 0,
                               softcap=attn_softcap)
        if post:
            x = add(x, fused_linear64(o, weights["o"][i], None, eps, False, None), weights["post_attn_norm"][i])
        else:
            x = fused_linear64(o, weights["o"][i], None, eps, False, x)
        gate_up = fused_linear64(x, weights["gate_up"][i], weights["mlp_norm"][i], eps, False, None)
        if post:
            down = fused_linear64(gate_up, weights["down"][i], None, eps, True, None, activation=activation)
            x = add(x, down, weights["post_mlp_norm"][i])
        else:
            x = fused_linear64(gate_up, weights["down"][i], None, eps, True, x, activation=activation)
    return x, k_out, v_out


def composition(x, weights, k_cache, v_cache, cos, sin, length, num_heads, eps, scale):
    """The brief's definition with the single-layer ops (the caches' layers are written in place)."""
    for i in range(k_cache.shape[0]):
        qkv = ops.fused_linear(x, weights["qkv"][i], norm_weight=weights["attn_norm"][i], eps=eps,
                               bias=weights["qkv_bias"][i] if "qkv_bias" in weights else None)
        q = ops.rotary_cache_write(qkv, cos, sin, length, k_cache[i], v_cache[i], num_heads, eps=eps,
                                   **layer_norms(weights, i))
        o = ops.decode_attention(q, k_cache[i], v_cache[i], length, scale)
        x = ops.fused_linear(o.view(1, -1), weights["o"][i], residual=x)
        gate_up = ops.fused_linear(x, weights["gate_up"][i], norm_weight=weights["mlp_norm"][i], eps=eps)
        x = ops.fused_linear(gate_up, weights["down"][i], gated=True, residual=x)
    return x


def run_step(args):
    """The op on ``args`` (caches written in place): (out, k_cache, v_cache)."""
    return ops.decoder_step(**args), args["k_cache"], args["v_cache"]


def close(actual, expected, dtype, what, tol=TOL):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), equal_nan=True, msg=lambda m: f"{what}: {m}", **tol[dtype])


def check_step(got, expected, before, length, dtype, what="", tol=TOL):
    """``got``/``expected``: (out, k_cache, v_cache) after the step; ``before``: the caches before it.

    Out of range (``length`` outside [0, max_len)): NaN out and untouched caches. In range: no NaN,
    out and each layer's new key and value close, every other cache position unchanged, bit for bit.
    """
    out, k_cache, v_cache = (t.cpu() for t in got)
    max_len = before[0].shape[2]
    assert out.shape == expected[0].shape and out.dtype == dtype, f"{what}: out {tuple(out.shape)} {out.dtype}"
    in_range = 0 <= length < max_len
    if in_range:
        assert not out.isnan().any(), f"{what}: NaN in the output at an in-range length {length}"
    else:
        assert out.isnan().all(), f"{what}: length {length} is outside the cache, the output must be NaN"
    close(out, expected[0], dtype, f"{what} out", tol)
    written = [length] if in_range else []
    kept = [p for p in range(max_len) if p not in written]
    for name, cache, want, old in zip(("k_cache", "v_cache"), (k_cache, v_cache), expected[1:], before):
        assert torch.equal(cache[:, :, kept], old.cpu()[:, :, kept]), f"{what} {name}: a position other than {length} changed"
        close(cache[:, :, written], want.cpu()[:, :, written], dtype, f"{what} {name} at {length}", tol)


# ---- CPU against float64 ----------------------------------------------------------------------

# (name, L, D, I, H, KV, hd, max_len, qk_norm, eps, scale): odd sizes, GQA groups 2, 1 (MHA) and 5
# (one KV head), with and without q/k norms; a large eps where an op that dropped it would fail, and
# eps 0, which the op accepts (a check that refused it had passed every test).
CPU_CASES = [
    ("odd-gqa2-qk-norm", 3, 40, 72, 4, 2, 10, 12, True, 0.1, None),
    ("gqa2-no-qk-norm", 2, 64, 96, 6, 3, 16, 9, False, 1e-6, None),
    ("mha-qk-norm", 2, 24, 40, 3, 3, 8, 7, True, 0.0, 0.37),
    ("one-kv-head", 1, 36, 20, 5, 1, 12, 6, False, 0.1, None),
]
# The cache length before the token, as a function of max_len: the edges and both sides out of range.
LENGTHS = {"0": lambda n: 0, "middle": lambda n: n // 2, "last": lambda n: n - 1, "max_len": lambda n: n,
           "-1": lambda n: -1}


@dtype_params
@pytest.mark.parametrize("length_name", list(LENGTHS))
@pytest.mark.parametrize("name,L,D,I,H,KV,hd,max_len,qk_norm,eps,scale", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_decoder_step(name, L, D, I, H, KV, hd, max_len, qk_norm, eps, scale, length_name, dtype):
    check_against_float64(name, (L, D, I, H, KV, hd, max_len), qk_norm, eps, scale, length_name, dtype)


def check_against_float64(name, dims, qk_norm, eps, scale, length_name, dtype, **options):
    """The CPU op on step_args(*dims, ..., **options) against decoder_step64."""
    hd, max_len = dims[5], dims[6]
    length = LENGTHS[length_name](max_len)
    args = step_args(*dims, length, qk_norm, dtype, eps=eps, scale=scale, **options)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    expected = decoder_step64(**{**clone(args), "scale": hd ** -0.5 if scale is None else scale})
    check_step(run_step(args), expected, before, length, dtype, name)


@dtype_params
@pytest.mark.parametrize("length_name", ["0", "middle", "max_len"])
@pytest.mark.parametrize("name,L,D,I,H,KV,hd,max_len,qk_norm,eps,scale", CPU_CASES[1::2], ids=[c[0] for c in CPU_CASES[1::2]])
def test_decoder_step_with_qkv_bias(name, L, D, I, H, KV, hd, max_len, qk_norm, eps, scale, length_name, dtype):
    check_against_float64(name, (L, D, I, H, KV, hd, max_len), qk_norm, eps, scale, length_name, dtype, qkv_bias=True)


@dtype_params
@pytest.mark.parametrize("length_name", list(LENGTHS))
@pytest.mark.parametrize("name,L,D,I,H,KV,hd,max_len,qk_norm,eps,scale", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_decoder_step_with_gemma3_options(name, L, D, I, H, KV, hd, max_len, qk_norm, eps, scale, length_name, dtype):
    check_against_float64(name, (L, D, I, H, KV, hd, max_len), qk_norm, eps, scale, length_name, dtype, gemma=True)


@dtype_params
@pytest.mark.parametrize("length_name", ["0", "middle", "max_len"])
@pytest.mark.parametrize("name,L,D,I,H,KV,hd,max_len,qk_norm,eps,scale", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_decoder_step_with_gemma2_cap(name, L, D, I, H, KV, hd, max_len, qk_norm, eps, scale, length_name, dtype):
    check_against_float64(name, (L, D, I, H, KV, hd, max_len), qk_norm, eps, scale, length_name, dtype, gemma=True,
                          softcap=0.8)


def test_weights_at_an_odd_offset_give_the_same_bits():
    # The CPU reference's one-token products used a contiguous float32 weight in place, and BLAS
    # took another path for one starting off a 16-byte boundary: other last bits.
    args = valid_args("cpu")
    want = ops.decoder_step(**clone(args))
    for key in ("qkv", "o", "gate_up", "down"):
        moved = clone(args)
        moved["weights"][key] = at_odd_offset(moved["weights"][key])
        assert torch.equal(ops.decoder_step(**moved), want), key


def test_decoder_step_gemma3_options_matter():
    # Each of Gemma-3's options (and Gemma-2's cap) changes the result by far more than the tolerance,
    # and a window as long as the cache, or no window, equals no sliding layers with their tables as
    # cos and sin.
    base = step_args(3, 40, 72, 4, 2, 10, 12, 9, True, torch.float32, gemma=True)
    out = ops.decoder_step(**clone(base))
    no_post = {k: v for k, v in base["weights"].items() if not k.startswith("post_")}
    for change in (dict(weights=no_post), dict(activation="silu"), dict(sliding_window=base["sliding_window"] + 1),
                   dict(sliding_layers=(1,)), dict(sliding_cos=None, sliding_sin=None), dict(input_scale=1.0),
                   dict(attn_softcap=0.8)):
        changed = ops.decoder_step(**{**clone(base), **clone(change)})
        assert not torch.allclose(changed, out, **TOL[torch.float32]), list(change)
    same_tables = {**clone(base), "cos": base["sliding_cos"], "sin": base["sliding_sin"], "sliding_cos": None,
                   "sliding_sin": None}
    whole = ops.decoder_step(**{**same_tables, "sliding_window": 12})
    assert torch.equal(whole, ops.decoder_step(**{**clone(same_tables), "sliding_layers": (), "sliding_window": 0}))


def test_decoder_step_options_matter():
    # eps, scale, the q/k norms, the q/k/v biases and each layer change the result by far more than
    # the tolerance (so the tests above can fail), and the default scale is 1 / sqrt(head_dim).
    base = step_args(2, 40, 72, 4, 2, 10, 12, 5, True, torch.float32, eps=0.1, qkv_bias=True)
    out = ops.decoder_step(**clone(base))
    assert torch.equal(ops.decoder_step(**{**clone(base), "scale": 1.0 / math.sqrt(10)}), out)
    no_qk_norm = {k: v for k, v in base["weights"].items() if k not in ("q_norm", "k_norm")}
    no_bias = {k: v for k, v in base["weights"].items() if k != "qkv_bias"}
    one_layer = {k: v[:1] for k, v in base["weights"].items()}
    for change in (dict(eps=1e-6), dict(scale=0.9), dict(weights=no_qk_norm), dict(weights=no_bias),
                   dict(weights=one_layer, k_cache=base["k_cache"][:1], v_cache=base["v_cache"][:1])):
        changed = ops.decoder_step(**{**clone(base), **clone(change)})
        assert not torch.allclose(changed, out, **TOL[torch.float32]), list(change)


@dtype_params
@pytest.mark.parametrize("length_name", ["0", "middle", "max_len"])
@pytest.mark.parametrize("name,L,D,I,H,KV,hd,max_len,qk_norm,eps,scale", CPU_CASES[:2], ids=[c[0] for c in CPU_CASES[:2]])
def test_decoder_step_is_the_composition_of_the_layer_ops(name, L, D, I, H, KV, hd, max_len, qk_norm, eps, scale,
                                                          length_name, dtype):
    # The same CPU code path: bitwise equal, caches included.
    args = step_args(L, D, I, H, KV, hd, max_len, LENGTHS[length_name](max_len), qk_norm, dtype, eps=eps, scale=scale)
    want = clone(args)
    got = run_step(args)
    expected = composition(**want)
    torch.testing.assert_close(got[0], expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[1], want["k_cache"]) and torch.equal(got[2], want["v_cache"])


# ---- bad inputs: the exception type and a message naming the argument --------------------------

L_, D_, I_, H_, KV_, HD_, MAX_LEN_ = 2, 16, 16, 4, 2, 8, 12


def valid_args(device):
    """float32, every option given; D, H * hd and I multiples of 8, so valid for the CUDA op's limits too."""
    return to(step_args(L_, D_, I_, H_, KV_, HD_, MAX_LEN_, 3, True, torch.float32, scale=0.5, key=("bad",), qkv_bias=True,
                        gemma=True), device)


def expect(error, fragment, args):
    with pytest.raises(error, match=re.escape(fragment)):
        ops.decoder_step(**args)


@device_params
def test_valid_arguments_are_accepted(device):
    out = ops.decoder_step(**valid_args(device))  # the baseline every bad-input test below perturbs
    assert out.shape == (1, D_) and not out.isnan().any()


@device_params
@pytest.mark.parametrize("name", ["x", "k_cache", "v_cache", "cos", "sin", "length", "sliding_cos", "sliding_sin", *WEIGHT_ARG])
def test_non_tensor_argument(name, device):
    args = valid_args(device)
    if name in WEIGHT_ARG:
        args["weights"][name] = args["weights"][name].tolist()
        fragment = f"weights[{name!r}] must be a torch.Tensor"
    else:
        args[name] = args[name].tolist()
        fragment = f"{name} must be a torch.Tensor"
    expect(TypeError, fragment, args)


@device_params
def test_weights_must_be_a_mapping_with_every_required_key(device):
    args = valid_args(device)
    expect(TypeError, "weights must be a mapping", {**args, "weights": list(args["weights"].values())})
    for key in ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm"):
        expect(ValueError, f"weights is missing {key!r}",
               {**args, "weights": {k: v for k, v in args["weights"].items() if k != key}})
    misspelt = {("q_norms" if k == "q_norm" else k): v for k, v in args["weights"].items()}
    expect(ValueError, "weights has unknown keys ['q_norms']", {**args, "weights": misspelt})


@device_params
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_unsupported_dtype(dtype, device):
    args = valid_args(device)
    args["x"] = args["x"].to(dtype)
    expect(TypeError, "x must be float16, bfloat16 or float32", args)


@device_params
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "cos", "sin", "sliding_cos", "sliding_sin", *WEIGHT_ARG])
def test_mixed_dtypes(name, device):
    args = valid_args(device)
    holder = args["weights"] if name in WEIGHT_ARG else args
    holder[name] = holder[name].to(torch.bfloat16)
    expect(TypeError, f"{WEIGHT_ARG.get(name, name)} must have the dtype of x", args)


@device_params
@pytest.mark.parametrize("name", ["x", "k_cache", *WEIGHT_ARG])
def test_wrong_rank(name, device):
    args = valid_args(device)
    holder = args["weights"] if name in WEIGHT_ARG else args
    rank = holder[name].dim()
    holder[name] = holder[name].unsqueeze(0)
    expect(ValueError, f"{WEIGHT_ARG.get(name, name)} must be a {rank}-D tensor", args)


QKV_ROWS = (H_ + 2 * KV_) * HD_
QKV_LAYOUT = "qkv_weight must have shape [num_layers, (num_heads + 2 * num_kv_heads) * head_dim, hidden_size]"


def weights_change(**changes):
    """A change of the weights mapping: key -> function of the valid tensor (None: drop the key)."""
    def change(a):
        weights = dict(a["weights"])
        for key, f in changes.items():
            if f is None:
                del weights[key]
            else:
                weights[key] = f(weights[key])
        return dict(weights=weights)
    return change


# (id, changed arguments from the valid ones, message fragment)
SHAPE_CASES = [
    ("qkv-rows", weights_change(qkv=lambda w: w[:, :-HD_]),
     f"{QKV_LAYOUT} = [{L_}, {QKV_ROWS}, {D_}], got shape [{L_}, {QKV_ROWS - HD_}, {D_}]"),
    ("qkv-columns", weights_change(qkv=lambda w: w[:, :, :-1]),
     f"qkv_weight and x must have one hidden_size (qkv_weight.size(2) and x.size(1)), got {D_ - 1} and {D_}"),
    ("qkv-layers", weights_change(qkv=lambda w: w[:1]), f"qkv_weight and k_cache must have one num_layers (their size(0)), got 1 and {L_}"),
    ("o", weights_change(o=lambda w: w[:, :, :-1]),
     f"o_weight must have shape [num_layers, hidden_size, num_heads * head_dim] = [{L_}, {D_}, {H_ * HD_}]"),
    ("o-rows", weights_change(o=lambda w: w[:, :-1]), "o_weight must have shape"),
    ("gate_up-odd-rows", weights_change(gate_up=lambda w: w[:, :-1]),
     f"gate_up_weight must have shape [num_layers = {L_}, 2 * intermediate_size (gate rows, then up rows; even and "
     f">= 2), hidden_size = {D_}], got shape [{L_}, {2 * I_ - 1}, {D_}]"),
    ("gate_up-no-rows", weights_change(gate_up=lambda w: w[:, :0]), "gate_up_weight must have shape"),
    ("gate_up-columns", weights_change(gate_up=lambda w: w[:, :, :-1]), "gate_up_weight must have shape"),
    # Named apart from down_weight's shape: the message named down_weight alone, where gate_up_weight
    # may be the wrong one.
    ("gate_up-rows-vs-down", weights_change(gate_up=lambda w: w[:, :-2]),  # I_ - 1 from gate_up, I_ in down
     "gate_up_weight and down_weight must have one intermediate_size (gate_up_weight.size(1) / 2 and "
     f"down_weight.size(2)), got {I_ - 1} and {I_}"),
    ("down", weights_change(down=lambda w: w[:, :, :-1]), f"must have one intermediate_size (gate_up_weight.size(1) / 2 "
     f"and down_weight.size(2)), got {I_} and {I_ - 1}"),
    ("down-rows", weights_change(down=lambda w: w[:, 1:]), "down_weight must have shape"),
    ("attn_norm", weights_change(attn_norm=lambda w: w[:, :-1]),
     f"attn_norm must have shape [num_layers, hidden_size] = [{L_}, {D_}]"),
    ("mlp_norm", weights_change(mlp_norm=lambda w: w[:1]),
     f"mlp_norm must have shape [num_layers, hidden_size] = [{L_}, {D_}]"),
    ("q_norm", weights_change(q_norm=lambda w: w[:, :-1]), f"q_norm must have shape [num_layers, head_dim] = [{L_}, {HD_}]"),
    ("k_norm", weights_change(k_norm=lambda w: w[:1]), f"k_norm must have shape [num_layers, head_dim] = [{L_}, {HD_}]"),
    ("q_norm-without-k_norm", weights_change(k_norm=None), "q_norm and k_norm must be given together"),
    ("qkv_bias", weights_change(qkv_bias=lambda w: w[:, :-1]),
     f"qkv_bias must have shape [num_layers, (num_heads + 2 * num_kv_heads) * head_dim] = [{L_}, {QKV_ROWS}]"),
    ("k_norm-without-q_norm", weights_change(q_norm=None), "q_norm and k_norm must be given together"),
    ("v_cache", lambda a: dict(v_cache=a["v_cache"][:, :, :-1].contiguous()),
     f"k_cache and v_cache must have one shape [num_layers, num_kv_heads, max_len, head_dim], "
     f"got [{L_}, {KV_}, {MAX_LEN_}, {HD_}] and [{L_}, {KV_}, {MAX_LEN_ - 1}, {HD_}]"),
    ("cache-layers", lambda a: dict(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]),
     f"qkv_weight and k_cache must have one num_layers (their size(0)), got {L_} and 1"),
    ("o-layers", weights_change(o=lambda w: w[:1]), f"o_weight must have shape [num_layers, hidden_size, num_heads * head_dim] = [{L_}, "),
    ("empty-cache", lambda a: dict(k_cache=a["k_cache"][:, :, :0], v_cache=a["v_cache"][:, :, :0]),
     "k_cache must be non-empty"),
    ("cos", lambda a: dict(cos=a["cos"][:-1]), f"cos must have shape [{MAX_LEN_}, {HD_}]"),
    ("sin", lambda a: dict(sin=a["sin"][:, :-2]), f"sin must have shape [{MAX_LEN_}, {HD_}]"),
    ("x-two-rows", lambda a: dict(x=torch.cat([a["x"], a["x"]])),
     f"x must have shape [1, hidden_size >= 1] (one token), got shape [2, {D_}]"),
    ("x-no-columns", lambda a: dict(x=a["x"][:, :0]), "x must have shape [1, hidden_size >= 1] (one token)"),
    # Named apart from qkv_weight's shape, as num_layers: the message named qkv_weight alone.
    ("x-columns", lambda a: dict(x=a["x"][:, :-1]),
     f"qkv_weight and x must have one hidden_size (qkv_weight.size(2) and x.size(1)), got {D_} and {D_ - 1}"),
    ("post_attn_norm", weights_change(post_attn_norm=lambda w: w[:, :-1]),
     f"post_attn_norm must have shape [num_layers, hidden_size] = [{L_}, {D_}]"),
    ("post_mlp_norm", weights_change(post_mlp_norm=lambda w: w[:1]),
     f"post_mlp_norm must have shape [num_layers, hidden_size] = [{L_}, {D_}]"),
    ("post_attn_norm-alone", weights_change(post_mlp_norm=None), "post_attn_norm and post_mlp_norm must be given together"),
    ("post_mlp_norm-alone", weights_change(post_attn_norm=None), "post_attn_norm and post_mlp_norm must be given together"),
    ("sliding_cos", lambda a: dict(sliding_cos=a["sliding_cos"][:-1]), f"sliding_cos must have shape [{MAX_LEN_}, {HD_}]"),
    ("sliding_sin", lambda a: dict(sliding_sin=a["sliding_sin"][:, :-2]), f"sliding_sin must have shape [{MAX_LEN_}, {HD_}]"),
    ("sliding_cos-alone", lambda a: dict(sliding_sin=None), "sliding_cos and sliding_sin must be given together"),
    ("sliding_sin-alone", lambda a: dict(sliding_cos=None), "sliding_cos and sliding_sin must be given together"),
    ("sliding_layers-past-the-last", lambda a: dict(sliding_layers=(0, L_)),
     f"sliding_layers must hold layer indices in [0, {L_}), got {L_}"),
    ("sliding_layers-negative", lambda a: dict(sliding_layers=(-1,)), f"sliding_layers must hold layer indices in [0, {L_}), got -1"),
    ("sliding_layers-repeated", lambda a: dict(sliding_layers=(1, 1)), "sliding_layers must not repeat a layer, got 1 twice"),
    ("sliding_window-0", lambda a: dict(sliding_window=0), "sliding_window must be >= 1 when sliding_layers are given, got 0"),
    ("sliding_window-negative", lambda a: dict(sliding_layers=(), sliding_window=-1), "sliding_window must be >= 0, got -1"),
    ("activation", lambda a: dict(activation="gelu"), "activation must be 'silu' or 'gelu_tanh', got 'gelu'"),
]


@device_params
@pytest.mark.parametrize("name,value,fragment", [
    ("activation", 1, "activation must be a str, got int"),
    ("sliding_layers", 1, "sliding_layers must be a sequence of layer indices, got int"),
    ("sliding_layers", "01", "sliding_layers must be a sequence of layer indices, got str"),
    ("sliding_layers", (0.5,), "sliding_layers[] must be a Python int, got float"),
    ("sliding_window", 2.0, "sliding_window must be a Python int, got float"),
])
def test_option_types(name, value, fragment, device):
    expect(TypeError, fragment, {**valid_args(device), name: value})


@device_params
@pytest.mark.parametrize("change,fragment", [c[1:] for c in SHAPE_CASES], ids=[c[0] for c in SHAPE_CASES])
def test_shape_mismatch(change, fragment, device):
    args = valid_args(device)
    args.update(change(args))
    expect(ValueError, fragment, args)


@device_params
@pytest.mark.parametrize("num_heads,error,fragment", bad_num_heads_cases(H_, KV_, 1))
def test_bad_num_heads(num_heads, error, fragment, device):
    args = valid_args(device)
    args["num_heads"] = num_heads
    expect(error, fragment, args)


@device_params
def test_odd_head_dim(device):
    args = valid_args(device)
    for name in ("k_cache", "v_cache", "cos", "sin"):
        args[name] = args[name][..., :-1].contiguous()
    for name in ("q_norm", "k_norm"):
        args["weights"][name] = args["weights"][name][:, :-1]
    args["weights"]["qkv"] = args["weights"]["qkv"][:, :(H_ + 2 * KV_) * (HD_ - 1)]
    args["weights"]["o"] = args["weights"]["o"][:, :, :H_ * (HD_ - 1)]
    expect(ValueError, f"head_dim (k_cache.size(3)) must be even for rotary embeddings, got {HD_ - 1}", args)


@device_params
@pytest.mark.parametrize("length,error,fragment", BAD_LENGTHS)
def test_bad_length(length, error, fragment, device):
    args = valid_args(device)
    args["length"] = length(device)
    expect(error, fragment, args)


@device_params
@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_must_be_contiguous(name, device):
    args = valid_args(device)
    args[name] = args[name].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, heads not outside positions
    expect(ValueError, "k_cache and v_cache must be contiguous", args)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "qkv", "o", "gate_up", "down"])
def test_bulk_copied_inputs_off_a_16_byte_boundary_are_named(name):
    # The CUDA kernel moves their rows by bulk copies of whole 16-byte vectors: a view one element
    # in would fault.
    args = valid_args("cuda")
    holder = args["weights"] if name in WEIGHT_ARG else args
    holder[name] = at_odd_offset(holder[name])
    expect(ValueError, f"{WEIGHT_ARG.get(name, name)} must start at a 16-byte aligned address", args)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["x", "attn_norm", "mlp_norm", "q_norm", "k_norm", "qkv_bias", "post_attn_norm",
                                  "post_mlp_norm", "cos", "sin", "sliding_cos", "sliding_sin"])
def test_element_loaded_inputs_off_a_16_byte_boundary_give_the_same_bits(name):
    # Read one element at a time, so taken anywhere.
    args = valid_args("cuda")
    want = ops.decoder_step(**clone(args))
    moved = clone(args)
    holder = moved["weights"] if name in WEIGHT_ARG else moved
    holder[name] = at_odd_offset(holder[name])
    assert torch.equal(ops.decoder_step(**moved), want)


@device_params
def test_caches_must_not_share_memory(device):
    args = valid_args(device)
    args["v_cache"] = args["k_cache"]  # the values would overwrite the keys
    expect(ValueError, "k_cache and v_cache must not share memory", args)


@device_params
@pytest.mark.parametrize("name,cache", [("x", "k_cache"), ("attn_norm", "v_cache"), ("cos", "k_cache")])
def test_inputs_must_not_share_memory_with_the_caches(name, cache, device):
    # The same values, held in the cache's last elements: on CUDA a block's cache write could land
    # where another block still reads them.
    args = valid_args(device)
    holder = args["weights"] if name in WEIGHT_ARG else args
    value = holder[name]
    holder[name] = args[cache].flatten()[-value.numel():].copy_(value.flatten()).view(value.shape)
    expect(ValueError, f"{name} must not share memory with {cache}", args)


@device_params
@pytest.mark.parametrize("name,value,error,fragment", [
    *[("eps", v, ValueError, "eps must be a finite number >= 0") for v in (float("nan"), float("inf"), -1e-6)],
    *[("scale", v, ValueError, "scale must be in (0, 1e+06]") for v in (float("nan"), float("inf"), 0.0, -0.5, 1.01e6, 1e300)],
    ("eps", "small", TypeError, "eps must be a Python float or int"),
    ("eps", None, TypeError, "eps must be a Python float or int"),
    ("scale", "big", TypeError, "scale must be a Python float or int"),
    *[("input_scale", v, ValueError, "input_scale must be a number that is finite in float32")
      for v in (float("nan"), float("-inf"), 1e39)],  # 1e39 is finite as the schema's double, not in float32
    ("input_scale", torch.tensor(2.0), TypeError, "input_scale must be a Python float or int"),
    *[("attn_softcap", v, ValueError, "attn_softcap must be 0 (no cap) or a positive number finite in float32")
      for v in (-1.0, float("nan"), float("inf"), 1e39, 1e-50)],  # 1e-50 is 0 in float32, not a cap
    ("attn_softcap", None, TypeError, "attn_softcap must be a Python float or int"),
], ids=repr)
def test_bad_scalars(name, value, error, fragment, device):
    args = valid_args(device)
    args[name] = value
    expect(error, fragment, args)


@device_params
def test_raw_op_checks_too(device):
    # The C++ checks guard torch.ops.flashhead callers that bypass the Python wrapper.
    a = raw_kwargs(valid_args(device))

    def raw(**changes):
        return torch.ops.flashhead.decoder_step(**{**a, **changes})

    raw()
    with pytest.raises(TypeError, match=re.escape("length must be an int64 tensor")):
        raw(length=a["length"].int())
    with pytest.raises(ValueError, match=re.escape("scale must be in (0, 1e+06]")):
        raw(scale=0.0)
    with pytest.raises(ValueError, match=re.escape("q_norm and k_norm must be given together")):
        raw(k_norm=None)
    with pytest.raises(ValueError, match=re.escape("o_weight must have shape")):
        raw(o_weight=a["o_weight"][:, :-1])
    with pytest.raises(ValueError, match=re.escape("qkv_bias must have shape")):
        raw(qkv_bias=a["qkv_bias"][:1])
    with pytest.raises(ValueError, match=re.escape("input_scale must be a number that is finite in float32")):
        raw(input_scale=float("inf"))
    with pytest.raises(ValueError, match=re.escape("attn_softcap must be 0 (no cap) or a positive number")):
        raw(attn_softcap=-50.0)


@device_params
@pytest.mark.parametrize("name", required_tensor_arguments("decoder_step"))
def test_raw_op_with_none_for_a_tensor(name, device):
    # torch.ops passes None as an undefined tensor: named here, not "Unimplemented scalar type".
    with pytest.raises(TypeError, match=re.escape(f"{name} must be a tensor, got None")):
        torch.ops.flashhead.decoder_step(**{**raw_kwargs(valid_args(device)), name: None})


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "cos", "sin", "length", *WEIGHT_ARG])
def test_wrong_device(name):
    args = valid_args("cuda")
    holder = args["weights"] if name in WEIGHT_ARG else args
    holder[name] = holder[name].cpu()
    expect(ValueError, f"{WEIGHT_ARG.get(name, name)} must be on the same device as x", args)


# ---- opcheck (the op writes k_cache and v_cache in place) ----------------------------------------

def raw_kwargs(args):
    """ops.decoder_step's keyword arguments as the schema's."""
    w = args["weights"]
    hd = args["k_cache"].shape[3]
    return dict(x=args["x"], qkv_weight=w["qkv"], o_weight=w["o"], gate_up_weight=w["gate_up"], down_weight=w["down"],
                attn_norm=w["attn_norm"], mlp_norm=w["mlp_norm"], q_norm=w.get("q_norm"), k_norm=w.get("k_norm"),
                k_cache=args["k_cache"], v_cache=args["v_cache"], cos=args["cos"], sin=args["sin"],
                length=args["length"], num_heads=args["num_heads"], eps=args["eps"],
                scale=hd ** -0.5 if args["scale"] is None else args["scale"], qkv_bias=w.get("qkv_bias"),
                post_attn_norm=w.get("post_attn_norm"), post_mlp_norm=w.get("post_mlp_norm"),
                activation=args.get("activation", "silu"), sliding_window=args.get("sliding_window", 0),
                sliding_layers=list(args.get("sliding_layers", ())), sliding_cos=args.get("sliding_cos"),
                sliding_sin=args.get("sliding_sin"), input_scale=args.get("input_scale", 1.0),
                attn_softcap=args.get("attn_softcap", 0.0))


OPCHECK_CASES = {
    "qk-norm-bf16": lambda: step_args(2, 16, 24, 4, 2, 8, 10, 3, True, torch.bfloat16, eps=0.1),
    "no-qk-norm-fp32": lambda: step_args(1, 24, 8, 3, 1, 8, 6, 0, False, torch.float32, scale=0.3),
    "qkv-bias-fp16": lambda: step_args(2, 16, 8, 4, 2, 8, 6, 2, False, torch.float16, qkv_bias=True),
    "gemma3-bf16": lambda: step_args(3, 16, 24, 4, 1, 8, 10, 7, True, torch.bfloat16, gemma=True),
    "gemma2-fp16": lambda: step_args(2, 16, 24, 4, 2, 8, 10, 5, False, torch.float16, gemma=True, softcap=0.8),
}


@device_params
@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case, device):
    torch.library.opcheck(torch.ops.flashhead.decoder_step.default, (), raw_kwargs(to(OPCHECK_CASES[case](), device)))


@device_params
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backward_through_the_op_raises(compiled, device):
    args = raw_kwargs(to(OPCHECK_CASES["gemma3-bf16"](), device))
    check_no_backward("decoder_step", torch.ops.flashhead.decoder_step.default, args, grad_input="x", under_compile=compiled)


# ---- GPU: the CUDA op against the CPU op ------------------------------------------------------

# The CUDA kernel sums in another order than the CPU op and folds RMSNorm into the product without
# rounding the normalised input (docs/kernels.md), so the two differ by an ulp here and there, and
# a difference in one layer moves every later layer's result a little. Measured on an H100 over 40
# seeds at Qwen3's and SmolLM2's dims (two layers): the largest difference was 0.03 of TOL in
# float32, 0.9 in float16 and 2.1 in bfloat16 (median 1.0). Hence TOL in float32, twice it in
# float16 and four times in bfloat16; a wrong layer, norm, rotation or cache position is off by O(1).
GPU_TOL = {torch.float32: TOL[torch.float32],
           torch.float16: {k: 2 * v for k, v in TOL[torch.float16].items()},
           torch.bfloat16: {k: 4 * v for k, v in TOL[torch.bfloat16].items()}}
GPU_MAX_LEN = 1024
# (name, L, D, I, H, KV, hd, max_len, qk_norm): a small odd shape (D, H * hd, I multiples of 8),
# Qwen3-0.6B's dims with two layers, SmolLM2-135M's (GQA 3) with two. These get 64 KB weight
# stages on a GPU with 227 KB of shared memory a block (H100, H200); the plan picks smaller ones
# when the attention scratch leaves less room: Gemma-3-270M's dims (hd 256, 4 query heads on one
# KV head) get 48 KB stages there, 8 query heads of 256 on one KV head 32 KB stages.
GPU_SHAPES = {
    "small": (2, 64, 136, 4, 2, 16, 40, True),
    "qwen3": (2, 1024, 3072, 16, 8, 128, GPU_MAX_LEN, True),
    "smollm2": (2, 576, 1536, 9, 3, 64, GPU_MAX_LEN, False),
    "gemma3-270m": (2, 640, 2048, 4, 1, 256, 64, True),
    "group8-hd256": (2, 512, 1024, 8, 1, 256, 64, True),
    # The kernel comes in classes of head geometry (group and hd at most (2, 128), (4, 128), (8, 64),
    # (8, 128), (4, 256), any): qwen3 and small are in the first, smollm2 in the second,
    # qwen2.5-0.5b in the third, gemma3-270m in the fifth, group8-hd256 in the last, these at a
    # class's edges.
    "group4-hd128": (2, 512, 1024, 8, 2, 128, 64, True),
    "group8-hd64": (2, 512, 1024, 8, 1, 64, 64, True),
    "group8-hd128": (2, 512, 1024, 8, 1, 128, 64, False),
    "group2-hd256": (2, 512, 1024, 4, 2, 256, 64, False),
    # A split's cached keys and values are read from a copy in a free weight stage when they fit it
    # (2 n hd bytes of T), from the cache otherwise. 132 blocks over 8 KV heads make 16 splits: at
    # 1024 keys they all fit (64 keys), at 1501 only in 16-bit types (94), at 3000 in none (187).
    "qwen3-long": (2, 1024, 3072, 16, 8, 128, 3000, True),
    # down's rows as long as the kernel takes: 8192 values, in fp32 a whole 32 KB stage row.
    "wide-mlp": (1, 128, 8192, 2, 1, 64, 16, False),
    # Qwen2.5-0.5B's dims (7 query heads on a KV head) with its q/k/v biases.
    "qwen2.5-0.5b": (2, 896, 4864, 14, 2, 64, GPU_MAX_LEN, False),
    # Gemma-3's layer (step_args(gemma=True): post-norms, GELU, a sliding layer over a third of the
    # cache with its own rotary tables): Gemma-3-270M's and Gemma-3-1B's dims, and a small shape
    # with fewer qkv rows (128) than an H100 or H200 has SMs, which post-norms cap the grid to.
    "gemma3-270m-layer": (2, 640, 2048, 4, 1, 256, 64, True),
    "gemma3-1b-layer": (3, 1152, 6912, 4, 1, 256, GPU_MAX_LEN, True),
    "small-gemma3-layer": (2, 64, 136, 4, 2, 16, 40, True),
    # Gemma-2's layer (Gemma-3's with the scores capped, no q/k norms): Gemma-2-2B's heads (8 of 256 on
    # 4 KV heads) at narrower widths, and the small shape.
    "gemma2-2b-heads": (2, 576, 1152, 8, 4, 256, GPU_MAX_LEN, False),
    "small-gemma2-layer": (2, 64, 136, 4, 2, 16, 40, False),
}
QKV_BIAS_SHAPES = {"qwen2.5-0.5b"}
GEMMA2_SHAPES = {"gemma2-2b-heads", "small-gemma2-layer"}
GEMMA3_SHAPES = {"gemma3-270m-layer", "gemma3-1b-layer", "small-gemma3-layer", *GEMMA2_SHAPES}
# (shape, length): each shape at 0, the last position and beyond on both sides; qwen3 also at 37, 500.
GPU_CASES = [
    *[(s, n) for s in GPU_SHAPES for n in (0, GPU_SHAPES[s][6] - 1, GPU_SHAPES[s][6], -1)],
    ("small", 17), ("qwen3", 37), ("qwen3", 500), ("smollm2", 300), ("qwen3-long", 1500),
    ("gemma3-1b-layer", 200), ("gemma3-1b-layer", 341), ("gemma3-270m-layer", 30),  # 341: the window's length
    ("gemma2-2b-heads", 341), ("gemma2-2b-heads", 700),
]


def cuda_vs_cpu(args, length, dtype, what):
    """The CUDA op against the CPU op on the same inputs; both caches checked."""
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    got = run_step(to(args, "cuda"))
    check_step(got, run_step(clone(args)), before, length, dtype, what, GPU_TOL)
    return got


@pytest.mark.gpu
@dtype_params
@pytest.mark.parametrize("shape,length", GPU_CASES, ids=[f"{s}-{n}" for s, n in GPU_CASES])
def test_cuda_decoder_step(shape, length, dtype):
    L, D, I, H, KV, hd, max_len, qk_norm = GPU_SHAPES[shape]
    args = step_args(L, D, I, H, KV, hd, max_len, length, qk_norm, dtype, qkv_bias=shape in QKV_BIAS_SHAPES,
                     gemma=shape in GEMMA3_SHAPES, softcap=0.8 if shape in GEMMA2_SHAPES else 0.0)
    cuda_vs_cpu(args, length, dtype, f"{shape} at {length}")


@pytest.mark.gpu
@dtype_params
@pytest.mark.parametrize("shape", ["small", "qwen3", "small-gemma3-layer", "small-gemma2-layer"])
def test_cuda_consecutive_steps(shape, dtype):
    # Each device keeps its own caches across steps (the CUDA op reads what it wrote at the
    # previous lengths); each step gets a fresh token, the same on both devices. The Gemma-3
    # layer's window (13 keys) moves over the keys written by the steps before.
    L, D, I, H, KV, hd, max_len, qk_norm = GPU_SHAPES[shape]
    cpu = step_args(L, D, I, H, KV, hd, max_len, 5, qk_norm, dtype, eps=0.1, gemma=shape in GEMMA3_SHAPES,
                    softcap=0.8 if shape in GEMMA2_SHAPES else 0.0)
    cuda = to(cpu, "cuda")
    g = generator("consecutive", shape, str(dtype))
    for length in range(5, 11 if shape not in GEMMA3_SHAPES else 25):
        x = randn(g, 1, D, dtype=dtype)
        cpu.update(x=x, length=torch.tensor(length))
        cuda["x"] = x.cuda()
        cuda["length"].fill_(length)
        before = (cuda["k_cache"].cpu(), cuda["v_cache"].cpu())
        got = run_step(cuda)
        expected = run_step(cpu)
        check_step(got, expected, before, length, dtype, f"step at {length}", GPU_TOL)
        for name in ("k_cache", "v_cache"):  # the whole caches, every earlier step's writes included
            close(cuda[name], cpu[name], dtype, f"{name} after the step at {length}", GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_graph_replay_at_another_length(dtype):
    L, D, I, H, KV, hd, max_len, qk_norm = GPU_SHAPES["qwen3"]
    args = to(step_args(L, D, I, H, KV, hd, max_len, 3, qk_norm, dtype), "cuda")
    initial = (args["k_cache"].clone(), args["v_cache"].clone())

    def restore():
        args["k_cache"].copy_(initial[0])
        args["v_cache"].copy_(initial[1])

    outputs = []
    graph = capture_graph(lambda: outputs.append(ops.decoder_step(**args)), prepare=restore)
    for length in (3, 500, 0, max_len - 1, max_len, -1):
        args["length"].fill_(length)  # the graph reads the length at replay
        restore()
        graph.replay()
        replayed = (outputs[-1].clone(), args["k_cache"].clone(), args["v_cache"].clone())
        restore()
        eager = ops.decoder_step(**args)
        # Exactly equal (the same kernel); out of range: NaN and untouched caches.
        torch.testing.assert_close(replayed[0], eager, rtol=0, atol=0, equal_nan=True, msg=f"length {length}")
        assert torch.equal(replayed[1], args["k_cache"]) and torch.equal(replayed[2], args["v_cache"]), length
        assert eager.isnan().all().item() == (not 0 <= length < max_len), length


@pytest.mark.gpu
def test_cuda_no_host_sync():
    L, D, I, H, KV, hd, max_len, qk_norm = GPU_SHAPES["smollm2"]
    args = to(step_args(L, D, I, H, KV, hd, max_len, 7, qk_norm, torch.bfloat16), "cuda")
    ops.decoder_step(**args)  # a first call outside the check (lazy initialisation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.decoder_step(**args)
        ops.decoder_step(**{**args, "scale": None})
    finally:
        torch.cuda.set_sync_debug_mode("default")


# (id, dtype, L, D, I, H, KV, hd, message): consistent shapes the CPU op accepts but the CUDA op
# does not: D, H * hd and I must be multiples of 8 (16-bit dtypes) or 4 (float32), head_dim at
# most 256, weight rows at most 32 KB (gate_up's two rows of D together).
WHOLE_VECTORS = "hidden_size, head_dim and intermediate_size to be multiples of"
ROW_BYTES = "a weight row of at most 32768 bytes"
CUDA_LIMIT_CASES = [
    ("D60-bf16", torch.bfloat16, 1, 60, 64, 2, 1, 16, WHOLE_VECTORS),
    ("I68-fp16", torch.float16, 1, 64, 68, 2, 1, 16, WHOLE_VECTORS),
    ("D62-fp32", torch.float32, 1, 62, 64, 2, 1, 16, WHOLE_VECTORS),
    ("hd264-bf16", torch.bfloat16, 1, 64, 64, 1, 1, 264, "head_dim must be at most 256"),
    ("H40xhd256-fp32", torch.float32, 1, 64, 64, 40, 8, 256, ROW_BYTES),
    ("I8200-fp32", torch.float32, 1, 64, 8200, 2, 1, 16, ROW_BYTES),
    ("D4100-fp32", torch.float32, 1, 4100, 64, 2, 1, 16, ROW_BYTES),
]


@pytest.mark.gpu
def test_cuda_sliding_layers_limit():
    args = step_args(257, 16, 16, 2, 1, 8, 4, 2, False, torch.float32, gemma=True)  # layers 0, 2, ..., 256 slide
    ops.decoder_step(**clone(args))  # valid for the CPU op
    with pytest.raises(ValueError, match=re.escape("the CUDA kernel takes sliding_layers in models of at most 256 "
                                                   "layers, got 257")):
        ops.decoder_step(**to(args, "cuda"))
    ops.decoder_step(**{**to(args, "cuda"), "sliding_layers": ()})  # the limit is the sliding layers' only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,L,D,I,H,KV,hd,message", [c[1:] for c in CUDA_LIMIT_CASES],
                         ids=[c[0] for c in CUDA_LIMIT_CASES])
def test_cuda_size_limits(dtype, L, D, I, H, KV, hd, message):
    args = step_args(L, D, I, H, KV, hd, 8, 2, False, dtype)
    ops.decoder_step(**clone(args))  # valid for the CPU op
    with pytest.raises(ValueError, match=re.escape(message)):
        ops.decoder_step(**to(args, "cuda"))
