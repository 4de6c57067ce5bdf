"""Runs every flashhead CUDA op once per dtype on small odd shapes, for compute-sanitizer.

Includes fp8 (e4m3) centroids with their scale, the masking paths (out-of-range cluster and token ids, padding, duplicated extras and extras outside the vocabulary), a
batch of 0 and sizes that are not multiples of the vector width, the fused decodes with and
without extra ids (sampling with extras flags repeated ids and sets the extras aside for the
row's last block), then compares with the CPU op.
The decoder-layer ops run every fused_linear prologue (one input chunk and several), rotary with
positions past the cache, and attention on the vector and scalar paths; decoder_step (the
persistent kernel) at the first, a middle and the last position and one past the cache, with and
without q/k norms, and Gemma-3's layer (post-norms, GELU, sliding windows with their own rotary
tables). Exit status 1 on a mismatch.
"""
import sys

import torch

import flashhead_ext  # noqa: F401
from flashhead_ext import ops


def case(dtype, batch, dim, clusters, size, probes, seed, fp8=False):
    gen = torch.Generator().manual_seed(seed)
    vocab = clusters * size - 3  # padding in the last cluster
    order = torch.randperm(clusters * size, generator=gen)
    table = torch.where(order < vocab, order, torch.full_like(order, -1)).view(clusters, size).int()
    cpu = dict(
        hidden=torch.randn(batch, dim, generator=gen).to(dtype),
        centroids=torch.randn(clusters, dim, generator=gen).to(dtype),
        embedding=torch.randn(vocab, dim, generator=gen).to(dtype),
        table=table,
        extra=torch.tensor([0, 5, 5, vocab - 1, -1, vocab], dtype=torch.int32),  # the last two write no partial
        bad_ids=torch.tensor([[0, clusters, -4]] * batch, dtype=torch.int32).view(batch, 3),
        bad_cands=torch.tensor([[1, -1, vocab, 2**30]] * batch, dtype=torch.int32).view(batch, 4),
        seed=torch.tensor(seed, dtype=torch.int64),
    )
    if fp8:
        cpu["centroids"], cpu["scale"] = ops.quantize_centroids(cpu["centroids"])
    return cpu, {k: v.cuda() for k, v in cpu.items()}


def run(t, probes):
    scale = t.get("scale")
    ids, scores = ops.select_clusters(t["hidden"], t["centroids"], probes, centroid_scale=scale)
    sids, _ = ops.sample_clusters(t["hidden"], t["centroids"], probes, 0.7, seed=t["seed"], centroid_scale=scale)
    cands = ops.gather_candidates(ids, t["table"], t["extra"])
    bad_gather = ops.gather_candidates(t["bad_ids"], t["table"], t["extra"])
    logits = ops.candidate_logits(t["hidden"], t["embedding"], cands)
    bad_logits = ops.candidate_logits(t["hidden"], t["embedding"], t["bad_cands"])
    greedy = ops.decode_greedy(t["hidden"], t["centroids"], t["table"], t["embedding"], probes, t["extra"],
                               centroid_scale=scale)
    tokens, logprobs = ops.decode_sample(t["hidden"], t["centroids"], t["table"], t["embedding"], probes, 0.7, t["extra"],
                                         seed=t["seed"], centroid_scale=scale)
    plain_greedy = ops.decode_greedy(t["hidden"], t["centroids"], t["table"], t["embedding"], probes, centroid_scale=scale)
    plain_tokens, _ = ops.decode_sample(t["hidden"], t["centroids"], t["table"], t["embedding"], probes, 0.7, seed=t["seed"],
                                        centroid_scale=scale)
    return dict(ids=ids, sids=sids, cands=cands, bad_gather=bad_gather, bad_logits=bad_logits, greedy=greedy, tokens=tokens,
                logits=logits, logprobs=logprobs, plain_greedy=plain_greedy, plain_tokens=plain_tokens)


def head_ops() -> int:
    failures = 0
    for dtype, fp8 in ((torch.float32, False), (torch.float16, False), (torch.bfloat16, False), (torch.float32, True),
                       (torch.float16, True), (torch.bfloat16, True)):
        # 9001 clusters at batch 4 and 2: the scoring's tiles of 4 and 2 with 5 and 3 centroid rows a
        # warp on a 132-SM GPU, with 16-byte vectors and (D = 77) without (with fp8 centroids and
        # 16-bit hidden rows, batch 4 with vectors takes tensor cores). Batches 5, 9 and 65 of 16-bit
        # hidden rows: the tensor-core scoring with one, two and eight n-tiles (four with fp8
        # centroids), 65 in two chunks (three with fp8), partial tiles of centroid rows, a partial
        # step of D (1008) and warps without one (64). The last two: the selection's 12- and 16-key
        # variants, with clusters whose b is no multiple of 4 (the gather's slot-by-slot path). Batches
        # 17 and 64 (its largest): the greedy decode by claimed cluster, with clusters that more rows
        # chose than one of its groups holds. Batch 1 at 150 probes: the greedy decode's clusters
        # scored while the selection runs (76 candidate blocks). Batch 1 of 13001, 9001, 4099 and
        # 9505 clusters: the selection from the scoring blocks' kept candidates (3, 3, 2 and 4
        # centroid rows a warp).
        for batch, dim, clusters, size, probes in ((3, 77, 37, 4, 5), (2, 576, 257, 16, 257), (0, 64, 37, 8, 3),
                                                   (5, 1024, 989, 16, 61), (9, 64, 17, 8, 3), (65, 1008, 37, 4, 5),
                                                   (4, 64, 9001, 3, 40), (4, 77, 9001, 3, 40),
                                                   (2, 64, 9001, 3, 40), (1, 32, 13001, 1, 7),
                                                   (17, 64, 37, 8, 29), (64, 64, 37, 4, 9), (1, 64, 1501, 8, 150),
                                                   (1, 64, 9001, 3, 200), (1, 64, 4099, 2, 100),
                                                   (1, 64, 9505, 2, 226)):
            cpu, gpu = case(dtype, batch, dim, clusters, size, probes, seed=batch * 1000 + dim, fp8=fp8)
            got, want = run(gpu, probes), run(cpu, probes)
            torch.cuda.synchronize()
            where = f"{dtype}{' fp8 centroids' if fp8 else ''} B={batch} D={dim} C={clusters} b={size} p={probes}"
            if not torch.equal(got["bad_gather"].cpu(), want["bad_gather"]):
                print(f"MISMATCH bad_gather {where}")
                failures += 1
            # Logits differ from the CPU's in summation order only; masked slots must be -inf on both.
            tol = 1e-3 if dtype == torch.float32 else 2e-2
            for key in ("logits", "bad_logits"):
                if not torch.allclose(got[key].cpu(), want[key], rtol=tol, atol=tol, equal_nan=False):
                    print(f"MISMATCH {key} {where}")
                    failures += 1
            # Greedy tokens (batches 17 and 64 take the claimed-cluster decode): another token only
            # where its logit ties the CPU's (another summation order).
            for key in ("greedy", "plain_greedy"):
                if not same_or_tied_tokens(got[key].cpu(), want[key], cpu["hidden"], cpu["embedding"]):
                    print(f"MISMATCH {key} {where}")
                    failures += 1
    return failures


def same_or_tied_tokens(got, want, hidden, embedding) -> bool:
    """Each row's token equals the CPU's, or both are in range and their float32 logits tie within
    the summation-order error (1e-4 of the sum of the products' magnitudes)."""
    got, want = got.long(), want.long()
    differ = got != want
    if not differ.any():
        return True
    rows = differ.nonzero()[:, 0]
    g, w = got[rows], want[rows]
    vocab = embedding.shape[0]
    if not (((g >= 0) & (g < vocab)) & ((w >= 0) & (w < vocab))).all():
        return False
    h, e = hidden[rows].float(), embedding.float()
    got_logit, want_logit = (h * e[g]).sum(1), (h * e[w]).sum(1)
    scale = (h * e[w]).abs().sum(1)
    return bool(((got_logit - want_logit).abs() <= 1e-4 * scale).all())


def decoder_layer_ops() -> int:
    failures = 0
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tol = 1e-3 if dtype == torch.float32 else 3e-2

        def check(name, got, want):
            nonlocal failures
            if not torch.allclose(got.cpu().float(), want.float(), rtol=tol, atol=tol, equal_nan=True):
                print(f"MISMATCH {name} {dtype}")
                failures += 1

        def rand(*shape):
            return (torch.randn(*shape, generator=gen) * 0.5).to(dtype)

        # 12003 input features: several staged chunks at 3 tokens; 77: the scalar weight path.
        for tokens, k, n in ((1, 1024, 37), (3, 12000, 19), (5, 77, 29), (9, 64, 11)):
            x, w, g, res, bias = rand(tokens, k), rand(n, k) / k ** 0.5, rand(k), rand(tokens, n), rand(n)
            gated_x = rand(tokens, 2 * k)
            for kwargs, inp in ((dict(norm_weight=g, bias=bias), x), (dict(residual=res), x),
                                (dict(gated=True, residual=res), gated_x)):
                check(f"fused_linear {tokens}x{k}->{n} {sorted(kwargs)}", ops.fused_linear(inp.cuda(), w.cuda(), **{
                    key: v.cuda() if torch.is_tensor(v) else v for key, v in kwargs.items()}), ops.fused_linear(inp, w, **kwargs))
        # 9 x 16 / 2: 72 query rows of a KV head, attention tiles of 5 rows (the last one of 2).
        for tokens, heads, kv, hd, max_len, length in ((3, 6, 2, 64, 40, 36), (2, 4, 4, 6, 6, 5), (1, 8, 1, 256, 70, 69),
                                                       (9, 16, 2, 64, 40, 20)):
            qkv = rand(tokens, (heads + 2 * kv) * hd)
            cos, sin = rand(max_len, hd), rand(max_len, hd)
            norms = dict(q_norm=rand(hd), k_norm=rand(hd))
            length_t = torch.tensor(length)
            initial = rand(kv, max_len, hd), rand(kv, max_len, hd)  # position 5 of max_len 6 + 2 tokens: one past the cache
            caches = {}
            for device in ("cuda", "cpu"):
                k_cache, v_cache = initial[0].to(device, copy=True), initial[1].to(device, copy=True)
                q = ops.rotary_cache_write(qkv.to(device), cos.to(device), sin.to(device), length_t.to(device), k_cache, v_cache,
                                           heads, **{key: v.to(device) for key, v in norms.items()})
                out = ops.decode_attention(q, k_cache, v_cache, length_t.to(device))
                caches[device] = (q, k_cache, out)
            for name, got, want in zip(("rotary q", "k_cache", "attention"), caches["cuda"], caches["cpu"]):
                check(f"{name} T={tokens} H={heads} KV={kv} hd={hd} max_len={max_len} length={length}", got, want)
    return failures


def decoder_step() -> int:
    failures = 0
    gen = torch.Generator().manual_seed(11)
    # (layers, hidden, intermediate, heads, kv_heads, head_dim, max_len, q/k norms, q/k/v biases,
    # Gemma's layer, with an input scale); sizes are whole 16-byte vectors, as the kernel needs.
    # The third has attention splits too long for a weight stage (read from the cache), and at its
    # middle length bfloat16 ones that fit (read from a copy). The first three run the kernel of the
    # smallest head class, the next five the other five classes. The Gemma layers slide in layers
    # 0 and 2 over a third of the cache; the last, Gemma-2's (its attention scores capped), has fewer
    # gate_up rows (40) than the GPU has SMs, which caps the grid.
    for layers, d, inter, heads, kv, hd, max_len, qk_norm, qkv_bias, gemma in (
            (2, 64, 136, 4, 2, 16, 600, True, False, False), (1, 96, 40, 3, 3, 32, 40, False, True, False),
            (1, 64, 40, 8, 8, 128, 2100, False, False, False), (2, 64, 40, 8, 2, 32, 300, True, True, False),
            (1, 64, 40, 8, 1, 64, 64, False, True, False), (1, 64, 40, 6, 1, 128, 64, False, True, False),
            (1, 64, 40, 4, 1, 256, 64, True, False, False), (1, 64, 40, 8, 1, 256, 64, True, False, False),
            (3, 64, 136, 4, 1, 256, 600, True, False, "gemma3"), (3, 64, 40, 4, 2, 16, 300, False, False, "gemma2")):
        for dtype in (torch.float32, torch.bfloat16):
            def rand(*shape, scale=0.5):
                return (torch.randn(*shape, generator=gen) * scale).to(dtype)

            weights = dict(qkv=rand(layers, (heads + 2 * kv) * hd, d, scale=d ** -0.5), o=rand(layers, d, heads * hd, scale=(heads * hd) ** -0.5),
                           gate_up=rand(layers, 2 * inter, d, scale=d ** -0.5), down=rand(layers, d, inter, scale=inter ** -0.5),
                           attn_norm=rand(layers, d) + 1, mlp_norm=rand(layers, d) + 1)
            if qk_norm:
                weights.update(q_norm=rand(layers, hd) + 1, k_norm=rand(layers, hd) + 1)
            if qkv_bias:
                weights.update(qkv_bias=rand(layers, (heads + 2 * kv) * hd))
            options = {}
            if gemma:
                weights.update(post_attn_norm=rand(layers, d) + 1, post_mlp_norm=rand(layers, d) + 1)
                options = dict(activation="gelu_tanh", sliding_window=max_len // 3, sliding_layers=(0, 2),
                               sliding_cos=rand(max_len, hd), sliding_sin=rand(max_len, hd), input_scale=1.75)
                if gemma == "gemma2":
                    options.update(attn_softcap=0.8)
            x, cos, sin = rand(1, d), rand(max_len, hd), rand(max_len, hd)
            caches = rand(layers, kv, max_len, hd), rand(layers, kv, max_len, hd)
            for length in (0, max_len // 2 + 1, max_len - 1, max_len):
                results = {}
                # The CUDA and CPU ops in dtype, and the CPU op in float32 on the same values.
                for run, device, as_dtype in (("cuda", "cuda", dtype), ("cpu", "cpu", dtype), ("float32", "cpu", torch.float32)):
                    def move(t):
                        return t.to(device, as_dtype, copy=True) if isinstance(t, torch.Tensor) else t

                    k_cache, v_cache = move(caches[0]), move(caches[1])
                    out = ops.decoder_step(move(x), {k: move(v) for k, v in weights.items()}, k_cache, v_cache, move(cos),
                                           move(sin), torch.tensor(length, device=device), heads, eps=0.01,
                                           **{k: move(v) for k, v in options.items()})
                    results[run] = [t.cpu().float() for t in (out, k_cache, v_cache)]
                for i, name in enumerate(("out", "k_cache", "v_cache")):
                    got, want, exact = results["cuda"][i], results["cpu"][i], results["float32"][i]
                    if dtype == torch.float32:
                        ok = torch.allclose(got, want, rtol=1e-3, atol=1e-3, equal_nan=True)
                    else:  # no further from float32 than twice the CPU op's own rounding (bfloat16 across layers)
                        finite = exact.isfinite()
                        worst = lambda t: t[finite].abs().max().item() if finite.any() else 0.0  # noqa: E731
                        ok = torch.equal(got.isfinite(), finite) and worst(got - exact) <= 2 * worst(want - exact) + 1e-2
                    if not ok:
                        print(f"MISMATCH decoder_step {name} {dtype} L={layers} D={d} gemma={gemma} length={length}")
                        failures += 1
    return failures


GROUPS = {"head": head_ops, "layer": decoder_layer_ops, "step": decoder_step}


def main(groups) -> int:
    """``groups``: names from GROUPS (all when empty)."""
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        sys.exit(f"sanitize_ops: unknown groups {unknown}; expected some of {sorted(GROUPS)}")
    failures = sum(GROUPS[name]() for name in groups or GROUPS)
    print("sanitize_ops: done,", failures, "mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
