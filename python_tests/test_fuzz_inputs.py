"""Every public op and the heads' calls, each with one argument of a valid call mutated at random.

What is mutated. A case starts from a valid call, built by the bad-input tests' builders
(test_bad_inputs for the head ops and the heads, test_decoder_ops and test_decoder_step for the
decoder-layer ops), of one target: select_clusters, sample_clusters, gather_candidates,
candidate_logits, decode_greedy (with and without out), decode_sample, fused_linear,
rotary_cache_write, decode_attention and decoder_step (through flashhead_ext.ops), and FlashHead's
and DenseHead's next_token, sample and candidate_logits. The head ops' and heads' float data are
made integer-valued (exact sums on any device, so ids compare exactly across devices), about a
third of the head ops' centroids are fp8 with a scale, and each option of the decoder-layer ops
(norm, residual, bias, q/k norms, scale; decoder_step's q/k norms, Qwen2's biases, Gemma-3's
layer) is left out of half the calls. Then one argument is changed, drawn from a catalogue:

* a tensor: every other dtype (float64, float16, bfloat16, both float8s, the ints, bool,
  complex), another rank, a size one more, one less, zero or huge (a stride-0 expansion, so
  nothing is allocated), a strided (NaN or a wild id in the gaps), transposed, offset or stride-0
  view, another device (meta; CUDA for a CPU call and the CPU for a CUDA one, where a GPU is), a
  sparse tensor or one made in inference mode, requires_grad, another argument's memory, a list,
  numpy array, Python number, str or None in its place; values: NaN or +-inf in one element
  (FlashHead's and the head ops' floats, whose ranking of them is documented), ids outside their
  table, any int64 cache length or seed, a positive centroid scale, garbage in an output buffer;
* a Python scalar: the wrong type (float for int, bool, str, None, numpy scalars, tensors,
  complex, lists), ints past int64, values out of range (negative, past a limit, NaN, +-inf) and
  values in range;
* decoder_step's weights mapping: an entry left out, an unknown one, a list, None, another
  mapping type; the heads' generator: None, another seed, another type, another device's.

What is checked. The catalogue says of each mutation whether the docs let the op take it. The
mutated call must either

(a) raise TypeError or ValueError whose message names the argument (or an alias the messages
    use: hidden_dim for hidden, decoder_step's qkv_weight or 'qkv' for weights["qkv"]); or, for a
    cache that is a leaf requiring grad, the RuntimeError torch's in-place ops raise
    (docs/kernels.md, "Limits and notes"). A mutation the docs make an error must raise; or
(b) succeed, giving (and writing in place) what the same call gives on the CPU with every
    argument as the ops document they take it: a detached contiguous copy (a view's values, a
    Python int for an int64 seed, a default for None). Ids exactly, values within
    test_decoder_ops.TOL (test_decoder_step.GPU_TOL for decoder_step on CUDA). The sampling calls
    compare with the same call on their own device instead: CUDA's Gumbel noise differs from the
    CPU's in the last bits, and the heads draw their seed from the device's generator.

Anything else fails: another exception type, a message naming nothing, another result, or a CUDA
error, which poisons the context (every later CUDA case then fails at once, naming it). Sizes stay
small: a huge one is drawn only where the op must refuse it (on CUDA also where the CPU op would
take it but a kernel has a limit; the CPU skips those).

A case is (target, device, draw index). The draw is seeded by target and index, so an index draws
the same mutation on either device (but for the device mutations), and a failure prints it.
``FLASHHEAD_RANDOM_DRAWS`` scales the draws: DRAWS_PER_RANDOM_DRAW of them per random draw of
test_random_shapes (384 per target and device by default: about 20 s for the CPU's on two cores).
"""
import functools
import math
import random
import re
import sys
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

import test_bad_inputs as head_inputs
import test_decoder_ops as layer_inputs
import test_decoder_step as step_inputs
from flashhead_ext import DenseHead, FlashHead, ops
from helpers import is_cuda, one_thread, stable_seed  # noqa: F401 (one_thread: an autouse fixture, tiny ops)
from test_random_decoder_ops import laid_out
from test_random_shapes import DRAWS

DRAWS_PER_RANDOM_DRAW = 12

INT32_MAX = 2**31 - 1
CUDA_COUNT_MAX = 2**30  # the CUDA kernels' limit on every count they loop over
FLOAT32_MAX = torch.finfo(torch.float32).max
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)
# Past fused_linear's CUDA grid (524,280 tokens), the CUDA kernels' counts (2^30), int32 (ids),
# uint32, and far past; 2**31 - 1 is the largest int32.
HUGE = (524281, 2**30 + 1, 2**31 - 1, 2**31, 2**32 + 1, 2**40)
FUSED_LINEAR_CUDA_TOKENS = 524280
ATTENTION_CUDA_ROWS = 65535 * 32  # a KV head's query rows: 65,535 tiles of at most 32
RUNNABLE = 64  # the largest size a valid mutation may run at: larger valid sizes are not drawn
SEED = 1234  # the global RNG's before each call: a seed drawn without a generator comes from it
MISSING = object()  # a mutation's value that removes a weights entry
LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"

# What the docs say of a mutation.
ACCEPT, REJECT, SKIP = "the op may take it", "the op must refuse it", "valid, too large to run"

# Argument kinds. Tensors: float data read by the op, ids, a cache length, a seed (also a Python
# int or None), a centroid scale, an output written in place, a cache written in place.
FLOATS, IDS, LENGTH, SEED_T, SCALE, OUT, CACHE = "floats", "ids", "length", "seed", "scale", "out", "cache"
# Python values.
INT, FLOAT, BOOL, STR, LAYERS, GENERATOR, WEIGHTS = "int", "float", "bool", "str", "layers", "generator", "weights"


@dataclass(frozen=True)
class Raises:
    """A documented exception other than TypeError or ValueError: its type and message."""
    error: type
    fragment: str


@dataclass(frozen=True)
class Mutation:
    what: str
    value: object
    verdict: object  # ACCEPT, REJECT, SKIP or Raises


@dataclass(frozen=True)
class Free:
    """A dimension the op takes at other sizes: multiples of step in low..high on every device, at
    most cuda_high on CUDA."""
    low: int = 0
    high: float = math.inf
    cuda_high: float = math.inf
    step: int = 1


def sizes(base, free=None):
    """A shape rule: ``base`` but where ``free`` ({dim: Free}) allows other sizes."""
    free = free or {}

    def rule(shape, device):
        if len(shape) != len(base):
            return REJECT
        verdict = ACCEPT
        for dim, (size, want) in enumerate(zip(shape, base)):
            allowed = free.get(dim)
            if allowed is None:
                if size != want:
                    return REJECT
            elif (not allowed.low <= size <= allowed.high or size % allowed.step
                  or (is_cuda(device) and size > allowed.cuda_high)):
                return REJECT
            elif size > RUNNABLE:
                verdict = SKIP
        return verdict
    return rule


def one_value(shape, device):
    """Seeds, cache lengths and centroid scales: any shape of one element."""
    return ACCEPT if math.prod(shape) == 1 else REJECT


def rows_of(hidden_dim, rows=None, cuda_rows=math.inf):
    """A head's hidden: [..., hidden_dim], its leading dimensions making ``rows`` rows (any when None)."""
    def rule(shape, device):
        n = math.prod(shape[:-1])
        if not shape or shape[-1] != hidden_dim or rows not in (None, n) or (is_cuda(device) and n > cuda_rows):
            return REJECT
        return SKIP if n > RUNNABLE else ACCEPT
    return rule


@dataclass(frozen=True)
class Arg:
    path: tuple  # where the call's arguments hold it: ("hidden",), ("weights", "qkv")
    kind: str
    names: tuple = ()  # what an error message may call it besides its label
    shape: Callable = None  # tensors: a rule of the shapes the op takes
    dtypes: tuple = ()  # tensors: the other dtypes the op takes
    none: str = REJECT  # what None is: REJECT for a required argument or one of a pair given together
    apart: bool = False  # written by the op, which the docs require apart from its other arguments
    bound: int = 0  # ids: the size of the table they index
    nan: bool = False  # floats: NaN and +-inf take a documented ranking
    valid: Callable = None  # scalars: whether the op takes a value (True, False, or SKIP)

    @property
    def label(self) -> str:
        return self.path[0] if len(self.path) == 1 else f"{self.path[0]}[{self.path[1]!r}]"

    @property
    def aliases(self) -> tuple:
        return (self.label, *self.names)


@dataclass(frozen=True)
class Context:
    device: str
    tensors: tuple  # (path, tensor) of the valid call
    apart: frozenset  # paths of what the op writes and the docs keep apart from its other arguments


def shown(value) -> str:
    text = repr(value)
    if len(text) < 40:
        return text
    return f"an int of {value.bit_length()} bits" if isinstance(value, int) else text[:40] + "..."


def verdict_of(valid) -> str:
    return SKIP if valid is SKIP else ACCEPT if valid else REJECT


# ---- mutations of a tensor argument (each returns None where it does not apply) ----------------

def other_dtype(rng, arg, t, ctx):
    dtype = rng.choice([d for d in ALL_DTYPES if d != t.dtype])
    return Mutation(f"as {dtype}", t.to(dtype), ACCEPT if dtype in arg.dtypes else REJECT)


def other_rank(rng, arg, t, ctx):
    what, value = rng.choice([("unsqueezed at 0", t.unsqueeze(0)), ("unsqueezed last", t.unsqueeze(-1)),
                              ("flattened", t.flatten()), ("its first element, 0-D", t.flatten()[0])])
    return None if value.shape == t.shape else Mutation(f"{what}: shape {list(value.shape)}", value,
                                                        arg.shape(value.shape, ctx.device))


def other_size(rng, arg, t, ctx):
    if t.dim() == 0:
        return None
    dim = rng.randrange(t.dim())
    size = rng.choice([t.shape[dim] + 1, t.shape[dim] - 1, 0, rng.choice(HUGE)])
    shape = (*t.shape[:dim], size, *t.shape[dim + 1:])
    first = t.narrow(dim, 0, 1)
    if size <= t.shape[dim]:
        value = t.narrow(dim, 0, size)
    elif size == t.shape[dim] + 1:  # ids padded with masked slots (-1), floats with their first slice
        first = first.cpu()  # joined on the CPU, which does every dtype
        value = torch.cat([t.cpu(), torch.full_like(first, -1) if arg.kind == IDS else first], dim).to(t.device)
    else:  # stride 0: no memory
        value = first.expand(shape)
    return Mutation(f"of shape {list(shape)}", value, arg.shape(shape, ctx.device))


def other_layout(rng, arg, t, ctx):
    long_dims = [d for d in range(t.dim()) if t.shape[d] > 1]
    layouts = ["offset", *(["strided"] if t.dim() else []), *(["transposed"] if len(long_dims) > 1 else []),
               *(["stride-0"] if long_dims else [])]
    layout = rng.choice(layouts)
    if layout == "transposed":  # the dimensions' order reversed in memory
        order = list(range(t.dim()))[::-1]
        value = t.permute(order).contiguous().permute(order)
    elif layout == "stride-0":  # a slice's values repeated
        dim = rng.choice(long_dims)
        value = t.narrow(dim, 0, 1).expand(t.shape)
    else:
        value = laid_out(t, layout)
    if arg.kind == CACHE:  # written in place: contiguous
        verdict = ACCEPT if value.is_contiguous() else REJECT
    else:  # an output written element by element must not have two at one address
        verdict = REJECT if arg.kind == OUT and layout == "stride-0" else ACCEPT
    return Mutation(f"as a {layout} view (strides {list(value.stride())})", value, verdict)


def other_device(rng, arg, t, ctx):
    devices = ["meta"]
    if torch.cuda.is_available():
        devices += ["cuda"] if not is_cuda(ctx.device) else ["cpu", *(["cuda:1"] if torch.cuda.device_count() > 1 else [])]
    device = rng.choice(devices)
    return Mutation(f"on {device}", t.to(device), REJECT)


def other_kind(rng, arg, t, ctx):
    """Another kind of tensor: a sparse one (the ops take dense ones), or one made in inference mode
    (taken, and written in place too: docs/kernels.md, "Limits and notes")."""
    kinds = ["inference", *(["sparse COO"] if t.dtype != torch.float8_e4m3fn else []),  # no fp8 kernel for it
             *(["sparse CSR"] if t.dim() == 2 else [])]
    kind = rng.choice(kinds)
    if kind == "inference":
        with torch.inference_mode():
            return Mutation("made in inference mode", t.clone(), ACCEPT)
    with warnings.catch_warnings():  # sparse CSR support is "in beta state"
        warnings.simplefilter("ignore")
        sparse = t.cpu().to_sparse() if kind == "sparse COO" else t.cpu().to_sparse_csr()  # every dtype's kernels
        return Mutation(f"as a {kind} tensor", sparse.to(t.device), REJECT)


def requiring_grad(rng, arg, t, ctx):
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return None
    # A cache the op writes is refused as torch's in-place ops refuse a leaf that requires grad.
    return Mutation("requiring grad", t.detach().clone().requires_grad_(),
                    Raises(RuntimeError, LEAF_IN_PLACE) if arg.kind == CACHE else ACCEPT)


def sharing_memory(rng, arg, t, ctx):
    """Its shape over another argument's memory: the values of one of its dtype, or any bytes for
    what the op writes."""
    writes = arg.kind in (OUT, CACHE)
    sources = [(path, other) for path, other in ctx.tensors if path != arg.path and other.device == t.device
               and (other.nbytes >= t.nbytes if writes else other.dtype == t.dtype and other.numel() >= t.numel())]
    if not sources:
        return None
    path, other = rng.choice(sources)
    flat = other.detach().reshape(-1)
    value = (flat.view(torch.uint8)[:t.nbytes].view(t.dtype) if writes else flat[:t.numel()]).view(t.shape)
    verdict = REJECT if arg.apart or path in ctx.apart else ACCEPT
    return Mutation(f"in the memory of {Arg(path, '').label}", value, verdict)


def not_a_tensor(rng, arg, t, ctx):
    listed = t.tolist()  # a Python number for a 0-D tensor
    python_int = ACCEPT if arg.kind == SEED_T else REJECT  # a seed may be one
    what, value, verdict = rng.choice([
        ("None", None, arg.none),
        ("a list" if t.dim() else f"{listed!r}", listed, python_int if type(listed) is int else REJECT),
        ("a numpy array", np.zeros(tuple(t.shape)), REJECT), ("a Python float", 0.5, REJECT), ("a str", "tensor", REJECT),
        ("a Python int", 3, python_int),
    ])
    return Mutation(f"replaced by {what}", value, verdict)


def odd_values(rng, arg, t, ctx):
    value = t.to("cpu", copy=True)  # filled on the CPU, which does every dtype
    index = rng.randrange(t.numel())
    if arg.kind == IDS:  # masked slots
        v = rng.choice([-1, -2, -2**31, INT32_MAX, arg.bound, arg.bound + 7])
    elif arg.kind in (LENGTH, SEED_T):  # past either end of the caches (12 long) gives NaN rows; any seed draws
        v = rng.choice([-2**63, -1, 0, 11, 12, 13, 2**31, 2**63 - 1, rng.randrange(-2**63, 2**63)])
    elif arg.kind == SCALE:  # exact, as the data's scale
        v = 2.0 ** rng.randint(-8, 8)
    elif arg.kind == OUT:  # what out held before must not matter
        v = rng.choice([-1, 2**62])
    elif arg.nan:
        v = rng.choice([math.nan, math.inf, -math.inf])
        if value.dtype == torch.float8_e4m3fn and math.isinf(v):  # no infinity: saturated, as newer torch stores it
            v = math.copysign(448.0, v)
    else:
        return None
    value.view(-1)[index] = v
    return Mutation(f"holding {v} at flat index {index}", value.to(t.device), ACCEPT)


def left_out(rng, arg, t, ctx):
    """decoder_step's weights entries: absent from the mapping, which is as None."""
    return Mutation("left out of weights", MISSING, arg.none) if arg.path[0] == "weights" else None


def seed_ints(rng, arg, t, ctx):
    v = rng.choice([0, -1, 12345, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**64, 1.5, True, np.int64(5), "5"])
    valid = type(v) is int and -2**63 <= v < 2**63
    return Mutation(f"replaced by {shown(v)}", v, ACCEPT if valid else REJECT)


TENSOR_MUTATIONS = (other_dtype, other_rank, other_size, other_layout, other_device, other_kind, requiring_grad,
                    sharing_memory, not_a_tensor, odd_values, left_out)


# ---- mutations of a Python argument ------------------------------------------------------------

COMMON_INTS = (0, 1, -1, 2, 3, 4, 6, 7, 8, 2**16 + 2, 2**31 - 1, 2**31, 2**62, 2**63 - 1, -2**63, 2**63, -2**63 - 1,
               2**64, 10**30)
COMMON_FLOATS = (0.0, -0.0, -1.0, -1e-6, 1e-30, 9.9e-7, 1e-6, 0.25, 0.5, 1, 2, 1e6, 1.01e6, 3e38, 1e39, 1e300, -1e300,
                 math.nan, math.inf, -math.inf, 10**400, -10**400)


def int_values(rng, arg, v0, ctx):
    v = rng.choice(COMMON_INTS)
    return Mutation(f"= {shown(v)}", v, verdict_of(arg.valid(v)))


def float_values(rng, arg, v0, ctx):
    v = rng.choice(COMMON_FLOATS)
    return Mutation(f"= {shown(v)}", v, verdict_of(arg.valid(v)))


def wrong_types(candidates):
    def mutate(rng, arg, v0, ctx):
        v = rng.choice(candidates(v0))
        return Mutation(f"= {shown(v)} ({type(v).__name__})", v, arg.none if v is None else REJECT)
    return mutate


int_types = wrong_types(lambda v: [float(v), True, False, np.int64(v), np.int32(v), str(v), None, torch.tensor(v),
                                   complex(v), [v]])
float_types = wrong_types(lambda v: [True, str(v), None, np.float64(v), np.float32(v), torch.tensor(v), complex(v), [v]])
bool_types = wrong_types(lambda v: [0, 1, None, "True", np.bool_(v), torch.tensor(v)])
str_types = wrong_types(lambda v: [None, 1, v.encode(), [v]])
layers_types = wrong_types(lambda v: [1, "01", None, [0.5], [True], [np.int64(0)], torch.tensor([0]), {0}])


def bool_values(rng, arg, v0, ctx):
    v = rng.choice([True, False])
    return Mutation(f"= {v}", v, verdict_of(arg.valid(v)))


def str_values(rng, arg, v0, ctx):
    v = rng.choice(["silu", "gelu_tanh", "gelu", "", "SILU", "silu ", "relu"])
    return Mutation(f"= {v!r}", v, verdict_of(arg.valid(v)))


def layers_values(rng, arg, v0, ctx):
    # The valid call's model has two layers.
    v = rng.choice([(), (0,), (1,), (0, 1), [1, 0], range(2), (2,), (-1,), (0, 0), (2**63,), (-2**63 - 1,)])
    valid = all(0 <= layer < 2 for layer in v) and len(set(v)) == len(v)
    return Mutation(f"= {shown(v)}", v, ACCEPT if valid else REJECT)


def generators(rng, arg, v0, ctx):
    options = [(None, ACCEPT), (torch.Generator(ctx.device).manual_seed(99), ACCEPT), (5, REJECT), ("cpu", REJECT),
               (np.random.default_rng(0), REJECT)]
    if torch.cuda.is_available():
        options.append((torch.Generator("cpu" if is_cuda(ctx.device) else "cuda"), REJECT))
    v, verdict = rng.choice(options)
    where = f" on {v.device}" if isinstance(v, torch.Generator) else ""
    return Mutation(f"= {type(v).__name__}{where}", v, verdict)


def weights_mappings(rng, arg, weights, ctx):
    """decoder_step's weights as a whole (left_out drops one entry): an unknown key, a list of the
    tensors, None, another Mapping type."""
    return rng.choice([
        Mutation("with an unknown key 'q_norms'", {**weights, "q_norms": weights["qkv"]}, REJECT),
        Mutation("as a list", list(weights.values()), REJECT),
        Mutation("as None", None, REJECT),
        Mutation("as a MappingProxyType", types.MappingProxyType(weights), ACCEPT),
    ])


MUTATIONS = {
    **dict.fromkeys((FLOATS, IDS, LENGTH, SCALE, OUT, CACHE), TENSOR_MUTATIONS),
    SEED_T: (*TENSOR_MUTATIONS, seed_ints),
    INT: (int_values, int_types), FLOAT: (float_values, float_types), BOOL: (bool_values, bool_types),
    STR: (str_values, str_types), LAYERS: (layers_values, layers_types), GENERATOR: (generators,),
    WEIGHTS: (weights_mappings,),
}


# ---- the targets -----------------------------------------------------------------------------

def copied(value, device):
    """``value`` (arguments, nested) with every tensor a detached contiguous copy on ``device``:
    how the ops take a view, a tensor requiring grad or one sharing memory (and a generator the
    same seed's, unused)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, memory_format=torch.contiguous_format, copy=True)
    if isinstance(value, Mapping):
        return {k: copied(v, device) for k, v in value.items()}
    if isinstance(value, torch.Generator):
        return torch.Generator(device).manual_seed(value.initial_seed())
    return value


def integer_valued(value):
    """Float tensors as small integers (their sums exact in float32 in any order), others as they are."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return (value * 4).round()
    return value


def finite(v) -> bool:
    return -sys.float_info.max <= v <= sys.float_info.max  # False for NaN, and for ints past float64


def in_range(low, high):
    return lambda v: low <= v <= high


@dataclass(frozen=True)
class Target:
    build: Callable  # (device, rng) -> the valid call's arguments on the device
    call: Callable  # (arguments, device) -> the result
    specs: Callable  # the valid arguments -> [Arg]
    written: tuple = ()  # the arguments the call writes in place
    same_device: bool = False  # the expected result comes from the call's device, not the CPU


HEAD = head_inputs.SHAPE  # B 3, D 16, C 7, b 4, p 2, V 27, 4 extra ids
SELECTION_OPS = ("select_clusters", "sample_clusters")
SAMPLING_OPS = ("sample_clusters", "decode_sample")


def head_op(op):
    call = ops.decode_greedy if op == "decode_greedy_out" else getattr(ops, op)

    def build(device, rng):
        args = {k: integer_valued(v) for k, v in head_inputs.valid_args("cpu").items() if k in head_inputs.USES[op]}
        if "centroids" in args and rng.random() < 0.3:  # fp8 centroids with their scale
            args["centroids"], args["centroid_scale"] = ops.quantize_centroids(args["centroids"])
        return copied(args, device)

    def specs(args):
        shape = {name: tuple(value.shape) for name, value in args.items() if isinstance(value, torch.Tensor)}
        E = args["extra_ids"].numel() if "extra_ids" in args else 0

        def tensor(name, kind=FLOATS, free=None, **options):
            return Arg((name,), kind, shape=sizes(shape[name], free), **options)

        # The sizes an op takes apart from the other arguments'. On CUDA each is at most 2^30, and
        # so is a row's candidates, probes * cluster_size + extras (the valid call's p and b).
        batch = {0: Free(cuda_high=CUDA_COUNT_MAX)} if op in (*SELECTION_OPS, "decode_greedy", "decode_sample") else None
        cluster_size = Free(low=1, cuda_high=(CUDA_COUNT_MAX - E) // HEAD.p)
        fp8 = "centroids" in args and args["centroids"].dtype == torch.float8_e4m3fn
        all_specs = {
            # fp8 centroids take hidden of any float dtype; an embedding must have hidden's.
            "hidden": lambda: tensor("hidden", free=batch, names=("hidden_dim",), nan=True,
                                     dtypes=ops.FLOAT_DTYPES if fp8 and "embedding" not in args else ()),
            "centroids": lambda: tensor("centroids", nan=True, dtypes=(torch.float32, torch.float8_e4m3fn),
                                        free={0: Free(low=HEAD.p, high=INT32_MAX, cuda_high=CUDA_COUNT_MAX)} if op in SELECTION_OPS
                                        else None),  # the decodes' rows are cluster_tokens'
            "embedding": lambda: tensor("embedding", free={0: Free(low=1, high=INT32_MAX)}, nan=True),
            "cluster_tokens": lambda: tensor("cluster_tokens", IDS, {
                **({0: Free(low=1, cuda_high=CUDA_COUNT_MAX)} if op == "gather_candidates" else {}), 1: cluster_size},
                bound=HEAD.V),
            "cluster_ids": lambda: tensor("cluster_ids", IDS, {0: Free(cuda_high=CUDA_COUNT_MAX),
                                                               1: Free(cuda_high=(CUDA_COUNT_MAX - E) // HEAD.b)}, bound=HEAD.C),
            "extra_ids": lambda: tensor("extra_ids", IDS, {0: Free(cuda_high=CUDA_COUNT_MAX - HEAD.p * HEAD.b)}, none=ACCEPT,
                                        bound=HEAD.V),
            "candidate_ids": lambda: tensor("candidate_ids", IDS, {1: Free(cuda_high=CUDA_COUNT_MAX)}, bound=HEAD.V),
            "probes": lambda: Arg(("probes",), INT, valid=in_range(1, HEAD.C)),
            "temperature": lambda: Arg(("temperature",), FLOAT, valid=in_range(*ops.TEMPERATURE_RANGE)),
            "seed": lambda: Arg(("seed",), SEED_T, shape=one_value, none=ACCEPT),
            "out": lambda: tensor("out", OUT, none=ACCEPT, apart=True),
            "centroid_scale": lambda: Arg(("centroid_scale",), SCALE, shape=one_value, none=ACCEPT),
        }
        return [all_specs[name]() for name in args]

    return Target(build, lambda args, device: call(**args), specs, ("out",) if op == "decode_greedy_out" else (),
                  op in SAMPLING_OPS)


# The decoder-layer ops' options, each left out of half the valid calls (q_norm and k_norm together).
LAYER_OPTIONS = {"fused_linear": (("norm_weight",), ("residual",), ("bias",)),
                 "rotary_cache_write": (("q_norm", "k_norm"),), "decode_attention": (("scale",),)}


def layer_op(op):
    def build(device, rng):
        args = {k: v for k, v in layer_inputs.valid_args(device).items() if k in layer_inputs.USES[op]}
        for option in LAYER_OPTIONS[op]:
            if rng.random() < 0.5:
                for name in option:
                    del args[name]
        return args

    def specs(args):
        def tensor(name, kind=FLOATS, free=None, none=REJECT):
            return Arg((name,), kind, shape=sizes(tuple(args[name].shape), free), none=none, apart=kind == CACHE)

        H, KV, M = layer_inputs.H_, layer_inputs.KV_, layer_inputs.M_
        # eps is only read (and checked) with a norm; unread, any float64 is taken.
        eps = (lambda v: finite(v) and v >= 0) if {"norm_weight", "q_norm"} & set(args) else (
            lambda v: not isinstance(v, int) or finite(v))
        all_specs = {
            # Any token count without a residual (none too), up to the CUDA grid's.
            "x": lambda: tensor("x", free=None if "residual" in args else {0: Free(cuda_high=FUSED_LINEAR_CUDA_TOKENS)}),
            # Any out_features without a residual and a bias (at least one), on CUDA up to 2^30.
            "weight": lambda: tensor("weight", free=None if {"residual", "bias"} & set(args) else {
                0: Free(low=1, cuda_high=CUDA_COUNT_MAX)}),
            "norm_weight": lambda: tensor("norm_weight", none=ACCEPT), "residual": lambda: tensor("residual", none=ACCEPT),
            "bias": lambda: tensor("bias", none=ACCEPT),
            "eps": lambda: Arg(("eps",), FLOAT, valid=eps),
            "gated": lambda: Arg(("gated",), BOOL, valid=lambda v: not v),  # x is not [M, 2K]
            "static_weight": lambda: Arg(("static_weight",), BOOL, valid=lambda v: True),
            "qkv": lambda: tensor("qkv", free={0: Free(low=1, cuda_high=CUDA_COUNT_MAX)}),  # any token count
            "cos": lambda: tensor("cos"), "sin": lambda: tensor("sin"),
            "length": lambda: Arg(("length",), LENGTH, shape=one_value),
            # Written in place by rotary_cache_write, read by decode_attention.
            "k_cache": lambda: tensor("k_cache", CACHE if op == "rotary_cache_write" else FLOATS),
            "v_cache": lambda: tensor("v_cache", CACHE if op == "rotary_cache_write" else FLOATS),
            "num_heads": lambda: Arg(("num_heads",), INT, valid=lambda v: v == H),
            "q_norm": lambda: tensor("q_norm"), "k_norm": lambda: tensor("k_norm"),  # given together
            # Any token count, any multiple of the KV heads; on CUDA up to a KV head's query rows
            # (tokens times query heads per KV head) the tiles take.
            "q": lambda: tensor("q", free={0: Free(low=1, cuda_high=ATTENTION_CUDA_ROWS // (H // KV)),
                                           1: Free(low=1, step=KV, cuda_high=ATTENTION_CUDA_ROWS * KV // M)}),
            "scale": lambda: Arg(("scale",), FLOAT, none=ACCEPT, valid=lambda v: 0 < v <= ops.ATTENTION_SCALE_MAX),
        }
        return [all_specs[name]() for name in args]

    return Target(build, lambda args, device: getattr(ops, op)(**args), specs,
                  ("k_cache", "v_cache") if op == "rotary_cache_write" else ())


def step_build(device, rng):
    """test_decoder_step's valid call (its bad-input tests' sizes), with each of its options (q/k
    norms, Qwen2's biases, Gemma-3's layer) in half the draws."""
    qk_norm, qkv_bias, gemma = (rng.random() < 0.5 for _ in range(3))
    s = step_inputs
    args = s.step_args(s.L_, s.D_, s.I_, s.H_, s.KV_, s.HD_, s.MAX_LEN_, 3, qk_norm, torch.float32, scale=0.5,
                       qkv_bias=qkv_bias, gemma=gemma)
    return copied(args, device)


def step_specs(args):
    def tensor(path, kind=FLOATS, names=(), none=REJECT):  # every size is tied to another argument's
        holder = args["weights"] if len(path) == 2 else args
        return Arg(path, kind, names, sizes(tuple(holder[path[-1]].shape)), none=none, apart=kind == CACHE)

    all_specs = {
        "x": lambda: tensor(("x",)), "weights": lambda: Arg(("weights",), WEIGHTS),
        "k_cache": lambda: tensor(("k_cache",), CACHE), "v_cache": lambda: tensor(("v_cache",), CACHE),
        "cos": lambda: tensor(("cos",)), "sin": lambda: tensor(("sin",)),
        "sliding_cos": lambda: tensor(("sliding_cos",)), "sliding_sin": lambda: tensor(("sliding_sin",)),
        "length": lambda: Arg(("length",), LENGTH, shape=one_value),
        "num_heads": lambda: Arg(("num_heads",), INT, valid=lambda v: v == step_inputs.H_),
        "eps": lambda: Arg(("eps",), FLOAT, valid=lambda v: finite(v) and v >= 0),
        "scale": lambda: Arg(("scale",), FLOAT, none=ACCEPT, valid=lambda v: 0 < v <= ops.ATTENTION_SCALE_MAX),
        "activation": lambda: Arg(("activation",), STR, valid=lambda v: v in ("silu", "gelu_tanh")),
        "sliding_window": lambda: Arg(("sliding_window",), INT, valid=lambda v: 1 <= v < 2**63),  # with sliding layers
        "sliding_layers": lambda: Arg(("sliding_layers",), LAYERS),
        # Finite in float32; larger valid ones overflow the residual stream to inf and NaN.
        "input_scale": lambda: Arg(("input_scale",), FLOAT,
                                   valid=lambda v: abs(v) <= 4 or (SKIP if abs(v) <= FLOAT32_MAX else False)),
    }
    # qkv_bias is optional alone; the other entries are required or one of a pair given together.
    # An entry is named by the op's name for it, or as the mapping's key ("weights is missing 'o'").
    entries = [tensor(("weights", key), names=(step_inputs.WEIGHT_ARG[key], key),
                      none=ACCEPT if key == "qkv_bias" else REJECT) for key in args["weights"]]
    return [all_specs[name]() for name in args] + entries


@functools.lru_cache(maxsize=None)
def head(kind, device):
    args = {k: integer_valued(v) for k, v in head_inputs.head_args(device).items()}
    return FlashHead(**args) if kind == "FlashHead" else DenseHead(args["embedding"])


def head_call(kind, method):
    def build(device, rng):
        args = {"hidden": integer_valued(head_inputs.valid_args("cpu")["hidden"])}
        if method == "next_token":
            args["out"] = torch.empty(HEAD.B, dtype=torch.int64)
        if method == "sample":
            args.update(temperature=0.8, generator=torch.Generator().manual_seed(7))
        return copied(args, device)

    def specs(args):
        all_specs = {
            # FlashHead's ops refuse rows past 2^30 on CUDA; DenseHead has no limit (none is drawn).
            "hidden": Arg(("hidden",), FLOATS, shape=rows_of(HEAD.D, HEAD.B if "out" in args else None,
                                                              CUDA_COUNT_MAX if kind == "FlashHead" else math.inf),
                          nan=kind == "FlashHead"),  # DenseHead's argmax has no documented order among NaNs
            "out": Arg(("out",), OUT, shape=sizes((HEAD.B,)), none=ACCEPT),
            "temperature": Arg(("temperature",), FLOAT, valid=in_range(*ops.TEMPERATURE_RANGE)),
            "generator": Arg(("generator",), GENERATOR),
        }
        return [all_specs[name] for name in args]

    return Target(build, lambda args, device: getattr(head(kind, device), method)(**args), specs,
                  ("out",) if method == "next_token" else (), method == "sample")


TARGETS = {
    **{op: head_op(op) for op in head_inputs.CALLS},
    **{op: layer_op(op) for op in layer_inputs.USES},
    "decoder_step": Target(step_build, lambda args, device: ops.decoder_step(**args), step_specs, ("k_cache", "v_cache")),
    **{f"{kind}.{method}": head_call(kind, method) for kind in ("FlashHead", "DenseHead")
       for method in ("next_token", "sample", "candidate_logits")},
}


# ---- drawing and checking a case ---------------------------------------------------------------

def get(args, path):
    for key in path:
        args = args[key]
    return args


def draw(rng, target, args, device):
    """(the argument, its mutation): an argument, then a kind of mutation, until one applies."""
    specs = target.specs(args)
    ctx = Context(device, tuple((a.path, get(args, a.path)) for a in specs if isinstance(get(args, a.path), torch.Tensor)),
                  frozenset(a.path for a in specs if a.apart))
    while True:
        arg = rng.choice(specs)
        mutation = rng.choice(MUTATIONS[arg.kind])(rng, arg, get(args, arg.path), ctx)
        if mutation is not None and mutation.verdict != SKIP:
            return arg, mutation


def names(message: str, arg: Arg) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message) for name in arg.aliases)


# torch.AcceleratorError is newer than torch 2.6, whose CUDA errors are RuntimeErrors, told by their message.
ACCELERATOR_ERRORS = tuple(getattr(torch, name) for name in ("AcceleratorError",) if hasattr(torch, name))


def is_cuda_error(error: Exception) -> bool:
    return isinstance(error, ACCELERATOR_ERRORS) or "CUDA error" in str(error)


def tensors(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check_same(got, want, tol, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}")
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.is_floating_point():
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{what}: {m}", **tol[want.dtype])
    else:
        assert torch.equal(got, want), f"{what}: {got.tolist()}, expected {want.tolist()}"


CUDA_ERRORS = []  # the case that raised one: the context is unusable after it


def check_refusal(error, arg, mutation, case):
    """(a): a TypeError or ValueError naming the argument, or the documented exception."""
    if is_cuda_error(error):
        CUDA_ERRORS.append(case)
        raise AssertionError(f"{case}: CUDA ERROR (every later CUDA case fails): {error}") from error
    if isinstance(mutation.verdict, Raises):
        assert isinstance(error, mutation.verdict.error) and mutation.verdict.fragment in str(error), (
            f"{case}: raised {type(error).__name__}: {error}; expected {mutation.verdict}")
        return
    assert isinstance(error, (TypeError, ValueError)), f"{case}: raised {type(error).__name__}: {error}"
    assert names(str(error), arg), f"{case}: the message names none of {arg.aliases}: {error}"


@pytest.mark.parametrize("index", range(DRAWS_PER_RANDOM_DRAW * DRAWS))
@pytest.mark.parametrize("target", list(TARGETS))
def test_mutated_argument(target, index, device):
    if is_cuda(device) and CUDA_ERRORS:
        pytest.fail(f"not run: {CUDA_ERRORS[0]} raised a CUDA error, which left the CUDA context unusable")
    spec = TARGETS[target]
    rng = random.Random(stable_seed("fuzz-inputs", target, index))
    args = spec.build(device, rng)
    arg, mutation = draw(rng, spec, args, device)
    case = f"{target} draw {index} on {device}: {arg.label} {mutation.what} ({mutation.verdict})"
    holder = get(args, arg.path[:-1])
    if mutation.value is MISSING:
        del holder[arg.path[-1]]
    else:
        holder[arg.path[-1]] = mutation.value
    reference = device if spec.same_device else "cpu"
    expected_args = copied(args, reference) if mutation.verdict == ACCEPT else None  # before the call writes
    try:
        torch.manual_seed(SEED)
        got = spec.call(args, device)
        if is_cuda(device):
            torch.cuda.synchronize()  # a kernel's fault surfaces here, in its own case
    except Exception as error:
        check_refusal(error, arg, mutation, case)
        return
    # (b): the result, and what the call wrote, of the call on the arguments as the op takes them.
    assert mutation.verdict == ACCEPT, f"{case}: accepted"
    torch.manual_seed(SEED)
    expected = spec.call(expected_args, reference)
    tol = step_inputs.GPU_TOL if target == "decoder_step" and is_cuda(device) else layer_inputs.TOL
    got, expected = tensors(got), tensors(expected)
    assert len(got) == len(expected) and all(t.device.type == torch.device(device).type for t in got), case
    for i, (g, e) in enumerate(zip(got, expected)):
        check_same(g, e, tol, f"{case}: output {i}")
    for name in spec.written:
        if isinstance(args[name], torch.Tensor):
            check_same(args[name], expected_args[name], tol, f"{case}: {name} after the call")
