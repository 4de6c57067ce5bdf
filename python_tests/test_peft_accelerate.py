"""FlashHead on models that PEFT wraps and accelerate offloads: each works, or is refused by name."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
accelerate = pytest.importorskip("accelerate")

from flashhead_ext.assets import FlashHeadAssets  # noqa: E402
from flashhead_ext.clustering import build_clusters  # noqa: E402
from flashhead_ext.hf import attach, detach  # noqa: E402
from flashhead_ext.fast import Decoder  # noqa: E402
from flashhead_ext.speculative import MODES, SpeculativeDecoder, early_exit_draft  # noqa: E402
from flashhead_ext.speculative.driver import cache_keyword  # noqa: E402
from helpers import TWO_GPUS, greedy_tokens  # noqa: E402

# peft 0.21 calls an API transformers 5.2x deprecates: its warning, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

VOCAB = 203  # not a multiple of the cluster size: a padded clustering


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      max_position_embeddings=128)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def with_lora(model, seed: int, **options):
    """``model`` under a LoRA adapter whose B matrices are drawn, not zero, so it changes the tokens."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **options)
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return wrapped.eval()


def clustering(model, probes=None) -> FlashHeadAssets:
    """A clustering of the model's head in clusters of 8, probed at ``probes``: by default every
    cluster, so FlashHead's argmax is the dense head's; a few, and most logits are -inf, so FlashHead
    is told from the dense head."""
    built = build_clusters(model.lm_head.weight.detach(), 8, iters=2, progress=False)
    return FlashHeadAssets.from_clustering(built, n_probes=built.centroids.shape[0] if probes is None else probes)


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids: torch.Tensor, new_tokens: int = 12) -> list:
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_peft_draft_proposes_from_its_adapted_body():
    # PEFT's base_model wraps the whole causal LM: the driver read logits as hidden states and
    # crashed at the first proposal. The same adapted model as draft proposes the target's tokens.
    target = with_lora(tiny_llama(), seed=1)
    draft = with_lora(tiny_llama(), seed=1)
    ids = prompt(3)
    expected = greedy(target, ids)
    assert expected != greedy(tiny_llama(), ids)  # the adapter changes the tokens
    weight = draft.get_base_model().lm_head.weight.detach()
    for draft_head in ("dense", clustering(draft.get_base_model()).head(weight)):
        result = SpeculativeDecoder(target, draft, draft_head, k=3).generate(ids, mode="deferred", max_new_tokens=12)
        assert result.tokens == expected
        assert result.stats.accepted == result.stats.proposed > 0


def test_attach_to_a_peft_model_goes_to_the_model_it_wraps():
    wrapped = with_lora(tiny_llama(), seed=2)
    base = wrapped.get_base_model()
    ids = prompt(4)
    dense_logits, dense_tokens = logits(wrapped, ids), greedy(wrapped, ids)
    attachment = attach(wrapped, clustering(base))
    assert base.flash_head is attachment and wrapped.flash_head is attachment
    assert greedy(wrapped, ids) == dense_tokens
    # PEFT's generate calls the wrapped model, whose check now runs: a replaced head is named, not
    # decoded dense while the attachment said enabled.
    wrapped.resize_token_embeddings(VOCAB + 5)
    with pytest.raises(ValueError, match="the output head changed since attach"):
        greedy(wrapped, ids)
    detach(wrapped)
    assert not hasattr(base, "flash_head")


def test_attach_over_a_lora_output_head_names_peft_and_the_merge():
    # It had said the head must be an nn.Linear and that it "is Linear" (peft's class name).
    wrapped = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.0))
    with pytest.raises(ValueError, match=r"the model's output head is a Linear \(peft\.tuners\.lora\.layer\), not an "
                                         r"nn\.Linear; .*: merge its adapters into the weights first, "
                                         r"model = model\.merge_and_unload\(\)"):
        attach(wrapped, clustering(wrapped.get_base_model()))
    merged = wrapped.merge_and_unload()
    attach(merged, clustering(merged))
    assert hasattr(merged, "flash_head")


def test_detach_after_merge_and_unload_restores_the_dense_head():
    # Attached on the wrapper, the merged model decoded FlashHead with no attachment to detach.
    wrapped = with_lora(tiny_llama(), seed=5)
    ids = prompt(6)
    expected = logits(copy.deepcopy(wrapped).merge_and_unload(), ids)
    attach(wrapped, clustering(wrapped.get_base_model(), probes=2))
    merged = wrapped.merge_and_unload()
    del wrapped
    assert torch.isinf(logits(merged, ids)).any()
    detach(merged)
    assert torch.equal(logits(merged, ids), expected)


def test_detach_takes_flash_head_out_of_copies_peft_made_of_the_head():
    # modules_to_save deep-copies the attached head into PEFT's wrapper, forward and all; detach
    # left that copy decoding FlashHead (most logits -inf) with nothing attached.
    base = tiny_llama()
    ids = prompt(7)
    dense = logits(base, ids)
    attach(base, clustering(base, probes=2))
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])).eval()
    with pytest.raises(ValueError, match=r"replaced since attach by a peft\..*ModulesToSaveWrapper, .*PEFT's "
                                         r"modules_to_save .* detach\(model\) to decode it dense"):
        logits(wrapped, ids)
    detach(wrapped)
    # LoRA's B starts at zero, so the wrapped model computes the dense logits, exactly as before.
    assert torch.equal(logits(wrapped, ids), dense)
    attached_anywhere = [module for module in base.modules() if "_apply" in module.__dict__]
    assert attached_anywhere == []


def test_a_head_offloaded_after_attach_is_refused_and_detach_restores_it():
    # Loaded anew at each call, the weight made FlashHead rebuild its head at every call.
    model = tiny_llama()
    ids = prompt(8)
    dense = logits(model, ids)
    attach(model, clustering(model, probes=2))
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.lm_head.weight.is_meta
    with pytest.raises(ValueError, match=r"^the output head was offloaded after attach .*detach\(model\) before offloading"):
        logits(model, ids)
    model.flash_head.enabled = False
    assert torch.equal(logits(model, ids), dense)
    detach(model)
    assert torch.equal(logits(model, ids), dense)


def test_an_offload_under_another_hook_is_refused_and_a_hook_that_does_not_offload_is_not():
    # A hook added with append=True makes a SequentialHook, whose hooks each count, nested or not; one
    # that does not offload (a plain ModelHook: no offload attribute) leaves FlashHead running over a new weight.
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = tiny_llama()
    ids = prompt(8)
    attach(model, clustering(model, probes=2))
    add_hook_to_module(model.lm_head, ModelHook())
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # the head is built again
    flash = logits(model, ids)
    assert torch.isinf(flash).any()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))  # appended to the ModelHook
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^the output head was offloaded after attach"):
            logits(model, ids)
        # Appended to again, that SequentialHook is nested in another, which hid the offload: the head
        # was rebuilt at every call.
        add_hook_to_module(model.lm_head, ModelHook(), append=True)


def test_the_fast_decoder_names_adapters_and_offloaded_weights():
    wrapped = with_lora(tiny_llama(), seed=9)
    for model in (wrapped, wrapped.get_base_model()):
        with pytest.raises(ValueError, match=r"^model carries PEFT adapters .*model = model.merge_and_unload\(\)$"):
            Decoder.from_hf(model, max_len=32)
    # A prompt-learning wrapper has no tuner layers to merge, only virtual tokens, which the Decoder would drop.
    tuned = peft.get_peft_model(tiny_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    with pytest.raises(ValueError, match=r"^model is a PEFT prompt-learning model \(PROMPT_TUNING\), .*, or pass "
                                         r"model.get_base_model\(\) to decode without them$"):
        Decoder.from_hf(tuned, max_len=32)
    Decoder.from_hf(tuned.get_base_model(), max_len=32)  # as that message says
    merged = copy.deepcopy(wrapped).merge_and_unload()
    ids = prompt(10)
    decoder = Decoder.from_hf(merged, max_len=32)
    torch.testing.assert_close(decoder.logits(decoder.forward(ids[0])), logits(wrapped, ids)[0], rtol=1e-4, atol=1e-4)
    offloaded = tiny_llama()
    accelerate.cpu_offload(offloaded, execution_device=torch.device("cpu"))
    for device in (None, "cpu"):
        with pytest.raises(ValueError, match=r"is on the meta device, which holds no values \(weights offloaded by accelerate"):
            Decoder.from_hf(offloaded, max_len=32, device=device)


def test_a_peft_wrapped_model_gets_the_cache_keyword_of_the_model_it_wraps():
    # PEFT's forward passes **kwargs on: the installed transformers' keyword (cache=) went to a model
    # (remote code of an older transformers) whose forward takes past_key_values only.
    class Old(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    wrapped = peft.get_peft_model(Old(), peft.LoraConfig(r=2, target_modules=["proj"]))
    assert cache_keyword(wrapped) == "past_key_values"


def test_prompt_learning_models_are_refused_by_the_driver():
    # PEFT adds the virtual tokens in its own forward: a draft's body call skipped them (it proposed
    # the untuned model's tokens) and a target's cached calls would repeat or drop them.
    plain = tiny_llama()
    tuned = peft.get_peft_model(tiny_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    for role, args in (("draft", (plain, tuned)), ("target", (tuned, plain))):
        with pytest.raises(ValueError, match=f"^{role} is a PEFT prompt-learning model \\(PROMPT_TUNING\\)"):
            SpeculativeDecoder(*args)


def test_a_mixed_peft_model_is_unwrapped_too():
    # PeftMixedModel has no get_base_model: the attachment went on the wrapper, and the merged model
    # decoded FlashHead with nothing to detach.
    base = tiny_llama()
    ids = prompt(11)
    dense = logits(base, ids)
    mixed = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]), mixed=True).eval()
    assert attach(mixed, clustering(base, probes=2)) is base.flash_head
    merged = mixed.merge_and_unload()
    assert torch.isinf(logits(merged, ids)).any()
    detach(merged)
    assert torch.equal(logits(merged, ids), dense)  # LoRA's B starts at zero: the merge changed nothing


def test_detach_leaves_another_models_head_registered_under_it():
    # Only copies no model holds are taken out: B's head, also a submodule of A, keeps B's FlashHead.
    a, b = tiny_llama(0), tiny_llama(1)
    attach(a, clustering(a, probes=2))
    attach(b, clustering(b, probes=2))
    ids = prompt(12)
    flash = logits(b, ids)
    assert torch.isinf(flash).any()
    a.verifier_head = b.lm_head
    detach(a)
    assert torch.equal(logits(b, ids), flash)
    detach(b)
    assert not torch.isinf(logits(b, ids)).any()


def test_an_early_exit_reads_only_its_layers_so_later_ones_may_be_offloaded():
    model = tiny_llama()
    state = {key: value.to("meta") if key.startswith("model.layers.1.") else value
             for key, value in model.state_dict().items()}
    early = Decoder.from_state_dict(model.config, state, max_len=16, num_layers=1)
    full = Decoder.from_state_dict(model.config, model.state_dict(), max_len=16, num_layers=1)
    ids = prompt(13)[0]
    assert torch.equal(early.logits(early.forward(ids)), full.logits(full.forward(ids)))
    with pytest.raises(ValueError, match=r"^state_dict's 'model.layers.1.self_attn.q_proj.weight' is on the meta device"):
        Decoder.from_state_dict(model.config, state, max_len=16)


def test_an_early_exit_draft_of_a_peft_model_shares_its_adapted_layers():
    # It refused the PEFT wrapper (no .layers in its base_model), though the layers are the model's.
    wrapped = with_lora(tiny_llama(), seed=14)
    draft = early_exit_draft(wrapped, 1)
    assert draft.model.layers[0] is wrapped.get_base_model().model.layers[0]
    ids = prompt(14)
    result = SpeculativeDecoder(wrapped, draft, k=3).generate(ids, mode="deferred", max_new_tokens=12)
    assert result.tokens == greedy(wrapped, ids)


def offloaded(model, how: str, directory, execution_device):
    """``model`` with accelerate's hooks loading its weights at each forward: all of them (``cpu_offload``),
    its embedding and first layer from disk (a ``device_map``), or the whole model from the CPU, where its
    weights stay (``cpu_offload_with_hook``, whose hook is on the model), run on ``execution_device``."""
    if how == "cpu_offload":
        return accelerate.cpu_offload(model, execution_device=execution_device)
    if how == "cpu_offload_with_hook":
        return accelerate.cpu_offload_with_hook(model.cpu(), execution_device=execution_device)[0]
    on_device = execution_device if isinstance(execution_device, int) else str(execution_device)
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "disk", "model.layers.1": on_device,
                  "model.norm": on_device, "model.rotary_emb": on_device, "lm_head": on_device}
    return accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(directory), main_device=on_device)


def check_driver_decodes(target, draft, expected: tuple) -> None:
    """Every mode of the eager driver emits ``expected``, the target's greedy tokens."""
    decoder = SpeculativeDecoder(target, draft, k=3, eos_token_id=[])
    for mode in MODES:
        tokens = decoder.generate(prompt(12), mode=mode, max_new_tokens=len(expected)).tokens
        assert tuple(tokens) == expected, mode


@pytest.mark.parametrize("how", ["cpu_offload", "device_map", "cpu_offload_with_hook"])
@pytest.mark.parametrize("device", ["cpu", pytest.param(0, marks=pytest.mark.gpu)])  # accelerate names a GPU by index
def test_the_eager_driver_decodes_a_target_accelerate_offloads(how, device, tmp_path):
    # A large target offloaded beside a resident draft: the driver took the target's device for the
    # meta device and refused it (or, its weights kept on the CPU, fed it there); it now feeds the
    # target where accelerate runs it. float64: exact.
    on = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    target = tiny_llama().double().to(on)
    expected = greedy_tokens(target, prompt(12).to(on), 10)
    offloaded(target, how, tmp_path, device)
    between_calls = "cpu" if how == "cpu_offload_with_hook" else "meta"
    assert target.model.embed_tokens.weight.device.type == between_calls
    check_driver_decodes(target, tiny_llama(seed=1).double().to(on), expected)
    if how != "cpu_offload_with_hook":  # which leaves the model where it last ran, until its hook's offload()
        assert target.model.layers[0].mlp.up_proj.weight.is_meta  # still offloaded


def test_an_offloaded_target_is_fed_where_accelerate_runs_its_first_weight(monkeypatch):
    # Without get_input_embeddings (transformers raises NotImplementedError where it finds none) the
    # driver took the first weight, but looked for accelerate's hook on no module: refused.
    target = tiny_llama().double()
    expected = greedy_tokens(target, prompt(12), 10)
    accelerate.cpu_offload(target, execution_device="cpu")

    def no_input_embeddings():
        raise NotImplementedError("no input embedding found")

    head = target.lm_head  # which transformers finds through the input embeddings' lookup
    monkeypatch.setattr(target, "get_input_embeddings", no_input_embeddings)
    monkeypatch.setattr(target, "get_output_embeddings", lambda: head)
    check_driver_decodes(target, tiny_llama(seed=1).double(), expected)
    # accelerate keeps an execution device as given: "cuda" is the current GPU, as torch runs it there.
    for module in target.modules():
        if getattr(getattr(module, "_hf_hook", None), "execution_device", None) is not None:
            module._hf_hook.execution_device = "cuda"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert SpeculativeDecoder(target).device == torch.device("cuda", 1)


def test_the_driver_takes_the_device_accelerate_runs_the_target_on_not_where_its_weights_wait():
    # Only building the driver: the devices are named, never used, so GPUs are named without one.
    # cpu_offload_with_hook keeps the weights on the CPU and its one hook sits on the model it was
    # given: on a PEFT wrapper the driver looked past the wrapper, missed it and fed the CPU.
    for wrap in (lambda model: model, lambda model: with_lora(model, seed=15)):
        model = accelerate.cpu_offload_with_hook(wrap(tiny_llama()), execution_device=torch.device("cuda", 0))[0]
        assert SpeculativeDecoder(model).device == torch.device("cuda", 0)
    # The draft is not moved by the driver: one left on the CPU is named when built, not mid-generation.
    with pytest.raises(ValueError, match=r"^draft must be on the target's device cuda:0, got cpu"):
        SpeculativeDecoder(model, tiny_llama(seed=1))
    # A device_map's model-level hook names its main_device; the ids go where the embedding runs
    # (the device_map {"model.embed_tokens": 1, ...} with main_device=0, set on a CPU dispatch).
    target = accelerate.cpu_offload(tiny_llama(), execution_device="cpu")
    target._hf_hook.execution_device = torch.device("cuda", 0)
    target.model.embed_tokens._hf_hook.execution_device = torch.device("cuda", 1)
    assert SpeculativeDecoder(target).device == torch.device("cuda", 1)


@pytest.mark.gpu
@TWO_GPUS
def test_the_eager_driver_decodes_a_target_split_over_two_gpus():
    # The target's logits came on its head's GPU, the draft's proposals on the first: cat() failed.
    target = tiny_llama().double().to("cuda:0")
    expected = greedy_tokens(target, prompt(12).to("cuda:0"), 10)
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                  "model.rotary_emb": 1, "lm_head": 1}
    accelerate.dispatch_model(target, device_map=device_map)
    assert target.lm_head.weight.device == torch.device("cuda:1")
    check_driver_decodes(target, tiny_llama(seed=1).double().to("cuda:0"), expected)


def test_a_lora_on_a_learned_position_table_still_bounds_the_generation():
    # PEFT wraps GPT-2's wpe: the module named wpe is no embedding, and the one that is, base_layer,
    # named no table, so a generation past it failed with an IndexError mid-run again.
    torch.manual_seed(0)
    target = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4,
                                                                  n_positions=32)).eval()
    tuned = peft.get_peft_model(target, peft.LoraConfig(r=2, target_modules=["wpe", "c_attn"])).eval()
    ids = torch.randint(0, 101, (10,), generator=torch.Generator().manual_seed(1))
    decoder = SpeculativeDecoder(tuned, copy.deepcopy(tuned), k=4, eos_token_id=[])
    with pytest.raises(ValueError, match=r"^the target's learned position table takes 32 positions"):
        decoder.generate(ids, mode="deferred", max_new_tokens=22)
    assert len(decoder.generate(ids, mode="deferred", max_new_tokens=20).tokens) == 20
