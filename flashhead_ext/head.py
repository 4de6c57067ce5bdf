"""FlashHead and DenseHead: interchangeable next-token heads over a model's output embedding.

Both take final hidden states ``[..., D]`` and offer the same three calls:

* ``next_token(hidden)`` -> int64 token ids ``[...]`` (greedy),
* ``sample(hidden, temperature, generator)`` -> ``(tokens, token_logprobs)``,
* ``candidate_logits(hidden)`` -> ``(candidate_ids int32 [..., N], logits float32 [..., N])``.

DenseHead is the baseline every benchmark compares against: one matmul over the whole
vocabulary, then argmax or a Gumbel-max draw, in plain torch.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import AbstractSet, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from . import ops
from ._stacklevel import callers_stacklevel


HEAD_DTYPES = ops.FLOAT_DTYPES  # what the heads and the ops take
SpecialTokenIds = Union[Sequence[int], AbstractSet[int], Tensor]


def _check_embedding(embedding) -> None:
    if not isinstance(embedding, Tensor):
        raise TypeError(f"embedding must be a torch.Tensor [vocab_size, hidden_dim], got {type(embedding).__name__}")
    ops._require_dense("embedding", embedding)
    if embedding.dim() != 2 or embedding.numel() == 0:
        raise ValueError(f"embedding must be a non-empty 2-D tensor [vocab_size, hidden_dim], got shape {tuple(embedding.shape)}")
    if embedding.dtype not in HEAD_DTYPES:
        raise TypeError(f"embedding must be float16, bfloat16 or float32, got {embedding.dtype}")


def _share_bytes(a: Tensor, b: Tensor) -> bool:
    """Whether the bytes two strided tensors span overlap (ops' share_bytes, checks.h)."""
    if is_fake(a) or is_fake(b):  # no memory: every FakeTensor's data_ptr is 0
        return False
    if a.device != b.device or a.is_meta or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a_begin, a_end), (b_begin, b_end) = span(a), span(b)
    return a_begin < b_end and b_begin < a_end


def _holds_a_bool(values) -> bool:
    """Whether nested lists or tuples hold a bool (also as a tensor)."""
    return any(_holds_a_bool(v) if isinstance(v, (list, tuple)) else
               isinstance(v, bool) or (isinstance(v, Tensor) and v.dtype == torch.bool) for v in values)


def special_token_list(special_token_ids, vocab: int) -> list:
    """``special_token_ids`` (None, a sequence or set of ints or an integer tensor) as a list of ids in
    ``[0, vocab)``, or a TypeError / ValueError naming it (for a tokenizer without an EOS token,
    ``[tokenizer.eos_token_id]`` is ``[None]``)."""
    if special_token_ids is None:
        return []
    if isinstance(special_token_ids, Tensor) and special_token_ids.is_meta:
        raise ValueError("special_token_ids is a meta tensor: its ids have no values (pass ints or a tensor on a real device)")
    if isinstance(special_token_ids, Tensor):
        ops._require_dense("special_token_ids", special_token_ids)
    expected = "special_token_ids must be integer token ids (a sequence or set of ints, or an integer tensor), got"
    try:
        if isinstance(special_token_ids, (set, frozenset)):  # torch.as_tensor takes no sets
            special_token_ids = sorted(special_token_ids)
        if isinstance(special_token_ids, (list, tuple)) and _holds_a_bool(special_token_ids):
            raise TypeError  # torch.as_tensor makes [True, 1] the ids [1, 1]
        ids = torch.as_tensor(special_token_ids, device="cpu").flatten()  # read on the host, whatever the default device
    except (TypeError, ValueError, OverflowError, RuntimeError):
        # Python ints past int64 are ids out of range, not ids of another type.
        listed = [special_token_ids] if isinstance(special_token_ids, int) else special_token_ids
        if isinstance(listed, (list, tuple)) and listed and all(type(i) is int for i in listed):
            raise ValueError(f"special_token_ids must be in [0, {vocab}), got {list(listed)}") from None
        raise TypeError(f"{expected} {special_token_ids!r}") from None
    if ids.numel() == 0:
        return []
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{expected} {ids.dtype}")
    ids = ids.to("cpu", torch.int64)
    if ((ids < 0) | (ids >= vocab)).any():
        raise ValueError(f"special_token_ids must be in [0, {vocab}), got {ids.tolist()}")
    return ids.tolist()


def _require_float_centroids(name: str, centroids: Tensor) -> None:
    if centroids.dtype not in HEAD_DTYPES + (torch.float64,):
        # fp8 ones would come without their scale: FlashHead quantizes float ones itself.
        raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor (centroid_dtype="
                        f"torch.float8_e4m3fn quantizes them), got {centroids.dtype}")


def _own_copy(tensor: Tensor, device, dtype) -> Tensor:
    """A contiguous copy on ``device`` in ``dtype``, never the caller's tensor: a head's buffers
    are its own, so loading a state into one head changes no clustering or other head."""
    return tensor.detach().to(device, dtype, memory_format=torch.contiguous_format, copy=True)


class _ApplyRecorder(nn.Module):
    def _apply(self, fn, recurse=True):
        self.__dict__["fn"] = fn
        return self


# The code of the function Module.to_empty() passes to _apply, read off torch itself. It gives every
# tensor new storage without values, on any device; told by its code, since no probe tensor can tell
# an empty copy from a value-keeping move (uninitialised memory may hold the probe's values).
_TO_EMPTY_CODE = getattr(_ApplyRecorder().to_empty(device="meta").fn, "__code__", None)


def _empties(fn, was_meta: bool, is_meta: bool) -> bool:
    """Whether Module._apply's ``fn`` leaves a tensor without values: to_empty()'s, or any move off
    the meta device, which only to_empty() can make."""
    return (_TO_EMPTY_CODE is not None and getattr(fn, "__code__", None) is _TO_EMPTY_CODE) or (was_meta and not is_meta)


def _require_values(name: str, centroids: Tensor) -> None:
    ops._require_values(name, centroids, " (centroids are kept on the embedding's device, so a meta embedding puts "
                                         "them there too); FlashHead ranks clusters by them: materialise the weights first")


def _check_finite(name: str, centroids: Tensor) -> None:
    _require_values(name, centroids)
    # A sync, once per build or load: a NaN centroid would silently rank its cluster last at every step.
    if not torch.isfinite(centroids).all():
        raise ValueError(f"{name} must be finite; it holds NaN or inf (as {centroids.dtype})")


FP8_CENTROIDS = torch.float8_e4m3fn


def centroid_dtype_option(centroid_dtype, embedding_dtype: torch.dtype) -> Optional[torch.dtype]:
    """``centroid_dtype`` as FlashHead takes it: None for the embedding's dtype (given as None or as
    that dtype), or float8_e4m3fn; a TypeError naming it otherwise. Normalised to None, a
    setting kept for later heads follows the embedding through casts."""
    if centroid_dtype is None or centroid_dtype == embedding_dtype:
        return None
    if centroid_dtype == FP8_CENTROIDS:
        return FP8_CENTROIDS
    raise TypeError(f"centroid_dtype must be None, the embedding's dtype {embedding_dtype} or torch.float8_e4m3fn, "
                    f"got {centroid_dtype!r}")


class _HeadBase(nn.Module):
    embedding: Tensor

    def _keep_embedding(self, embedding: Tensor) -> None:
        # Not persistent: it is the model's own weight, shared, never a copy. A weight given as an
        # nn.Parameter (a module's) is also kept as given, so that the buffer can follow it.
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.__dict__["_weight"] = embedding if isinstance(embedding, nn.Parameter) else None  # not registered
        self.__dict__["_embedding_unset"] = False
        self._share_weight()

    def _share_weight(self) -> None:
        """Points the buffer at the kept weight and notes where, so that a conversion can tell that
        the buffer was the weight before it (a module converts its weight before or after the head)."""
        weight = self.__dict__.get("_weight")
        if weight is not None:
            self._buffers["embedding"] = weight.detach()
        self.__dict__["_shared_at"] = None if weight is None else self._buffers["embedding"].data_ptr()

    def _buffer_at(self, address) -> bool:
        """Whether a weight is kept and the buffer is real memory at ``address``."""
        buffer = self._buffers["embedding"]
        return (self.__dict__.get("_weight") is not None and type(buffer) is Tensor  # not a tracing subclass
                and not buffer.is_meta and buffer.data_ptr() == address)

    def _fits_weight(self) -> bool:
        """Whether the buffer has the kept weight's shape, dtype and device."""
        weight, buffer = self._weight, self._buffers["embedding"]
        return (buffer.shape, buffer.dtype, buffer.device) == (weight.shape, weight.dtype, weight.device)

    def _tied(self) -> bool:
        """Whether the buffer is still the kept weight's memory."""
        weight = self.__dict__.get("_weight")
        return weight is not None and self._buffer_at(weight.data_ptr()) and self._fits_weight()

    def __setattr__(self, name, value):
        if name == "embedding":  # given another weight: the head's from now on
            self._check_new_embedding(value)
            # Kept as the constructor keeps it, an nn.Parameter followed: assigned as given, a Parameter
            # became a parameter of the head's in place of the buffer (in its state dict, and a KeyError
            # at the next conversion).
            self._keep_embedding(value)
            return
        super().__setattr__(name, value)

    def _check_new_embedding(self, embedding) -> None:
        _check_embedding(embedding)

    def __getstate__(self):
        # copy.deepcopy and pickling copy the weight and the buffer apart: while they are one, the
        # buffer is left out and made again from the (copied) weight.
        state = super().__getstate__()
        if self._tied():
            state["_buffers"] = {**state["_buffers"], "embedding": None}
        else:
            state.update(_weight=None, _shared_at=None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self._buffers.get("embedding") is None and self.__dict__.get("_weight") is not None:
            self._share_weight()

    def _apply(self, fn, recurse=True):
        # A module's conversion (model.half(), .to()) converts its weight and the head's buffer
        # apart; where the weight is converted first (in a child registered before the head; a
        # module's own parameters are converted after all its children) the buffer is
        # pointed at it again. Otherwise, and where torch replaces a module's parameters on
        # conversion (overwrite_module_params_on_conversion, moves to or from the meta device), the
        # buffer is the head's own from then on.
        dtype = self._buffers["embedding"].dtype
        cast_to = fn(torch.empty(0, dtype=dtype, device="cpu")).dtype
        if cast_to != dtype and cast_to.is_floating_point and cast_to.itemsize < 2:
            # Refused before the head's tensors convert: the call that followed advised a cast back, which
            # ran on the rounded weight (and a plain head's centroids flushed to zero) without a word.
            # A module converts its children in order, so the weight this head follows, in a child
            # registered before it, is 8-bit already: said, since the error alone reads as nothing done.
            weight = self.__dict__.get("_weight")
            rounded = (f" The output weight this head follows is {cast_to} already (a module converts its children "
                       "in order, so one holding the head converts a weight registered before it first), and a cast "
                       "back does not restore its values: load the weights again"
                       if weight is not None and weight.dtype == cast_to else "")
            raise TypeError(f"{type(self).__name__}.to({cast_to}) would round the output weight to 8 bits, which no "
                            "later cast restores; fp8 is for FlashHead's centroids only: build the head with "
                            f"centroid_dtype=torch.float8_e4m3fn.{rounded}")
        # Or still the weight's memory: share_memory() moves a storage in place, the weight's and so
        # the buffer's, away from the address noted.
        tied = ((self._buffer_at(self.__dict__.get("_shared_at")) or self._tied())
                and not torch.__future__.get_overwrite_module_params_on_conversion())
        was_meta = self._buffers["embedding"].is_meta
        super()._apply(fn, recurse)
        if tied and self._fits_weight():
            self._share_weight()
        else:
            self.__dict__.update(_weight=None, _shared_at=None)
        # to_empty() leaves no values in the buffer, on the meta device or off it, and nothing refills
        # it (it is in no state dict, and a weight it follows may be loaded or not), so the head
        # refuses to run until given one.
        if _empties(fn, was_meta, self._buffers["embedding"].is_meta):
            self.__dict__["_embedding_unset"] = True
        return self

    @property
    def vocab_size(self) -> int:
        return self.embedding.shape[0]

    @property
    def hidden_dim(self) -> int:
        return self.embedding.shape[1]

    def _rows(self, hidden: Tensor) -> Tensor:
        """hidden ``[..., D]`` as ``[B, D]``, after checks that name what was expected."""
        if self.__dict__.get("_embedding_unset"):
            raise ValueError("the head's embedding was emptied by to_empty(), which leaves it without values, and the "
                             "head cannot tell whether the weight it follows was loaded since (no state dict holds "
                             "the embedding): give the head the materialised weight "
                             "(head.embedding = model.lm_head.weight) or build it again")
        if not isinstance(hidden, Tensor):
            raise TypeError(f"hidden must be a torch.Tensor [..., {self.hidden_dim}], got {type(hidden).__name__}")
        ops._require_dense("hidden", hidden)
        if hidden.dim() == 0 or hidden.shape[-1] != self.hidden_dim:
            raise ValueError(f"hidden must have last dimension {self.hidden_dim} (the head's hidden_dim), got shape {tuple(hidden.shape)}")
        if hidden.dtype != self.embedding.dtype:
            raise TypeError(f"hidden must have the head's dtype {self.embedding.dtype}, got {hidden.dtype}")
        if hidden.device != self.embedding.device:
            raise ValueError(f"hidden must be on the head's device {self.embedding.device}, got {hidden.device}")
        return hidden.reshape(-1, self.hidden_dim)

    @staticmethod
    def _unflatten(per_row: Tensor, hidden: Tensor) -> Tensor:
        """``[B, N]`` per flattened row back to hidden's leading dimensions: ``[..., N]``."""
        return per_row.reshape(*hidden.shape[:-1], per_row.shape[-1])

    def forward(self, hidden: Tensor) -> Tensor:
        return self.next_token(hidden)


class _AsWeight(torch.autograd.Function):
    """The head's buffer with the kept weight's gradient: the values every call reads (also where
    the weight's memory was replaced since, ``weight.data = ...``, which torch.compile cannot see),
    the gradient passed to the weight. Exact either way: the gradient of ``h @ W.T`` with respect
    to W does not depend on W's values."""
    generate_vmap_rule = True

    @staticmethod
    def forward(buffer: Tensor, weight: Tensor) -> Tensor:
        return buffer.view_as(buffer)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, gradient: Tensor):
        return None, gradient


class DenseHead(_HeadBase):
    """The full-vocabulary head: ``logits = hidden @ embedding.T`` in the model dtype, as HF's lm_head.

    Its argmax is ``torch.argmax``'s over logits rounded to the model dtype, as in HF's greedy
    decoding: a NaN logit wins, and of two logits that round to one bfloat16 or float16 value the
    smaller id wins. FlashHead ranks by float32 logits and a NaN like -inf (docs/kernels.md),
    so with every cluster probed the two differ on rows holding a NaN, in half precision where the
    top two logits tie after rounding (about 1.5% of random bfloat16 rows at V = 4096) and, in
    float32, where they tie within the last bits of a sum taken in another order (torch's matmul's
    order can change with the number of rows). Its ``sample`` likewise always draws a row's NaN
    logit (log-probability NaN), where FlashHead's draws another candidate (log-probability NaN too).
    """

    def __init__(self, embedding: Tensor):
        super().__init__()
        _check_embedding(embedding)
        self._keep_embedding(embedding)

    def _logits_of(self, rows: Tensor) -> Tensor:
        """``rows @ embedding.T``, differentiable to a weight given as an ``nn.Parameter`` (as
        lm_head's logits are): the buffer is its detached view, over which a loss silently left
        the head's term out of the weight's gradient."""
        weight, embedding = self.__dict__.get("_weight"), self.embedding
        # Not in a torch.jit trace, which cannot save a Python Function: the traced weight gets no gradient.
        if (weight is not None and weight.requires_grad and torch.is_grad_enabled() and self._fits_weight()
                and not torch.jit.is_tracing()):
            embedding = _AsWeight.apply(embedding, weight)
        return rows @ embedding.t()

    # Token ids have no gradient: recorded, the product saved its inputs for a backward that never
    # comes, and an embedding made in inference mode was refused as one.
    @torch.no_grad()
    def next_token(self, hidden: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
        """int64 ``hidden.shape[:-1]``: each row's argmax over the whole vocabulary. ``out``, as
        FlashHead's: an int64 ``[B]`` with ``B`` the rows of ``hidden`` (its leading dimensions
        flattened), on hidden's device, is written and returned instead (no copy kernel after one
        that is contiguous)."""
        rows = self._rows(hidden)
        if out is None:
            return (rows @ self.embedding.t()).argmax(dim=-1).reshape(hidden.shape[:-1])
        # out is checked before the logits are computed: for a hidden of another batch they could be
        # far too large to allocate.
        if not isinstance(out, Tensor):
            raise TypeError(f"out must be a torch.Tensor (int64 [{rows.shape[0]}]), got {type(out).__name__}")
        ops._require_dense("out", out)
        if out.dtype != torch.int64 or tuple(out.shape) != (rows.shape[0],) or out.device != rows.device:
            error = TypeError if out.dtype != torch.int64 else ValueError  # as FlashHead's ops raise them
            raise error(f"out must be int64 [{rows.shape[0]}] on {rows.device} (one token a row of hidden), "
                        f"got {out.dtype} {list(out.shape)} on {out.device}")
        if out.shape[0] > 1 and out.stride(0) == 0:  # torch.argmax would write every row's token to one element
            raise ValueError("out must not have elements that share memory (e.g. an expanded tensor), got strides "
                             f"{list(out.stride())}")
        # As FlashHead's ops refuse it: tokens written into the weight's bytes changed later calls.
        # (torch.compile cannot trace data pointers; the compiled write is the caller's.)
        if not torch.compiler.is_compiling():
            for name, tensor in (("hidden", rows), ("embedding", self.embedding)):
                if _share_bytes(out, tensor):
                    raise ValueError(f"out must not share memory with {name}")
        # An out made in inference mode is written in inference mode, where torch allows it: the
        # ops write one anywhere (docs/kernels.md, "Limits and notes"). torch.compile cannot trace
        # is_inference(), and leaves the write to the compiled graph.
        in_inference = not torch.compiler.is_compiling() and out.is_inference()
        with torch.inference_mode() if in_inference else contextlib.nullcontext():
            logits = rows @ self.embedding.t()
            if out.is_contiguous():
                return torch.argmax(logits, dim=-1, out=out)
            # torch.compile cannot trace out= into a strided tensor; eager argmax copies into one too.
            return out.copy_(logits.argmax(dim=-1))

    def sample(self, hidden: Tensor, temperature: float = 1.0, generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
        """A draw from softmax(logits / temperature) over the whole vocabulary: tokens int64 and
        their log-probabilities float32 under that distribution, both ``hidden.shape[:-1]``."""
        temperature = ops._check_temperature(temperature)
        ops._require_optional_generator(generator)
        rows = self._rows(hidden)
        ops._require_generator_for(rows.device, generator)
        scaled = self._logits_of(rows).float() / temperature
        # Gumbel-max: argmax(logits/T + G) is a draw from softmax(logits/T), with no host sync.
        # float32 whatever torch's default dtype: bfloat16 uniforms cut the noise's tail off, so tokens
        # far below the top were never drawn.
        uniform = torch.rand(scaled.shape, device=scaled.device, dtype=torch.float32,
                             **ops._generator_keyword(generator)).clamp_(min=torch.finfo(torch.float32).tiny)
        tokens = (scaled - torch.log(-torch.log(uniform))).argmax(dim=-1)
        logprobs = scaled.log_softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens.reshape(hidden.shape[:-1]), logprobs.reshape(hidden.shape[:-1])

    def candidate_logits(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Every token is a candidate: ids int32 ``[..., V]`` (0..V-1) and float32 logits ``[..., V]``."""
        rows = self._rows(hidden)
        logits = self._logits_of(rows).float()
        # A row each, as FlashHead's: an expanded arange would make a write to one row change every row.
        ids = torch.arange(self.vocab_size, device=rows.device, dtype=torch.int32).repeat(rows.shape[0], 1)
        return self._unflatten(ids, hidden), self._unflatten(logits, hidden)


def _warn_if_not_contiguous(embedding: Tensor) -> None:
    if not embedding.is_contiguous():  # the ops take contiguous rows
        warnings.warn(f"FlashHead: embedding (shape {tuple(embedding.shape)}, strides {embedding.stride()}) is not "
                      "contiguous, so every call copies it whole; pass embedding.contiguous()",
                      stacklevel=callers_stacklevel())


class FlashHead(_HeadBase):
    """Retrieval head: score C centroids, keep the best ``probes`` clusters, exact logits on their tokens.

    Args:
        embedding: the output embedding ``[V, D]``, contiguous (kept by reference, not copied;
            a non-persistent buffer, so neither in the state dict nor loaded by it). Given as the
            model's ``nn.Parameter`` (``model.lm_head.weight``), the head follows it through
            ``copy.deepcopy`` and ``torch.save`` / ``torch.load`` of a module holding both, and
            through that module's ``to()`` / ``half()`` where the weight is converted before the
            head: in a child module registered before it (an ``nn.Linear``, as ``lm_head`` is),
            since torch converts a module's own parameters after its children. Otherwise (a
            module's own ``nn.Parameter``; also where torch is set to replace parameters on
            conversion), and after ``head.to(...)`` alone, the buffer is a tensor of the head's
            own. ``load_state_dict(assign=True)`` and ``to_empty()`` give the
            model a new weight: give the head it (``head.embedding = weight``, followed as the
            constructor's when an ``nn.Parameter``; after
            ``to_empty()``, which empties the clusters too, the head refuses to run until given
            the weight and a state dict that holds its clusters) or build it again. ``attach``
            keeps the head outside the model and rebuilds it over a moved weight.
        centroids: ``[C, D]`` float cluster centroids used to rank clusters for greedy decoding
            (copied to the embedding's device, in its dtype or quantized: ``centroid_dtype``).
        cluster_tokens: ``[C, b]`` token ids of each cluster; -1 pads clusters when V is not a
            multiple of b. Copied, and checked once here (ids in range, disjoint, no empty cluster).
            A token in no cluster (nor in ``special_token_ids``) is never produced, whatever the
            probes: the tables the clustering builds list every token.
        probes: clusters kept per step, 1..C.
        special_token_ids: tokens scored at every step whatever the clusters (e.g. EOS).
        sampling_centroids: centroids for sampling mode (default: a copy of ``centroids``; the
            head keeps both sets, each as large as the greedy one). The published
            FlashHead ranks greedy with L2-normalised and samples with raw centroids: from a
            :class:`Clustering`, pass ``centroids`` and ``raw_centroids`` (as
            ``FlashHeadAssets.head`` does).
        centroid_dtype: the dtype the head keeps both centroid sets in: the embedding's (the
            default), or ``torch.float8_e4m3fn``, which halves the bytes the cluster scoring reads
            against bf16 (and cuts its time at every batch size). Each set is then quantized with a power-of-two
            scale (:func:`flashhead_ext.ops.quantize_centroids`; buffers ``centroid_scale`` and
            ``sampling_centroid_scale``), which the ops apply to the scores, and keeps this dtype
            through casts of the module. The scores carry e4m3's 3 mantissa bits, so a cluster
            near the probes' boundary may swap with its neighbour; the logits stay exact.

    The buffers are the head's own, so ``load_state_dict`` (with ``assign=True`` too: it copies)
    changes no other object; it runs the constructor's checks on what it loads (not whether the
    state was built for this embedding: it holds no record of the weights, which
    ``FlashHeadAssets`` keep, and warn of), refuses a state of other shapes whole, and warns when
    the state's tables leave out of every cluster tokens that this head's covered (a state saved by
    a head over a smaller vocabulary), since those can never be produced. The state dict holds ``centroids``,
    ``sampling_centroids``, ``cluster_tokens`` and ``extra_ids`` (the special tokens, an empty
    tensor when there are none), and with fp8 centroids ``centroid_scale`` and
    ``sampling_centroid_scale``; it loads into a head of the same centroid dtype only. fp8 centroids
    and their scale may come in separate loads (a sharded checkpoint's); the head refuses to run
    until the second has come, since it would sample from one set's scores at the other's scale. A head
    takes another's special tokens with its state, whatever their number (a CUDA graph captured
    over the head must then be captured again), but not its ``probes``, a setting the head keeps
    (set ``head.probes``). State dicts saved before ``extra_ids`` was always
    a tensor load as heads without special tokens.
    """

    # 2: extra_ids always in the state dict (before, absent without special tokens).
    _version = 2
    # Each centroid set's scale: a buffer when the set is float8_e4m3fn, else a None attribute.
    _SCALES = {"centroids": "centroid_scale", "sampling_centroids": "sampling_centroid_scale"}
    # The buffers' types, for type checkers (nn.Module's attribute lookup types them Tensor | Module).
    centroids: Tensor
    sampling_centroids: Tensor
    cluster_tokens: Tensor
    extra_ids: Tensor
    centroid_scale: Optional[Tensor]
    sampling_centroid_scale: Optional[Tensor]

    # Buffers built inside inference mode would be inference tensors: a later load_state_dict outside
    # it raised after copying the state in, so a load reported failed had been applied.
    @torch.inference_mode(False)
    def __init__(
        self,
        embedding: Tensor,
        centroids: Tensor,
        cluster_tokens: Tensor,
        probes: int,
        special_token_ids: Optional[SpecialTokenIds] = None,
        sampling_centroids: Optional[Tensor] = None,
        *,
        centroid_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        _check_embedding(embedding)
        quantized = centroid_dtype_option(centroid_dtype, embedding.dtype) == FP8_CENTROIDS
        vocab, dim = embedding.shape
        _warn_if_not_contiguous(embedding)
        self._keep_embedding(embedding)
        sampling = centroids if sampling_centroids is None else sampling_centroids
        for name, given in (("centroids", centroids), ("sampling_centroids", sampling)):
            # Quantized from float32, so the values are rounded once.
            rows = self._as_centroids(name, given, embedding, torch.float32 if quantized else embedding.dtype)
            rows, scale = ops._quantize_centroids(rows, name) if quantized else (rows, None)
            self.register_buffer(name, rows)
            if scale is None:  # a plain attribute: torch.export (non-strict) fails on None buffers
                self.__dict__[self._SCALES[name]] = None
            else:
                self.register_buffer(self._SCALES[name], scale)
        if self.sampling_centroids.shape[0] != self.centroids.shape[0]:
            raise ValueError(f"sampling_centroids must have one row per cluster like centroids ({self.centroids.shape[0]}), "
                             f"got shape {tuple(self.sampling_centroids.shape)}")
        ops.validate_cluster_table(cluster_tokens, vocab)
        if cluster_tokens.shape[0] != self.centroids.shape[0]:
            raise ValueError(f"cluster_tokens must have one row per centroid ({self.centroids.shape[0]}), got shape {tuple(cluster_tokens.shape)}")
        self.register_buffer("cluster_tokens", _own_copy(cluster_tokens, embedding.device, torch.int32))
        self.register_buffer("extra_ids", self._as_extra_ids(special_token_ids, vocab, embedding.device))
        self.probes = probes

    @staticmethod
    def _as_centroids(name: str, centroids, embedding: Tensor, dtype: torch.dtype) -> Tensor:
        if not isinstance(centroids, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [num_clusters, hidden_dim], got {type(centroids).__name__}")
        ops._require_dense(name, centroids)
        if centroids.dim() != 2 or centroids.shape[1] != embedding.shape[1] or centroids.shape[0] == 0:
            raise ValueError(f"{name} must have shape [num_clusters, {embedding.shape[1]}], got {tuple(centroids.shape)}")
        _require_float_centroids(name, centroids)
        _require_values(name, centroids)  # before the copy, which cannot read a meta tensor
        centroids = _own_copy(centroids, embedding.device, dtype)
        _check_finite(name, centroids)
        return centroids

    @staticmethod
    def _as_extra_ids(special_token_ids, vocab: int, device) -> Tensor:
        ids = special_token_list(special_token_ids, vocab)
        return torch.unique(torch.tensor(ids, dtype=torch.int64, device="cpu")).to(device, torch.int32)

    @property
    def _extra_ids(self) -> Optional[Tensor]:
        """The special tokens as the ops take them: None when there are none."""
        return self.extra_ids if self.extra_ids.numel() else None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # What is loaded passes the constructor's checks before anything is copied in.
        def incoming(name):
            return state_dict.get(prefix + name)

        # A state of other shapes is refused whole, as torch words it: torch would copy the tensors
        # that fit (a table of the same shape, the special tokens) before failing on the others.
        mismatched = [name for name in ("centroids", "sampling_centroids", "cluster_tokens", *self._SCALES.values())
                      if isinstance(incoming(name), Tensor) and self._buffers.get(name) is not None
                      and incoming(name).shape != self._buffers[name].shape]
        if mismatched:
            error_msgs.extend(f"size mismatch for {prefix}{name}: copying a param with shape {incoming(name).shape} from "
                              f"checkpoint, the shape in current model is {self._buffers[name].shape}."
                              for name in mismatched)
            return
        # Buffers made inside inference mode (a head converted or loaded with assign=True there) take no
        # copy outside it, and torch raised only after copying some of the state in. assign=True
        # replaces the buffers instead, as a new count of special tokens replaces extra_ids.
        assign = local_metadata.get("assign_to_params_buffers", False)
        frozen = [name for name, buffer in self._buffers.items()
                  if buffer is not None and buffer.is_inference() and isinstance(incoming(name), Tensor)
                  and name not in self._non_persistent_buffers_set and not assign
                  and not (name == "extra_ids" and incoming(name).shape != buffer.shape)]
        if frozen and not torch.is_inference_mode_enabled():
            error_msgs.extend(f"{prefix}{name} was made inside torch.inference_mode() (an inference tensor), so it takes "
                              "no copy outside it: load the state inside inference mode, or convert the head outside it"
                              for name in frozen)
            return

        # Saved by a version-1 head without special tokens. A dict without the metadata (rebuilt or
        # filtered, or read from safetensors) says no version: a missing extra_ids is then missing.
        if local_metadata.get("version", 2) < 2 and prefix + "extra_ids" not in state_dict:
            state_dict[prefix + "extra_ids"] = torch.empty(0, dtype=torch.int32, device="cpu")
        for name in ("centroids", "sampling_centroids"):
            if isinstance(incoming(name), Tensor):
                # A copy between the two kinds would cast fp8 values without their scale, or drop one.
                fp8 = self.centroid_dtype == FP8_CENTROIDS
                if (incoming(name).dtype == FP8_CENTROIDS) != fp8:
                    raise ValueError(f"{prefix}{name} in the state dict is {incoming(name).dtype} and this head keeps "
                                     f"{self.centroid_dtype} centroids: build the head with the state's centroid_dtype")
                if not fp8:  # cast, integer values ranked other clusters
                    _require_float_centroids(f"{prefix}{name} in the state dict", incoming(name))
                # As this head will hold them: a float16 head overflows values past 65504.
                _check_finite(f"{prefix}{name} in the state dict",
                              incoming(name).to(torch.float32 if fp8 else self.centroid_dtype))
            scale = incoming(self._SCALES[name])
            if isinstance(scale, Tensor):
                scale = scale.to(torch.float32)  # as the head keeps it: 1e-50 in float64 became 0 there
            if isinstance(scale, Tensor) and not bool((torch.isfinite(scale) & (scale > 0)).all()):
                raise ValueError(f"{prefix}{self._SCALES[name]} in the state dict must be finite and positive "
                                 f"in float32, as the head keeps it, got {incoming(self._SCALES[name]).tolist()}")
        if isinstance(incoming("cluster_tokens"), Tensor):
            ops.validate_cluster_table(incoming("cluster_tokens"), self.vocab_size)
        if isinstance(incoming("extra_ids"), Tensor):
            # A meta head's ids stay where the state's are: on meta their values would be lost.
            device = None if self.extra_ids.is_meta else self.extra_ids.device
            state_dict[prefix + "extra_ids"] = self._as_extra_ids(incoming("extra_ids"), self.vocab_size, device)
        self._warn_if_tokens_left_out(incoming("cluster_tokens"), incoming("extra_ids"), prefix)
        ids = incoming("extra_ids")
        # The count of special tokens is a setting, not a fixed shape: take the state's. The buffer is
        # kept when it fits, so what holds it (a captured graph) sees the new ids.
        if isinstance(ids, Tensor) and ids.shape != self.extra_ids.shape:
            with torch.inference_mode(False):  # as in __init__
                self.extra_ids = torch.empty_like(ids)
        # assign=True keeps the tensors given: copies, so that the buffers stay the head's own (two heads
        # loaded from one state would share them, and a later load into one would change the other).
        for name, buffer in self._buffers.items():
            # In the dtype and on the device the head keeps them (checked above): with
            # load_state_dict(assign=True) they would keep the state's, which the ops refuse.
            if buffer is not None and name not in self._non_persistent_buffers_set and isinstance(incoming(name), Tensor):
                # Detached: a state of tensors that need grad (centroids refined as Parameters) tied the
                # assigned buffers to their graph, and the head's calls built graphs from then on.
                state_dict[prefix + name] = incoming(name).detach().to(None if buffer.is_meta else buffer.device,
                                                                       buffer.dtype, copy=assign)
        awaited = dict(self.__dict__.get("_unset_buffers", {}))  # before assign=True's setattr clears names
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        # What this state filled has values again (a sharded load fills some). fp8 centroids and their
        # scale may come in different shards: a half that came when it was not awaited makes the head
        # wait for the other, as it would score one set's values at the other's scale (sampling's
        # distribution follows the scale; greedy refuses too, rather than run on a mismatched pair).
        unset = {name: why for name, why in awaited.items() if not isinstance(incoming(name), Tensor)}
        if self.centroid_dtype == FP8_CENTROIDS:
            for centroids, scale in self._SCALES.items():
                for came, other in ((centroids, scale), (scale, centroids)):
                    if isinstance(incoming(came), Tensor) and came not in awaited and not isinstance(incoming(other), Tensor):
                        unset.setdefault(other, f"{came} came in a state dict without it")
        self.__dict__["_unset_buffers"] = unset

    def _warn_if_tokens_left_out(self, table: Optional[Tensor], extra_ids: Optional[Tensor], prefix: str) -> None:
        """A UserWarning when a state's clusters and special tokens leave out tokens this head's cover:
        those can never be produced (a state saved by a head over a smaller vocabulary, whose table
        fits this head's shape where the vocabularies differ by less than a cluster)."""
        if (not isinstance(table, Tensor) or self.cluster_tokens.is_meta or self.extra_ids.is_meta
                or {"cluster_tokens", "extra_ids"} & self.__dict__.get("_unset_buffers", {}).keys()):
            return

        def covered(table: Tensor, extra_ids: Tensor) -> Tensor:
            tokens = torch.cat([table.flatten(), extra_ids.flatten()]).to("cpu", torch.int64)
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device="cpu")
            mask[tokens[tokens >= 0]] = True
            return mask

        loaded_extra = extra_ids if isinstance(extra_ids, Tensor) else self.extra_ids
        left_out = (covered(self.cluster_tokens, self.extra_ids) & ~covered(table, loaded_extra)).nonzero().flatten()
        if left_out.numel():
            shown = ", ".join(str(t) for t in left_out[:8].tolist()) + (", ..." if left_out.numel() > 8 else "")
            warnings.warn(f"FlashHead: the state's {prefix}cluster_tokens and {prefix}extra_ids leave {left_out.numel()} "
                          f"of this head's {self.vocab_size} tokens in no cluster that its own tables covered ({shown}): "
                          "they can never be produced. A state saved by a head over a smaller vocabulary? Build the "
                          "clustering for this embedding", UserWarning, stacklevel=callers_stacklevel())

    def __setstate__(self, state):
        super().__setstate__(state)
        if self._buffers.get("extra_ids") is None:  # pickled when no special tokens meant None
            self._buffers["extra_ids"] = torch.empty(0, dtype=torch.int32, device=self.centroids.device)
        for scale in self._SCALES.values():  # pickled before fp8 centroids (no scales) or with None buffers
            if self._buffers.get(scale) is None:
                self._buffers.pop(scale, None)
                self.__dict__[scale] = None

    @property
    def centroid_dtype(self) -> torch.dtype:
        return self.centroids.dtype

    def _apply(self, fn, recurse=True):
        self._require_token_ids_kept(fn)
        self._require_centroids_fit(fn)
        tables_were_meta = self.cluster_tokens.is_meta
        self._apply_keeping_fp8(fn, recurse)
        # to_empty() leaves the clusters without values until a state dict or an assignment fills
        # them; the head refuses to run meanwhile (a model's own checkpoint restores only its
        # weight). An empty buffer (no special tokens) has no values to lose.
        if _empties(fn, tables_were_meta, self.cluster_tokens.is_meta):
            self.__dict__["_unset_buffers"] = {name: "emptied by to_empty(), it has no values"
                                               for name, buffer in self._buffers.items() if buffer is not None
                                               and buffer.numel() and name not in self._non_persistent_buffers_set}
        return self

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        unset = self.__dict__.get("_unset_buffers")
        if unset and isinstance(value, Tensor) and name in unset:
            self.__dict__["_unset_buffers"] = {other: why for other, why in unset.items() if other != name}

    def _require_token_ids_kept(self, fn) -> None:
        """Refuses, before the head converts, a cast of every tensor (``Module.type()``): it would turn
        the int32 token ids into floats, which round ids past their mantissa (2048 in float16), and a
        cast back to int32 would keep the rounded ids."""
        cast_to = fn(torch.empty(0, dtype=torch.int32, device="cpu")).dtype
        if cast_to != torch.int32:
            raise TypeError(f"{type(self).__name__}.type({cast_to}) would cast cluster_tokens and extra_ids, the head's "
                            f"int32 token ids, to {cast_to}: convert the head with .to(dtype) or .half(), which cast "
                            "only its float tensors. The head is unchanged")

    def _require_centroids_fit(self, fn) -> None:
        """Refuses, before the head converts, a cast (model.half()) that would turn finite float
        centroids into inf: their clusters would silently rank last, as a head built or loaded with
        them in that dtype is refused for."""
        if self.centroid_scale is not None:  # fp8 centroids keep their dtype
            return
        cast_to = fn(torch.empty(0, dtype=self.centroid_dtype, device="cpu")).dtype
        if cast_to == self.centroid_dtype or not cast_to.is_floating_point or cast_to.itemsize < 2:
            return  # 8-bit casts are refused by name in _HeadBase._apply
        unset = self.__dict__.get("_unset_buffers", {})
        for name in self._SCALES:
            centroids = self._buffers[name]
            if centroids is not None and not centroids.is_meta and name not in unset:
                # A sync, once per cast, as at build and load.
                if not torch.isfinite(centroids.to(cast_to)).all():
                    # Said, since the error alone reads as nothing done.
                    raise ValueError(f"{type(self).__name__}.to({cast_to}) would turn {name} past {cast_to}'s range "
                                     f"(±{torch.finfo(cast_to).max:g}) into inf, and their clusters would never be "
                                     "chosen: keep the head in its dtype, or build it with centroid_dtype="
                                     "torch.float8_e4m3fn, whose scale keeps them in range. The head is unchanged, "
                                     f"but in a model the modules registered before it are {cast_to} already (a "
                                     "module converts its children in order)")

    def _apply_keeping_fp8(self, fn, recurse):
        # Module casts (head.half(), model.to(dtype)) cast every float buffer. fp8 centroids and
        # their float32 scales only follow the device: the ops read them in those dtypes, and a
        # small scale would not survive a float16 round trip.
        if self.centroid_scale is None:
            return super()._apply(fn, recurse)
        kept = {name: self._buffers[name] for name in (*self._SCALES, *self._SCALES.values())}
        self._buffers.update(dict.fromkeys(kept))  # None buffers are skipped; the order stays
        try:
            super()._apply(fn, recurse)
        except BaseException:
            self._buffers.update(kept)
            raise
        for name, tensor in kept.items():
            probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
            if tensor.is_meta:  # no values to move: to_empty() gives it storage, which load_state_dict fills
                self._buffers[name] = torch.empty_like(tensor, device=probe.device)
            else:  # what keeps the dtype runs as it is (share_memory(), pin_memory()); a cast moves only
                self._buffers[name] = fn(tensor) if probe.dtype == tensor.dtype else tensor.to(probe.device)
        return self

    def _over_embedding(self, embedding: Tensor) -> "FlashHead":
        """A shallow copy of this head reading ``embedding`` (its shape, dtype and device), unchecked:
        for tracing, where the embedding is a stand-in whose values cannot be read."""
        head = object.__new__(type(self))
        head.__dict__.update(self.__dict__, _buffers={**self._buffers, "embedding": embedding}, _weight=None,
                             _shared_at=None)
        return head

    @property
    def num_clusters(self) -> int:
        return self.centroids.shape[0]

    @property
    def cluster_size(self) -> int:
        return self.cluster_tokens.shape[1]

    @property
    def probes(self) -> int:
        return self._probes

    @probes.setter
    def probes(self, value: int) -> None:
        self._probes = ops._require_probes(value, self.num_clusters)

    @property
    def num_candidates(self) -> int:
        """Tokens scored per row: probes * cluster_size, plus the special tokens."""
        return self.probes * self.cluster_size + self.extra_ids.numel()

    def _rows(self, hidden: Tensor) -> Tensor:
        # A cast of the module (head.double()) passes its buffers' dtype to every call's hidden.
        if self.embedding.dtype not in HEAD_DTYPES:
            raise TypeError(f"the head's dtype is {self.embedding.dtype}; FlashHead runs in float16, bfloat16 or float32: "
                            "cast it back (e.g. head.float())")
        unset = self.__dict__.get("_unset_buffers")
        if unset:
            missing = "; ".join(f"{name} ({why})" for name, why in sorted(unset.items()))
            raise ValueError(f"the head waits for {missing}: load a state dict that holds them "
                             "(the head's own, or the model's with the head in it) or build the head again")
        return super()._rows(hidden)

    def _check_new_embedding(self, embedding) -> None:
        super()._check_new_embedding(embedding)
        current = self._buffers["embedding"]
        if tuple(embedding.shape) != tuple(current.shape):  # the cluster tables index its rows
            raise ValueError(f"embedding must have the head's shape {list(current.shape)} (its clusters index those rows), "
                             f"got {list(embedding.shape)}")
        # Checked against the centroids, which stay as they are (the buffer may still be on meta
        # after load_state_dict(assign=True)): a weight of another dtype or device failed the next
        # call with an error about centroids, which the caller never passed. fp8 centroids take any.
        centroids = self._buffers["centroids"]
        if embedding.device != centroids.device or (centroids.dtype != FP8_CENTROIDS and embedding.dtype != centroids.dtype):
            first = (f"give the head memory and its clusters first (head.to_empty(device='{embedding.device}'), then "
                     "head.load_state_dict(...) with its centroids and cluster table)" if centroids.is_meta else
                     f"convert the head first (head.to({embedding.dtype}) / head.to('{embedding.device}'))")
            raise TypeError(f"embedding must have the dtype and device of the head's centroids ({centroids.dtype} on "
                            f"{centroids.device}), got {embedding.dtype} on {embedding.device}: {first}, then give it "
                            "the weight")
        _warn_if_not_contiguous(embedding)

    def next_token(self, hidden: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
        """int64 ``hidden.shape[:-1]``: each row's greedy token. ``out``, an int64 ``[B]`` with ``B``
        the rows of ``hidden`` (its leading dimensions flattened), is written and returned instead."""
        rows = self._rows(hidden)
        tokens = ops.decode_greedy(rows, self.centroids, self.cluster_tokens, self.embedding, self.probes, self._extra_ids,
                                   out=out, centroid_scale=self.centroid_scale)
        return tokens if out is not None else tokens.reshape(hidden.shape[:-1])

    def sample(self, hidden: Tensor, temperature: float = 1.0, generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
        """``probes`` clusters drawn without replacement by their ``sampling_centroids`` scores, then a
        token drawn from softmax(logits / temperature) over their tokens and the special ones: tokens
        int64 and their log-probabilities float32 ``hidden.shape[:-1]``, normalised over those
        candidates, not the vocabulary (``ops.decode_sample``)."""
        rows = self._rows(hidden)
        tokens, logprobs = ops.decode_sample(
            rows, self.sampling_centroids, self.cluster_tokens, self.embedding, self.probes, temperature,
            self._extra_ids, generator=generator, centroid_scale=self.sampling_centroid_scale,
        )
        return tokens.reshape(hidden.shape[:-1]), logprobs.reshape(hidden.shape[:-1])

    def candidate_logits(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The ``probes`` best clusters' tokens, then the special ones: ids int32 ``[..., N]`` (N =
        ``num_candidates``; -1 marks a padding slot, whose logit is -inf) and their exact float32 logits."""
        rows = self._rows(hidden)
        cluster_ids, _ = ops.select_clusters(rows, self.centroids, self.probes, centroid_scale=self.centroid_scale)
        candidates = ops.gather_candidates(cluster_ids, self.cluster_tokens, self._extra_ids)
        logits = ops.candidate_logits(rows, self.embedding, candidates)
        return self._unflatten(candidates, hidden), self._unflatten(logits, hidden)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, hidden_dim={self.hidden_dim}, num_clusters={self.num_clusters}, "
                f"cluster_size={self.cluster_size}, probes={self.probes}, "
                f"special_tokens={self.extra_ids.numel()}, centroid_dtype={self.centroid_dtype}")
