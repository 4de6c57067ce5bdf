"""The library under a default device the caller set (``torch.set_default_device("cuda")``, or
``with torch.device(...)``), as many inference scripts do: what it makes on the CPU stays there.

On the CPU the "meta" device stands in for CUDA where a factory call without ``device=`` is the
whole story; the GPU test runs the public entry points under a CUDA default."""
import warnings

import pytest
import torch

from flashhead_ext import FlashHead, attach, build_clusters, calibrate_clusters, flash_head_for, hf
from flashhead_ext.assets import _fingerprint_directions, embedding_fingerprint, fingerprint_change
from flashhead_ext.clustering import cluster_sizes
from flashhead_ext.fast import Decoder, DecoderConfig, FastSpeculativeDecoder
from flashhead_ext.fast.runner import _HostCopy

transformers = pytest.importorskip("transformers")

PROMPT = [5, 9, 33, 17, 2, 40]


def _decoders(device):
    config = DecoderConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16)
    target = Decoder.random(config, max_len=64, dtype=torch.float32, device=device, seed=1, std=0.1)
    draft = Decoder.random(config.first_layers(1), max_len=64, dtype=torch.float32, device=device, seed=2, std=0.1)
    return target, draft


def _tiny_llama(seed: int):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def test_host_side_tensors_stay_on_the_cpu_under_another_default_device():
    with torch.device("meta"):
        sizes = cluster_sizes(331, 16)[1]  # compared with counts made on the CPU (a cached clustering's check)
        directions = _fingerprint_directions(8)  # multiplied with rows the fingerprint moved to the CPU
        copy = _HostCopy(torch.arange(4, device="cpu"))  # pinned host memory for a CUDA source
    assert sizes.device.type == directions.device.type == copy.host.device.type == "cpu"
    copy.start()
    assert copy.wait() == [0, 1, 2, 3]


def test_flash_head_from_cpu_tensors_under_another_default_device():
    # The special tokens' ids were made on the default device: there torch.unique (or the copy to
    # the host that reads them) failed.
    gen = torch.Generator().manual_seed(3)
    embedding, centroids = torch.randn(64, 16, generator=gen), torch.randn(16, 16, generator=gen)
    table = torch.randperm(64, generator=gen).to(torch.int32).view(16, 4)
    for special in (None, [7, 1, 7], torch.tensor([2, 9])):
        expected = FlashHead(embedding, centroids, table, 3, special_token_ids=special)
        with torch.device("meta"):
            head = FlashHead(embedding, centroids, table, 3, special_token_ids=special)
        assert head.extra_ids.device.type == "cpu" and torch.equal(head.extra_ids, expected.extra_ids), special


def test_cpu_entry_points_under_another_default_device():
    # Each made a host-side tensor on the default device: under "meta" they failed (cannot copy out
    # of meta, or no kernel), and under CUDA they did host work on the GPU.
    gen = torch.Generator().manual_seed(5)
    embedding = torch.randn(97, 16, generator=gen)
    expected_clusters = build_clusters(embedding, 8, progress=False)
    expected_head = FlashHead(embedding, expected_clusters.centroids, expected_clusters.cluster_tokens, 3)
    state = FlashHead(embedding, expected_clusters.centroids.flip(0), expected_clusters.cluster_tokens.flip(0), 3,
                      special_token_ids=[4]).state_dict()
    old = FlashHead(embedding, expected_clusters.centroids, expected_clusters.cluster_tokens, 3).state_dict()
    del old["extra_ids"]  # as a version-1 head without special tokens saved it
    old._metadata[""]["version"] = 1
    old_head = FlashHead(embedding, expected_clusters.centroids, expected_clusters.cluster_tokens, 3, special_token_ids=[4])
    target, _ = _decoders("cpu")
    ids = torch.tensor(PROMPT)
    expected_hidden = target.forward(ids, start=torch.tensor(0))
    with torch.device("meta"):
        clusters = build_clusters(embedding, 8, progress=False)
        expected_head.load_state_dict(state)
        old_head.load_state_dict(old)  # its missing extra_ids stood in for on the default device
        expected_head.to("cpu")  # a conversion tries its cast on an empty tensor of the default device
        fingerprint = embedding_fingerprint(embedding)
        change = fingerprint_change(fingerprint, fingerprint)
        rebuilt, _ = _decoders("cpu")
        hidden = rebuilt.forward(ids, start=torch.tensor(0, device="cpu"))
    assert torch.equal(clusters.cluster_tokens, expected_clusters.cluster_tokens)
    assert torch.equal(expected_head.cluster_tokens, state["cluster_tokens"])
    assert old_head.extra_ids.device.type == "cpu" and old_head.extra_ids.numel() == 0
    assert change == 0.0 and fingerprint == embedding_fingerprint(embedding)
    assert torch.equal(hidden, expected_hidden)


def test_synthetic_acceptances_are_drawn_on_the_cpu_under_another_default_device():
    target, draft = _decoders("cpu")
    runner = FastSpeculativeDecoder(target, draft, "dense", k=3, synthetic_acceptance=0.5, seed=4)
    prompt = torch.tensor(PROMPT)
    expected = runner.generate(prompt, max_new_tokens=12).tokens
    with torch.device("meta"):
        assert runner.generate(prompt, max_new_tokens=12).tokens == expected


def test_from_pretrained_loads_onto_the_cpu_under_another_default_device(tmp_path):
    model = _tiny_llama(3)
    model.save_pretrained(tmp_path)
    _char_tokenizer().save_pretrained(tmp_path)
    with torch.device("meta"):  # transformers refused to load onto meta; on CUDA it loaded there
        loaded, _ = hf.from_pretrained(tmp_path, torch.float32)
    assert loaded.lm_head.weight.device.type == "cpu"
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("pad", [None, "<unk>"], ids=["one-at-a-time", "batched"])
def test_recording_under_another_default_device(pad):
    # The EOS ids, and batched prompts' padding, were made on the default device.
    model, tokenizer = _tiny_llama(3), _char_tokenizer()
    tokenizer.pad_token = pad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no pad token: one prompt at a time
        expected = hf.record_hidden_states(model, tokenizer, ["abc", "hello"], 4, progress=False, batch_size=2)
        with torch.device("meta"):
            recorded = hf.record_hidden_states(model, tokenizer, ["abc", "hello"], 4, progress=False, batch_size=2)
    assert all(torch.equal(got, want) for got, want in zip(recorded, expected))


def _char_tokenizer():
    """Lower-case letters, one id each, and no chat template: prompts are fed as plain text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, **{chr(c): c - 96 for c in range(97, 123)}}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.mark.gpu
def test_public_entry_points_under_a_cuda_default_device(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    embedding = torch.randn(331, 64, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(400, 64, generator=torch.Generator().manual_seed(1))
    expected_clusters = build_clusters(embedding, 16, iters=3, progress=False)
    expected_calibrated = calibrate_clusters(embedding, hidden, 16, iters=3, progress=False)
    expected_fingerprint = embedding_fingerprint(embedding)
    target, draft = _decoders("cuda")
    fast_prompt = torch.tensor(PROMPT, device="cuda")
    expected_tokens = FastSpeculativeDecoder(target, draft, "dense", k=3, graphs=False).generate(
        fast_prompt, max_new_tokens=8).tokens
    synthetic = FastSpeculativeDecoder(target, draft, "dense", k=3, graphs=False, synthetic_acceptance=0.5, seed=4)
    expected_synthetic = synthetic.generate(fast_prompt, max_new_tokens=8).tokens
    model = _tiny_llama(5).cuda()
    llama_prompt = torch.tensor([[3, 14, 15, 92, 65]], device="cuda")
    with torch.device("cuda"):
        for where in ("cpu", "cuda"):  # the seeds were drawn with a CPU generator on the default device
            assert torch.equal(build_clusters(embedding.to(where), 16, iters=3, progress=False).cluster_tokens.cpu(),
                               expected_clusters.cluster_tokens)
            assert embedding_fingerprint(embedding.to(where)) == expected_fingerprint  # CPU rows @ CUDA directions
        calibrated = calibrate_clusters(embedding, hidden, 16, iters=3, progress=False)
        assert torch.equal(calibrated.cluster_tokens, expected_calibrated.cluster_tokens)
        for _ in range(2):  # built, then read from the cache (whose sizes were compared across devices)
            head, _ = flash_head_for(embedding, 16, iters=3, progress=False)
            assert torch.equal(head.cluster_tokens.cpu(), expected_clusters.cluster_tokens)
        # Pinned host buffers in every build; synthetic draws from a CPU generator.
        assert FastSpeculativeDecoder(target, draft, "dense", k=3, graphs=False).generate(
            fast_prompt, max_new_tokens=8).tokens == expected_tokens
        assert synthetic.generate(fast_prompt, max_new_tokens=8).tokens == expected_synthetic
        attach(model, progress=False)  # builds its clustering through flash_head_for
        assert model(llama_prompt).logits.isfinite().any()
        model.flash_head.enabled = False  # a recording is the dense model's: an enabled attachment is refused
        _, tokens, index = hf.record_hidden_states(model, _char_tokenizer(), ["ab", "cde"], 3, progress=False)
        assert index.device == tokens.device and index.tolist() == [0, 0, 0, 1, 1, 1]

