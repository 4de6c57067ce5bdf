"""Draft models and draft heads: the early-exit draft of a target, and dense / FlashHead heads."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from .. import ops
from ..assets import default_probes, flash_head_for
from ..clustering import check_kmeans_settings
from ..head import DenseHead, FlashHead, SpecialTokenIds, centroid_dtype_option, special_token_list
from ..hf import check_plain_output_head, output_embedding, unwrapped

if TYPE_CHECKING:  # transformers is imported only when used
    from transformers import PreTrainedModel

HEADS = ("dense", "flashhead")


def keeps_recurrent_state(model) -> bool:
    """Whether ``model`` keeps a recurrent state (Mamba, Jamba, Qwen3-Next...), which a cut of its
    cache back to the accepted tokens cannot undo: transformers' ``_is_stateful`` flag before 5.25;
    from 5.25, which dropped it, a layer of its cache that holds such a state."""
    if getattr(model, "_is_stateful", False):
        return True
    config = getattr(model, "config", None)
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin
    except ImportError:  # before 5.25: the flag above says it all
        return False
    if config is None:
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=config).layers)


def early_exit_draft(target: nn.Module, num_layers: int) -> PreTrainedModel:
    """A draft made of ``target``'s first ``num_layers`` decoder layers, its final norm and its head.

    Every module is the target's own (shared, not copied): only a model shell of the target's class
    with ``num_hidden_layers = num_layers`` is built, on the meta device, and its submodules are
    replaced by the target's. The output head, a plain ``nn.Linear``, is the one module of the
    draft's own, over the target's weight (no copy): ``attach(draft)`` then changes the draft's head
    only; with the target's module it changed the target's too, which ``attach`` could not see.
    Works for decoders whose body holds its layers in ``layers`` (Llama, Qwen, Mistral, Gemma and
    most transformers decoders).
    """
    if not ops._is_int(num_layers):
        raise TypeError(f"num_layers must be an int, got {ops._type_name(num_layers)}")
    # The draft shares the modules, not a compiled or PEFT wrapper (whose LoRA layers sit in them).
    target = unwrapped(target)
    body = getattr(target, "base_model", None)
    layers = getattr(body, "layers", None)
    if body is None or body is target or not isinstance(layers, nn.ModuleList):
        raise TypeError(f"target must be a transformers causal LM whose body keeps its decoder layers in .layers, got {type(target).__name__}")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in 1..{len(layers)} (the target's decoder layers), got {num_layers}")
    if keeps_recurrent_state(target):  # else transformers' error on its config (a read-only layer_types)
        raise ValueError(f"target {type(target).__name__} keeps a recurrent state, which speculative decoding cannot cut "
                         "back to the accepted tokens, so no draft serves it: decode it without one (mode='baseline')")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(target)(config)
    for name, child in body.named_children():
        setattr(draft.base_model, name, nn.ModuleList(layers[:num_layers]) if name == "layers" else child)
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    for name, child in target.named_children():
        if child is not body:
            setattr(draft, name, _own_linear(child) if child is head else child)
    leftover = [name for name, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if leftover:
        raise TypeError(f"target {type(target).__name__} keeps state outside its body's submodules, so the early-exit draft "
                        f"cannot share it: {leftover[:4]}")
    # In eval mode, but the modules it shares keep the target's mode: draft.eval() put the shared
    # modules of a target in training mode in eval mode.
    shared = {id(module) for module in target.modules()}
    for module in draft.modules():
        if id(module) not in shared:
            module.training = False
    return draft


def _own_linear(module: nn.Module) -> nn.Module:
    """A new ``nn.Linear`` over ``module``'s parameters where ``module`` is a plain one, else
    ``module``: a head that hooks (accelerate's offloading) manage stays the target's."""
    if type(module) is not nn.Linear or hasattr(module, "_hf_hook"):
        return module
    with torch.device("meta"):
        own = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    own.weight, own.bias = module.weight, module.bias
    return own


def make_draft_head(kind: str, draft, *, probes: Optional[int] = None, clustering=None, cluster_size: int = 16,
                    kmeans_iters: int = 15, seed: int = 0, special_token_ids: Optional[SpecialTokenIds] = (),
                    progress: bool = False, centroid_dtype: Optional[torch.dtype] = None) -> Union[DenseHead, FlashHead]:
    """The draft's head over its output embedding (shared, not copied; a float64 one is copied to
    float32, since the heads compute in float16 / bfloat16 / float32 and the drivers cast hidden
    states to the head's dtype).

    ``draft`` is a transformers causal LM or its output embedding ``[V, D]`` itself (the fast path's
    :class:`~flashhead_ext.fast.Decoder` keeps it as ``lm_head``). ``kind`` is ``"dense"`` or ``"flashhead"``. For FlashHead, ``clustering`` (anything with
    ``.centroids`` and ``.cluster_tokens``, e.g. from :func:`flashhead_ext.clustering.build_clusters`;
    its ``.raw_centroids``, where it has them, are the head's sampling centroids, as in
    :meth:`~flashhead_ext.assets.FlashHeadAssets.head`) is used when given; otherwise one is built, or loaded from the user cache when it was built
    before (:func:`flashhead_ext.assets.flash_head_for`). ``probes`` defaults to C/16;
    ``special_token_ids`` (e.g. the EOS ids) are scored at every step; ``centroid_dtype`` is
    :class:`FlashHead`'s (float8_e4m3fn halves the centroid bytes). The FlashHead options are
    checked whatever the kind, so that one call can build either (as the ``spec`` CLI's does)
    without a bad value going unseen; a dense head uses none of them.
    """
    if kind not in HEADS:
        raise ValueError(f"kind must be one of {HEADS}, got {kind!r}")
    if isinstance(draft, torch.Tensor):
        embedding = draft.detach()
    else:
        embedding = output_embedding(draft)
        check_plain_output_head(draft, "draft")
    if embedding.dtype == torch.float64:
        embedding = embedding.float()
    # Before a clustering is built.
    if probes is not None:
        ops._require_probes(probes)
    if clustering is not None and not all(isinstance(getattr(clustering, name, None), torch.Tensor)
                                          for name in ("centroids", "cluster_tokens")):
        raise TypeError(f"clustering must have tensors .centroids [C, D] and .cluster_tokens [C, b] (e.g. build_clusters' "
                        f"Clustering), got {type(clustering).__name__}")
    ops._require_positive_int("cluster_size", cluster_size)  # its bound, the vocabulary, where a clustering is built
    check_kmeans_settings(kmeans_iters, seed, "kmeans_iters")
    special_token_list(special_token_ids, embedding.shape[0])
    centroid_dtype = centroid_dtype_option(centroid_dtype, embedding.dtype)
    if kind == "dense":
        return DenseHead(embedding)
    if clustering is None:
        return flash_head_for(embedding, cluster_size, probes, special_token_ids=special_token_ids,
                              iters=kmeans_iters, seed=seed, progress=progress, centroid_dtype=centroid_dtype)[0]
    num_clusters = clustering.cluster_tokens.shape[0]
    # Greedy ranks by .centroids (normalised, for k-means), sampling scores the raw ones, as a head
    # from flash_head_for (FlashHeadAssets.head) does.
    return FlashHead(embedding, clustering.centroids, clustering.cluster_tokens,
                     default_probes(num_clusters) if probes is None else probes, special_token_ids,
                     sampling_centroids=getattr(clustering, "raw_centroids", None), centroid_dtype=centroid_dtype)
