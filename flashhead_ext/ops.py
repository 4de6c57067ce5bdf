"""Python entry points for the ``torch.ops.flashhead`` ops, and their fake kernels.

Argument checks (dtype, rank, shape, device, ranges of int arguments) live in the C++ ops so that
``torch.ops.flashhead.*`` callers get them too (but for the wrappers' checks of Python scalar types:
the dispatcher takes ``True`` for an int argument, and a one-element tensor through ``int()``, a
host sync on a GPU); they raise ``TypeError`` / ``ValueError`` naming
the argument and what was expected. They read metadata only, never tensor data, so the ops stay
free of host syncs. Data-dependent checks (ids inside a cluster table) cost a sync and run once,
when a head is built: see :func:`validate_cluster_table`. The kernels stay memory-safe even for
tables that skip it: an out-of-range id becomes a masked slot (-1, logit -inf), never a wild read.

Conventions shared by every op (docs/kernels.md):

* hidden ``[B, D]``; centroids ``[C, D]`` and embedding ``[V, D]`` of the same float dtype
  (float16, bfloat16 or float32); accumulation and all scores/logits in float32.
* centroids may instead be ``torch.float8_e4m3fn`` (half the bytes of bf16, so the scoring reads
  them in about half the time), with an optional ``centroid_scale``: a float32 tensor of one
  element on their device that multiplies every centroid score (:func:`quantize_centroids` makes
  both). It is read on the device, so a captured graph sees the value current at replay; for the
  same reason its value is not checked (that would sync with the host): it must be finite and
  positive, since a negative scale reverses the ranking and 0 or NaN ties every score
  (``FlashHead`` makes its own scale and checks one loaded from a state dict).
* ids are int32; ``-1`` in a candidate list is a masked slot whose logit is ``-inf``.
* ranking: higher score first, NaN like ``-inf``, ties to the smaller id (cluster id for
  cluster selection, token id for the final argmax, as ``torch.argmax`` on a dense row).
* non-contiguous inputs are copied to contiguous memory first.

The decoder-layer ops (:func:`fused_linear`, :func:`rotary_cache_write`, :func:`decode_attention`,
and :func:`decoder_step`, one token through every layer at once) serve the fast path's draft
steps: activations of dtype T (float16, bfloat16 or float32) and weights of the same dtype,
float32 accumulation, results in T; the KV-cache length is an int64 device tensor read by the
kernels, so a captured step replays at any length.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Callable, Optional, ParamSpec, TypeGuard, TypeVar, Union

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

_ops = torch.ops.flashhead

SeedLike = Union[Tensor, int, None]

# The temperatures the sampling ops take (kMinTemperature, kMaxTemperature in csrc/ops/checks.h): a
# range kept well inside float32's, whose limits are what break the sampling (scores over a tiny
# temperature overflow to ±inf and the lowest id wins; a huge one rounds to inf).
TEMPERATURE_RANGE = (1e-6, 1e6)
# The largest softmax scale the attention kernels take (kMaxAttentionScale in csrc/ops/decoder_checks.h).
ATTENTION_SCALE_MAX = 1e6
# The most query heads the decoder-layer ops take (kMaxHeads in csrc/ops/decoder_checks.h).
NUM_HEADS_MAX = 2**16
# The largest count (B, D, C, b, p, ...) a CUDA kernel loops over (kMaxKernelCount in csrc/ops/cuda_ops.cpp).
CUDA_COUNT_MAX = 2**30


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    _require_dense(name, value)


def _require_dense(name: str, value: Tensor) -> None:
    """The ops have kernels for dense tensors only: for a sparse, quantized or nested one the
    dispatcher's NotImplementedError (and a head's reshape) named no argument."""
    if value.layout != torch.strided or value.is_quantized or value.is_nested:
        kind = "quantized" if value.is_quantized else "nested" if value.is_nested else str(value.layout)
        raise TypeError(f"{name} must be a dense tensor (layout torch.strided), got a {kind} tensor")


def _require_optional_tensor(name: str, value) -> None:
    if value is not None:
        _require_tensor(name, value)


def _require_values(name: str, value: Tensor, detail: str = ": materialise it first") -> None:
    """For the helpers that read a tensor on the host: a meta tensor has nothing to read, and
    torch's own error for it names no argument."""
    if value.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values{detail}")
    if is_fake(value):  # torch's own error named a data-dependent op, neither the argument nor the mode
        raise ValueError(f"{name} is a fake tensor (FakeTensorMode's), which holds no values to read: build the "
                         "head (an attached model's: model.flash_head.head()) or run this outside the mode "
                         "(torch.compile and torch.export trace a built head)")


def _require_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(value)}")
    return value


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# Python numbers only: torch.compile traces a numpy scalar as an array, so accepting numpy here
# would work eagerly and fail compiled.
def _require_int(name: str, value) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be a Python int, got {_type_name(value)} (convert it with int())")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def _require_positive_int(name: str, value) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {_type_name(value)}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def _autocast_off(fn: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """``fn`` with autocast off on the CPU and CUDA: it computes in its tensors' own dtypes, as
    documented, whatever a caller's ``torch.autocast`` asks (the clustering's products ran in
    bfloat16, and the fast decoder's cache writes failed on bfloat16 keys)."""
    def off(kind: str):
        return torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else contextlib.nullcontext()

    @functools.wraps(fn)
    def without_autocast(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        with off("cpu"), off("cuda"):
            return fn(*args, **kwargs)
    return without_autocast


def _is_int(value) -> TypeGuard[int]:
    """A Python int; not a bool, which is an int."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A Python int or float; not a bool, which is an int."""
    return _is_int(value) or isinstance(value, float)


def _counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless ``count`` is 1: "1 prompt", "3 prompts"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _missing_cuda_device(device: torch.device) -> Optional[str]:
    """Why this machine has no CUDA device ``device`` (none at all, or fewer than its index), or None."""
    count = torch.cuda.device_count()
    if count == 0:
        return "no CUDA device here (torch.cuda.is_available() is False)"
    if device.index is not None and device.index >= count:
        return f"this machine has {_counted(count, 'CUDA device')}"
    return None


def _runnable_device(device, runs: str, note: str = "") -> torch.device:
    """``device`` as a torch.device that ``runs`` (the work, e.g. "clustering") can run on, the CPU or a
    CUDA device this machine has; else a ValueError naming it, not torch's error once tensors are
    being copied (which may only speak of drivers or backends)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a device string such as 'cpu' or 'cuda:0'{note}, "
                         f"got {device!r}") from None
    if device.type == "meta":
        raise ValueError(f"device {str(device)!r}{note}: a meta device holds no values; {runs} runs on 'cpu' or 'cuda'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r}{note}: {runs} runs on 'cpu' or 'cuda' devices")
    missing = _missing_cuda_device(device) if device.type == "cuda" else None
    if missing:
        hint = "" if torch.cuda.is_available() else "; pass device='cpu'"
        raise ValueError(f"device {str(device)!r}{note}: {missing}{hint}")
    return device


def _require_float(name: str, value) -> float:
    # numpy.float64 is a float subclass, but torch.compile traces it as an array like other numpy
    # scalars (see _require_int).
    if not _is_number(value) or type(value).__module__ == "numpy":
        raise TypeError(f"{name} must be a Python float or int, got {_type_name(value)} (convert it with float())")
    try:
        return float(value)
    except OverflowError:  # an int past float64's range: float() names no argument
        raise ValueError(f"{name} must fit in a float64, got an int of {value.bit_length()} bits") from None


def _require_probes(value, num_clusters: Optional[int] = None) -> int:
    """probes as the heads take it: an int in 1..num_clusters (at least 1 while C is unknown)."""
    value = _require_int("probes", value)
    if num_clusters is None and value < 1:
        raise ValueError(f"probes must be at least 1, got {value}")
    if num_clusters is not None and not 1 <= value <= num_clusters:
        raise ValueError(f"probes must be in 1..{num_clusters} (the number of clusters), got {value}")
    return value


def _require_optional_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def _require_generator_for(device, generator: Optional[torch.Generator]) -> None:
    """A generator draws on its own device type: torch's error for another names no argument."""
    if generator is not None and torch.device(generator.device).type != torch.device(device).type:
        raise ValueError(f"generator must be a {torch.device(device).type} generator like hidden, got one on {generator.device}")


def _check_temperature(temperature) -> float:
    """The check the sampling ops make in C++, for samplers written in torch (DenseHead)."""
    value = _require_float("temperature", temperature)
    low, high = TEMPERATURE_RANGE
    if not low <= value <= high:
        raise ValueError(f"temperature must be in [{low:g}, {high:g}] (decode greedily for temperature 0), got {value}")
    return value


def make_seed(device: Union[str, torch.device], seed: SeedLike = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """A one-element int64 seed tensor on ``device`` for the sampling ops.

    Drawn on the device from ``generator`` (or torch's default generator) when ``seed`` is None,
    so no host sync happens and a captured CUDA graph draws a fresh seed at each replay. Give
    ``seed`` or ``generator``, not both.
    """
    _require_optional_generator(generator)
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both: a seed fixes the draw, so the generator would be ignored")
    if isinstance(seed, Tensor):
        _require_dense("seed", seed)
        return seed
    if seed is not None:
        return torch.full((), _require_int("seed", seed), dtype=torch.int64, device=device)
    _require_generator_for(device, generator)
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device, **_generator_keyword(generator))


def _generator_keyword(generator: Optional[torch.Generator]) -> dict:
    """``generator=`` for a torch draw, left out when None: spelled out as None, the draw becomes an
    overload that AOTInductor, inductor's cpp_wrapper and export with a dynamic batch cannot run."""
    return {} if generator is None else {"generator": generator}


# The float dtypes of hidden, embedding and non-fp8 centroids.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def quantize_centroids(centroids: Tensor) -> tuple[Tensor, Tensor]:
    """``(float8_e4m3fn centroids, float32 scale [1])`` for the centroid-scoring ops' ``centroid_scale``.

    The scale is a power of two (dividing by it is exact) that puts the largest magnitude in
    [128, 256) before rounding, at most 256 after: e4m3's normal range, below its largest value
    448 (a value past it would become NaN: e4m3fn has no inf). A quantized row's score times the
    scale approximates the original score to 3 mantissa bits per element. Centroids must be
    finite and not all zero; this reads them on the host once (a sync), so quantize when a head
    is built, not per step.
    """
    return _quantize_centroids(centroids)


def _quantize_centroids(centroids: Tensor, name: str = "centroids") -> tuple[Tensor, Tensor]:
    """:func:`quantize_centroids`, its errors naming the caller's argument ``name`` (a head's
    sampling centroids)."""
    _require_tensor(name, centroids)
    if centroids.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float16, bfloat16 or float32 tensor, got {centroids.dtype}")
    if centroids.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(centroids.shape)}")
    _require_values(name, centroids, ": quantizing reads them, so materialise them first")
    peak = centroids.detach().abs().amax().float()
    if not torch.isfinite(peak) or peak == 0:
        raise ValueError(f"{name} must be finite and not all zero to be quantized, got a largest magnitude of {float(peak)}")
    _, exponent = torch.frexp(peak)  # peak = m * 2**exponent, m in [0.5, 1)
    # float32 whatever torch's default dtype: the ops refuse a scale of another.
    scale = torch.ldexp(torch.ones(1, device=peak.device, dtype=torch.float32), exponent - 8)
    if scale == 0:  # below float32's smallest subnormal
        raise ValueError(f"{name} are too small to quantize: their largest magnitude is {float(peak):g}")
    return (centroids.detach().float() / scale).to(torch.float8_e4m3fn), scale


def select_clusters(
    hidden: Tensor, centroids: Tensor, probes: int, *, centroid_scale: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """The ``probes`` best clusters per row by centroid score, best first.

    Returns ``(cluster_ids int32 [B, probes], scores float32 [B, probes])``; the scores include
    ``centroid_scale``.
    """
    _require_tensor("hidden", hidden)
    _require_tensor("centroids", centroids)
    _require_optional_tensor("centroid_scale", centroid_scale)
    return _ops.select_clusters(hidden, centroids, _require_int("probes", probes), centroid_scale)


def sample_clusters(
    hidden: Tensor,
    centroids: Tensor,
    probes: int,
    temperature: float = 1.0,
    *,
    seed: SeedLike = None,
    generator: Optional[torch.Generator] = None,
    centroid_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``probes`` distinct clusters per row drawn without replacement from softmax(scores / T).

    Gumbel-top-k, in draw order. Returns ``(cluster_ids int32, raw scores float32)``, each
    ``[B, probes]``; the scores include ``centroid_scale``. The same seed gives the same draw.
    """
    _require_tensor("hidden", hidden)
    _require_tensor("centroids", centroids)
    _require_optional_tensor("centroid_scale", centroid_scale)
    seed_t = make_seed(hidden.device, seed, generator)
    return _ops.sample_clusters(
        hidden, centroids, _require_int("probes", probes), _require_float("temperature", temperature), seed_t,
        centroid_scale,
    )


def gather_candidates(cluster_ids: Tensor, cluster_tokens: Tensor, extra_ids: Optional[Tensor] = None) -> Tensor:
    """Candidate token ids ``int32 [B, probes * cluster_size + E]`` for the chosen clusters.

    ``extra_ids`` (E always-on tokens, e.g. special tokens) are appended to every row; an extra
    id already present among the row's candidates, or repeated, is masked to -1. The table's
    clusters must be disjoint (:func:`validate_cluster_table`): a token listed in two clusters is a
    candidate twice.
    """
    _require_tensor("cluster_ids", cluster_ids)
    _require_tensor("cluster_tokens", cluster_tokens)
    _require_optional_tensor("extra_ids", extra_ids)
    return _ops.gather_candidates(cluster_ids, cluster_tokens, extra_ids)


def candidate_logits(hidden: Tensor, embedding: Tensor, candidate_ids: Tensor) -> Tensor:
    """Exact logits ``embedding[candidate_ids] . hidden`` as float32 ``[B, N]``; -inf where masked."""
    _require_tensor("hidden", hidden)
    _require_tensor("embedding", embedding)
    _require_tensor("candidate_ids", candidate_ids)
    return _ops.candidate_logits(hidden, embedding, candidate_ids)


def decode_greedy(
    hidden: Tensor,
    centroids: Tensor,
    cluster_tokens: Tensor,
    embedding: Tensor,
    probes: int,
    extra_ids: Optional[Tensor] = None,
    *,
    out: Optional[Tensor] = None,
    centroid_scale: Optional[Tensor] = None,
) -> Tensor:
    """The whole greedy FlashHead path: int64 token id per row (argmax over the candidates).

    With ``out`` (int64 ``[B]``, may be a strided view, e.g. a column of a token buffer) the ids
    are written there and ``out`` is returned.
    """
    for name, value in (("hidden", hidden), ("centroids", centroids), ("cluster_tokens", cluster_tokens), ("embedding", embedding)):
        _require_tensor(name, value)
    _require_optional_tensor("extra_ids", extra_ids)
    _require_optional_tensor("centroid_scale", centroid_scale)
    probes = _require_int("probes", probes)
    if out is None:
        return _ops.decode_greedy(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale)
    _require_tensor("out", out)
    if out.dtype != torch.int64:  # a float out that requires grad met the autograd kernel's leaf check first
        raise TypeError(f"out must be int64, got {out.dtype}")
    _ops.decode_greedy_out(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, out, centroid_scale)
    return out


def decode_sample(
    hidden: Tensor,
    centroids: Tensor,
    cluster_tokens: Tensor,
    embedding: Tensor,
    probes: int,
    temperature: float = 1.0,
    extra_ids: Optional[Tensor] = None,
    *,
    seed: SeedLike = None,
    generator: Optional[torch.Generator] = None,
    centroid_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The whole sampling FlashHead path.

    Clusters are drawn as in :func:`sample_clusters`, then one token from softmax(logits / T)
    over their candidates. Returns ``(tokens int64 [B], token_logprobs float32 [B])``: the log
    probability of each drawn token under that candidate distribution, which speculative
    sampling needs as the draft probability. That needs a table of disjoint clusters
    (:func:`validate_cluster_table`, which FlashHead runs): a token listed twice would be counted
    twice in the log probability's normaliser. ``temperature`` must lie in ``TEMPERATURE_RANGE``.
    """
    for name, value in (("hidden", hidden), ("centroids", centroids), ("cluster_tokens", cluster_tokens), ("embedding", embedding)):
        _require_tensor(name, value)
    _require_optional_tensor("extra_ids", extra_ids)
    _require_optional_tensor("centroid_scale", centroid_scale)
    seed_t = make_seed(hidden.device, seed, generator)
    return _ops.decode_sample(
        hidden, centroids, cluster_tokens, embedding, _require_int("probes", probes),
        _require_float("temperature", temperature), seed_t, extra_ids, centroid_scale,
    )


def fused_linear(
    x: Tensor,
    weight: Tensor,
    *,
    norm_weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    static_weight: bool = False,
) -> Tensor:
    """``[residual +] (norm or gate of x) @ weight.T [+ bias]``: one projection of a decoder layer, ``[M, N]``.

    ``x [M, K]`` (``[M, 2K]`` when ``gated``: gate columns, then up columns), ``weight [N, K]``.
    ``norm_weight [K]`` applies RMSNorm to ``x`` first (float32, rounded once to x's dtype, like
    ``F.rms_norm``); ``gated`` uses ``F.silu(gate) * up`` instead (not both). The product is
    accumulated in float32, ``bias [N]`` added, and rounded to x's dtype once (as ``F.linear``),
    then ``residual [M, N]`` is added in that dtype. ``M = 0`` gives ``[0, N]``, as ``F.linear``.
    Host-sync free, capturable in CUDA graphs.

    ``static_weight=True`` promises that ``weight`` was not written by the kernel that runs just
    before this call on the stream (true of model weights, written once at load): on the GPU the
    kernel then starts reading it while that kernel drains. The result is the same; with the
    promise broken it may read the weight's old values.
    """
    _require_tensor("x", x)
    _require_tensor("weight", weight)
    _require_optional_tensor("norm_weight", norm_weight)
    _require_optional_tensor("residual", residual)
    _require_optional_tensor("bias", bias)
    return _ops.fused_linear(x, weight, norm_weight, _require_float("eps", eps), _require_bool("gated", gated), residual,
                             bias, _require_bool("static_weight", static_weight))


def rotary_cache_write(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    length: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    num_heads: int,
    *,
    q_norm: Optional[Tensor] = None,
    k_norm: Optional[Tensor] = None,
    eps: float = 1e-6,
) -> Tensor:
    """Rotary embedding of M new tokens and their write into one layer's KV cache; returns q ``[M, H, hd]``.

    ``qkv [M, (H + 2 KV) hd]`` holds each token's H query heads, KV key heads, KV value heads;
    ``k_cache``, ``v_cache [KV, max_len, hd]``; ``cos``, ``sin [max_len, hd]`` by position;
    ``length``: int64 device tensor of one element, the cache length before these tokens, so token
    i sits at position ``length + i``. Query and key heads get RMSNorm over hd with ``q_norm`` /
    ``k_norm [hd]`` when given (both or neither), then ``addcmul(x * cos, rotate_half(x), sin)``;
    rotated keys and the value heads go to the caches at their positions (in place). A token whose
    position is outside ``[0, max_len)`` writes nothing and gets a NaN q row. Host-sync free,
    capturable in CUDA graphs.
    """
    for name, value in (("qkv", qkv), ("cos", cos), ("sin", sin), ("length", length), ("k_cache", k_cache),
                        ("v_cache", v_cache)):
        _require_tensor(name, value)
    _require_optional_tensor("q_norm", q_norm)
    _require_optional_tensor("k_norm", k_norm)
    return _ops.rotary_cache_write(qkv, cos, sin, length, k_cache, v_cache, _require_int("num_heads", num_heads), q_norm,
                                   k_norm, _require_float("eps", eps))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: Tensor, scale: Optional[float] = None) -> Tensor:
    """Causal attention of M new tokens over one layer's KV cache, ``[M, H * hd]`` in q's dtype.

    ``q [M, H, hd]``, ``k_cache``, ``v_cache [KV, max_len, hd]`` (query head h uses KV head
    ``h // (H // KV)``), ``length`` as in :func:`rotary_cache_write`: token i attends to keys
    ``0 .. min(length + i, max_len - 1)``, softmax in float32 with ``scale`` (default
    ``1 / sqrt(hd)``). A token with no visible key (``length + i < 0``) gives NaN. Host-sync free,
    capturable in CUDA graphs.
    """
    for name, value in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("length", length)):
        _require_tensor(name, value)
    if scale is None:
        # A q of another shape is rejected by the op before it reads scale.
        scale = 1.0 / math.sqrt(q.shape[2]) if q.dim() == 3 and q.shape[2] > 0 else 1.0
    return _ops.decode_attention(q, k_cache, v_cache, length, _require_float("scale", scale))


_DECODER_STEP_WEIGHTS = ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm")
_DECODER_STEP_OPTIONAL = ("q_norm", "k_norm", "qkv_bias", "post_attn_norm", "post_mlp_norm")


def decoder_step(
    x: Tensor,
    weights: Mapping,
    k_cache: Tensor,
    v_cache: Tensor,
    cos: Tensor,
    sin: Tensor,
    length: Tensor,
    num_heads: int,
    *,
    eps: float = 1e-6,
    scale: Optional[float] = None,
    activation: str = "silu",
    sliding_window: int = 0,
    sliding_layers: Sequence[int] = (),
    sliding_cos: Optional[Tensor] = None,
    sliding_sin: Optional[Tensor] = None,
    input_scale: float = 1.0,
    attn_softcap: float = 0.0,
) -> Tensor:
    """One step of one token through every layer of a Llama/Qwen2/Qwen3/Gemma-2/Gemma-3 decoder; returns ``[1, D]``.

    ``x [1, D]``: the token's hidden state (exactly one token). ``weights`` maps ``"qkv"``
    ``[L, (H + 2 KV) hd, D]``, ``"o"`` ``[L, D, H hd]``, ``"gate_up"`` ``[L, 2 I, D]`` (gate rows,
    then up rows), ``"down"`` ``[L, D, I]``, ``"attn_norm"``, ``"mlp_norm"`` ``[L, D]`` and,
    optionally, ``"q_norm"``, ``"k_norm"`` ``[L, hd]`` (both or neither) and ``"qkv_bias"``
    ``[L, (H + 2 KV) hd]``: each layer's weights stacked along a leading layer dimension, all of
    x's dtype. Errors name them as the op ``torch.ops.flashhead.decoder_step`` does: ``qkv_weight``,
    ``o_weight``, ``gate_up_weight`` and ``down_weight`` are ``weights["qkv"]``, ``["o"]``,
    ``["gate_up"]`` and ``["down"]``; the others keep their keys. ``k_cache``, ``v_cache [L, KV,
    max_len, hd]`` (contiguous) get each layer's key and value at position ``length`` (in place);
    ``cos``, ``sin``, ``length`` and ``num_heads`` as in :func:`rotary_cache_write`, ``scale`` as
    in :func:`decode_attention` (default ``1 / sqrt(hd)``). Per layer ``i``, exactly::

        qkv = fused_linear(x, qkv[i], norm_weight=attn_norm[i], eps=eps, bias=qkv_bias[i])
        q = rotary_cache_write(qkv, cos, sin, length, k_cache[i], v_cache[i], num_heads,
                               q_norm=q_norm[i], k_norm=k_norm[i], eps=eps)
        x = fused_linear(decode_attention(q, k_cache[i], v_cache[i], length, scale), o[i], residual=x)
        x = fused_linear(fused_linear(x, gate_up[i], norm_weight=mlp_norm[i], eps=eps), down[i],
                         gated=True, residual=x)

    Gemma-3's layer: ``weights["post_attn_norm"]`` and ``weights["post_mlp_norm"]`` ``[L, D]``
    (both or neither) norm the attention's and the MLP's outputs before their residual adds
    (``x = x + rms_norm(out)``, each rounded to x's dtype); ``activation="gelu_tanh"`` gates with
    GELU (tanh approximation) instead of SiLU; the layers in ``sliding_layers`` attend to the last
    ``sliding_window`` positions only (keys ``length - sliding_window < k <= length``) and rotate by
    ``sliding_cos`` / ``sliding_sin`` (``[max_len, hd]``, both or neither; default ``cos`` / ``sin``).
    On CUDA, ``sliding_layers`` needs a model of at most 256 layers. ``input_scale`` multiplies x
    before the first layer: the float32 product, rounded to x's dtype (finite in float32). For a
    value of x's dtype that is exactly ``x * input_scale`` in that dtype, as transformers applies
    Gemma-3's embedding scale cast to the model dtype. Gemma-2's layer is Gemma-3's without q/k
    norms and with ``attn_softcap`` > 0: every attention score ``s`` (after ``scale``) becomes
    ``attn_softcap * tanh(s / attn_softcap)`` before the softmax (0, the default: no cap).

    The result is the residual stream after the last layer (no final norm), in x's dtype. A
    ``length`` outside ``[0, max_len)`` gives NaN and writes nothing; on CUDA such a step costs
    only a launch, so a captured graph can skip it on the device. One persistent kernel on CUDA;
    host-sync free, capturable in CUDA graphs.
    """
    _require_tensor("x", x)
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping of stacked weight tensors, got {type(weights).__name__}")
    for key in _DECODER_STEP_WEIGHTS:
        if key not in weights:
            raise ValueError(f"weights is missing {key!r} (needs {', '.join(_DECODER_STEP_WEIGHTS)}; "
                             f"optionally {', '.join(_DECODER_STEP_OPTIONAL)})")
        _require_tensor(f"weights[{key!r}]", weights[key])
    for key in _DECODER_STEP_OPTIONAL:
        _require_optional_tensor(f"weights[{key!r}]", weights.get(key))
    unknown = sorted(set(weights) - set(_DECODER_STEP_WEIGHTS) - set(_DECODER_STEP_OPTIONAL))
    if unknown:  # a misspelt optional weight would otherwise be dropped silently
        raise ValueError(f"weights has unknown keys {unknown}; expected {', '.join(_DECODER_STEP_WEIGHTS + _DECODER_STEP_OPTIONAL)}")
    for name, value in (("k_cache", k_cache), ("v_cache", v_cache), ("cos", cos), ("sin", sin), ("length", length)):
        _require_tensor(name, value)
    _require_optional_tensor("sliding_cos", sliding_cos)
    _require_optional_tensor("sliding_sin", sliding_sin)
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {_type_name(activation)}")
    if isinstance(sliding_layers, (str, bytes)) or not isinstance(sliding_layers, Sequence):
        raise TypeError(f"sliding_layers must be a sequence of layer indices, got {_type_name(sliding_layers)}")
    sliding_layers = [_require_int("sliding_layers[]", layer) for layer in sliding_layers]
    if scale is None:
        # A k_cache of another shape is rejected by the op before it reads scale.
        scale = 1.0 / math.sqrt(k_cache.shape[3]) if k_cache.dim() == 4 and k_cache.shape[3] > 0 else 1.0
    w = weights
    return _ops.decoder_step(
        x, w["qkv"], w["o"], w["gate_up"], w["down"], w["attn_norm"], w["mlp_norm"], w.get("q_norm"), w.get("k_norm"),
        k_cache, v_cache, cos, sin, length, _require_int("num_heads", num_heads), _require_float("eps", eps),
        _require_float("scale", scale), w.get("qkv_bias"), w.get("post_attn_norm"), w.get("post_mlp_norm"), activation,
        _require_int("sliding_window", sliding_window), sliding_layers, sliding_cos, sliding_sin,
        _require_float("input_scale", input_scale), _require_float("attn_softcap", attn_softcap),
    )


def validate_cluster_table(cluster_tokens: Tensor, vocab_size: int) -> None:
    """Checks a cluster table's ids (reads the data, so it syncs: call it once, not per step).

    Every entry must be a token id in ``[0, vocab_size)`` or the padding value -1, no token may
    appear twice, and every cluster must hold at least one token.
    """
    _require_tensor("cluster_tokens", cluster_tokens)
    vocab_size = _require_int("vocab_size", vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
    if cluster_tokens.dim() != 2 or cluster_tokens.numel() == 0:
        raise ValueError(f"cluster_tokens must be a non-empty 2-D tensor [num_clusters, cluster_size], got shape {tuple(cluster_tokens.shape)}")
    if cluster_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cluster_tokens must hold integer token ids (int32 or int64), got {cluster_tokens.dtype}")
    _require_values("cluster_tokens", cluster_tokens)
    table = cluster_tokens.detach().to("cpu", torch.int64)
    bad = (table < -1) | (table >= vocab_size)
    if bad.any():
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(
            f"cluster_tokens holds id {int(table[where])} at {where}; ids must be in [0, {vocab_size}) or -1 for padding"
        )
    tokens = table[table >= 0].sort().values  # memory in the table's size, not the vocabulary's
    repeated = tokens[1:][tokens[1:] == tokens[:-1]]
    if repeated.numel():
        raise ValueError(f"cluster_tokens lists token {int(repeated[0])} more than once; clusters must be disjoint")
    empty = (table < 0).all(dim=1)
    if empty.any():
        raise ValueError(f"cluster {int(empty.nonzero()[0])} of cluster_tokens holds only padding; every cluster needs a token")


# Fake kernels: output shapes and dtypes, for FakeTensor tracing (torch.compile, opcheck). They also
# run when one argument is on the meta device and the rest are not (the dispatcher then picks the
# Meta kernel), so they check what the C++ ops check first, that all tensors share a device:
# otherwise a CPU call with a meta weight would return uninitialised memory. They also check the
# ranks of the tensors whose sizes they read (in the C++ checks' words) and that the counts that
# size their outputs are at least 1: a compiled call never reaches the C++ checks when its tracing
# fails on an IndexError or a negative size first.
def _register_fake(op: str, ranks: dict[str, tuple[int, str]] | None = None, counts: tuple[str, ...] = ()):
    def register(fake):
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            tensors = [(name, value) for name, value in arguments.items() if isinstance(value, Tensor)]
            first_name, first = tensors[0]
            for name, value in tensors[1:]:
                if value.device != first.device:
                    raise ValueError(f"flashhead.{op}: {name} must be on the same device as {first_name} "
                                     f"({first.device}), got {value.device}")
            for name, (rank, layout) in (ranks or {}).items():
                value = arguments.get(name)
                if isinstance(value, Tensor) and value.dim() != rank:
                    raise ValueError(f"flashhead.{op}: {name} must be a {rank}-D tensor {layout}, "
                                     f"got shape {list(value.shape)}")
            for name in counts:
                if arguments[name] < 1:
                    raise ValueError(f"flashhead.{op}: {name} must be at least 1, got {arguments[name]}")
            return fake(*args, **kwargs)

        torch.library.register_fake(f"flashhead::{op}")(checked)
        return fake
    return register


_HIDDEN_RANK = (2, "[batch, hidden_dim]")


@_register_fake("select_clusters", ranks={"hidden": _HIDDEN_RANK}, counts=("probes",))
def _select_clusters_fake(hidden, centroids, probes, centroid_scale=None):
    shape = (hidden.shape[0], probes)
    return hidden.new_empty(shape, dtype=torch.int32), hidden.new_empty(shape, dtype=torch.float32)


@_register_fake("sample_clusters", ranks={"hidden": _HIDDEN_RANK}, counts=("probes",))
def _sample_clusters_fake(hidden, centroids, probes, temperature, seed, centroid_scale=None):
    return _select_clusters_fake(hidden, centroids, probes)


@_register_fake("gather_candidates", ranks={"cluster_ids": (2, "[batch, probes]"),
                                          "cluster_tokens": (2, "[num_clusters, cluster_size]"),
                                          "extra_ids": (1, "[num_extra]")})
def _gather_candidates_fake(cluster_ids, cluster_tokens, extra_ids):
    width = cluster_ids.shape[1] * cluster_tokens.shape[1] + (0 if extra_ids is None else extra_ids.shape[0])
    return cluster_ids.new_empty((cluster_ids.shape[0], width), dtype=torch.int32)


@_register_fake("candidate_logits", ranks={"candidate_ids": (2, "[batch, num_candidates]")})
def _candidate_logits_fake(hidden, embedding, candidate_ids):
    return hidden.new_empty(candidate_ids.shape, dtype=torch.float32)


@_register_fake("decode_greedy", ranks={"hidden": _HIDDEN_RANK})
def _decode_greedy_fake(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale=None):
    return hidden.new_empty((hidden.shape[0],), dtype=torch.int64)


@_register_fake("decode_greedy_out")
def _decode_greedy_out_fake(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, out, centroid_scale=None):
    return None


@_register_fake("decode_sample", ranks={"hidden": _HIDDEN_RANK})
def _decode_sample_fake(hidden, centroids, cluster_tokens, embedding, probes, temperature, seed, extra_ids,
                        centroid_scale=None):
    batch = (hidden.shape[0],)
    return hidden.new_empty(batch, dtype=torch.int64), hidden.new_empty(batch, dtype=torch.float32)


@_register_fake("fused_linear", ranks={"x": (2, "[tokens, in_features]"),
                                     "weight": (2, "[out_features, in_features]")})
def _fused_linear_fake(x, weight, norm_weight, eps, gated, residual, bias=None, static_weight=False):
    return x.new_empty((x.shape[0], weight.shape[0]))


@_register_fake("rotary_cache_write", ranks={"qkv": (2, "[tokens, (num_heads + 2 * num_kv_heads) * head_dim]"),
                                           "k_cache": (3, "[num_kv_heads, max_len, head_dim]")},
                counts=("num_heads",))
def _rotary_cache_write_fake(qkv, cos, sin, length, k_cache, v_cache, num_heads, q_norm, k_norm, eps):
    return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[2]))  # the caches are written in place


@_register_fake("decode_attention", ranks={"q": (3, "[tokens, num_heads, head_dim]")})
def _decode_attention_fake(q, k_cache, v_cache, length, scale):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@_register_fake("decoder_step")
def _decoder_step_fake(x, qkv_weight, o_weight, gate_up_weight, down_weight, attn_norm, mlp_norm, q_norm, k_norm,
                       k_cache, v_cache, cos, sin, length, num_heads, eps, scale, qkv_bias=None, post_attn_norm=None,
                       post_mlp_norm=None, activation="silu", sliding_window=0, sliding_layers=(), sliding_cos=None,
                       sliding_sin=None, input_scale=1.0, attn_softcap=0.0):
    return x.new_empty(x.shape)  # [1, D]; the caches are written in place


@_register_fake("no_derivative")
def _no_derivative_fake(op, grad, like):
    # A backward through an op traces to this (torch_bindings.cpp), so torch.compile can compile a
    # forward on inputs that require grad; the real kernel raises when a backward runs.
    return torch.empty_like(like, memory_format=torch.contiguous_format)


__all__ = [
    "select_clusters", "sample_clusters", "gather_candidates", "candidate_logits",
    "decode_greedy", "decode_sample", "make_seed", "quantize_centroids", "validate_cluster_table", "TEMPERATURE_RANGE", "ATTENTION_SCALE_MAX",
    "NUM_HEADS_MAX", "CUDA_COUNT_MAX",
    "fused_linear", "rotary_cache_write", "decode_attention", "decoder_step",
]
