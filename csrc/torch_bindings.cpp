// The one schema block of the flashhead op namespace. Implementations register per backend:
// csrc/cpu/ (CPU references) and csrc/ops/ (CUDA). Fake kernels live in flashhead_ext/ops.py.
//
// Conventions (docs/kernels.md): ids are int32; -1 in a candidate list marks a masked slot
// (padding, a duplicated extra token, an out-of-range id) whose logit is -inf; scores and logits
// are float32; ranking puts NaN where -inf would be and breaks ties towards the smaller id.
// Centroids are of hidden's dtype or float8_e4m3fn; the ops that score them take an optional
// centroid_scale (float32, one element on their device) that multiplies every centroid score.
#include <Python.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <string>
#include <vector>

TORCH_LIBRARY(flashhead, m) {
  m.def(
      "select_clusters(Tensor hidden, Tensor centroids, int probes, Tensor? centroid_scale=None)"
      " -> (Tensor cluster_ids, Tensor scores)");
  m.def(
      "sample_clusters(Tensor hidden, Tensor centroids, int probes, float temperature, Tensor seed,"
      " Tensor? centroid_scale=None) -> (Tensor cluster_ids, Tensor scores)");
  m.def("gather_candidates(Tensor cluster_ids, Tensor cluster_tokens, Tensor? extra_ids) -> Tensor");
  m.def("candidate_logits(Tensor hidden, Tensor embedding, Tensor candidate_ids) -> Tensor");
  m.def(
      "decode_greedy(Tensor hidden, Tensor centroids, Tensor cluster_tokens, Tensor embedding, int probes,"
      " Tensor? extra_ids, Tensor? centroid_scale=None) -> Tensor");
  m.def(
      "decode_greedy_out(Tensor hidden, Tensor centroids, Tensor cluster_tokens, Tensor embedding, int probes,"
      " Tensor? extra_ids, Tensor(a!) out, Tensor? centroid_scale=None) -> ()");
  m.def(
      "decode_sample(Tensor hidden, Tensor centroids, Tensor cluster_tokens, Tensor embedding, int probes,"
      " float temperature, Tensor seed, Tensor? extra_ids, Tensor? centroid_scale=None)"
      " -> (Tensor tokens, Tensor token_logprobs)");

  // Decoder-layer ops for the fast path's draft steps (flashhead_ext.fast): few tokens, GEMVs at
  // memory bandwidth with the norms, gating and residual adds fused in; the cache length is a
  // device tensor so a captured step replays at any length.
  // static_weight: the caller promises that the stream's previous kernel did not write weight (model
  // weights), so the CUDA kernel may start reading it before that kernel has finished.
  m.def(
      "fused_linear(Tensor x, Tensor weight, Tensor? norm_weight, float eps, bool gated, Tensor? residual,"
      " Tensor? bias=None, bool static_weight=False) -> Tensor");
  m.def(
      "rotary_cache_write(Tensor qkv, Tensor cos, Tensor sin, Tensor length, Tensor(a!) k_cache,"
      " Tensor(b!) v_cache, int num_heads, Tensor? q_norm, Tensor? k_norm, float eps) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor length, float scale) -> Tensor");
  // One token through every layer of a decoder (weights stacked per kind along a leading layer
  // dimension, caches [L, KV, max_len, hd]): the composition of the three ops above per layer,
  // one persistent kernel on CUDA. Returns the residual stream after the last layer (no final norm).
  // The trailing options serve Qwen2 (qkv_bias) and Gemma-3 (post-norms, GELU, sliding windows, the
  // embedding scale as input_scale).
  m.def(
      "decoder_step(Tensor x, Tensor qkv_weight, Tensor o_weight, Tensor gate_up_weight, Tensor down_weight,"
      " Tensor attn_norm, Tensor mlp_norm, Tensor? q_norm, Tensor? k_norm, Tensor(a!) k_cache, Tensor(b!) v_cache,"
      " Tensor cos, Tensor sin, Tensor length, int num_heads, float eps, float scale, Tensor? qkv_bias=None,"
      " Tensor? post_attn_norm=None, Tensor? post_mlp_norm=None, str activation=\"silu\", int sliding_window=0,"
      " int[] sliding_layers=[], Tensor? sliding_cos=None, Tensor? sliding_sin=None, float input_scale=1.0) -> Tensor");

  // What a backward through an op's float result calls: it raises "derivative for flashhead::<op> is
  // not implemented" when it runs. Its fake kernel (flashhead_ext/ops.py) returns a tensor like
  // `like` (the input's gradient), so that torch.compile can trace the backward of a forward on
  // inputs that require grad; `grad`, the result's incoming gradient, keeps the compiler from
  // moving it into the forward.
  m.def("no_derivative(str op, Tensor grad, Tensor like) -> Tensor");
}

namespace {
constexpr const char* kOps[] = {"select_clusters",  "sample_clusters", "gather_candidates", "candidate_logits",
                                "decode_greedy",    "decode_greedy_out", "decode_sample",   "fused_linear",
                                "rotary_cache_write", "decode_attention", "decoder_step"};

// The ops run with autocast off. Autocast's default for a custom op (fall through) casts none of its
// inputs, but leaves autocast on for the ATen calls inside it: the CPU references' float32 matmuls
// and softmaxes then ran in bfloat16 under torch.autocast("cpu"), with bfloat16 scores and logits
// and a selection other than the reference's.
void without_autocast(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // AutocastCPU is the lowest autocast key (torch 2.6-2.14): the keys after it are past autocast.
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::AutocastCPU), stack);
}

// The op's kernels; the ATen calls inside them (the CPU references') skip autograd too.
void call_below_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

at::Tensor no_derivative(c10::string_view op, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "derivative for flashhead::", op, " is not implemented");
}

// An op run on inputs that require grad: its float results get this node, whose backward calls
// no_derivative. A backward that runs raises; one that is only traced (AOTAutograd under
// torch.compile) traces, so a compiled forward runs as an eager one does.
struct WithoutDerivative : public torch::autograd::Function<WithoutDerivative> {
  // `inputs` are the op's tensor arguments, for autograd to record; `stack` holds all its arguments.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                const c10::OperatorHandle* op, c10::DispatchKeySet keys,
                                                torch::jit::Stack* stack) {
    call_below_autograd(*op, keys, stack);
    const size_t returns = op->schema().returns().size();
    torch::autograd::variable_list outputs, not_differentiable;
    for (const c10::IValue& value : torch::jit::last(*stack, returns)) {
      outputs.push_back(value.toTensor());
      if (!outputs.back().is_floating_point()) not_differentiable.push_back(outputs.back());
    }
    torch::jit::drop(*stack, returns);
    ctx->mark_non_differentiable(not_differentiable);
    std::vector<int64_t> tracked;
    torch::autograd::variable_list tracked_inputs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].requires_grad()) continue;
      tracked.push_back(static_cast<int64_t>(i));
      tracked_inputs.push_back(inputs[i]);
    }
    ctx->saved_data["op"] = op->schema().name().substr(std::string("flashhead::").size());
    ctx->saved_data["tracked"] = tracked;
    ctx->saved_data["arguments"] = static_cast<int64_t>(inputs.size()) + 3;  // the tensors, op, keys, stack
    ctx->save_for_backward(tracked_inputs);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor grad;
    for (const at::Tensor& g : grads)
      if (g.defined() && g.is_floating_point()) grad = g;
    static const auto raise = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("flashhead::no_derivative", "")
                                  .typed<at::Tensor(c10::string_view, const at::Tensor&, const at::Tensor&)>();
    const std::string op = ctx->saved_data["op"].toStringRef();
    const std::vector<int64_t> tracked = ctx->saved_data["tracked"].toIntVector();
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    torch::autograd::variable_list input_grads(ctx->saved_data["arguments"].toInt());
    for (size_t i = 0; i < tracked.size(); ++i) input_grads[tracked[i]] = raise.call(op, grad, saved[i]);
    return input_grads;
  }
};

// The ops are for inference and have no derivatives. Without an autograd kernel torch's default
// fallback differentiated the CPU references through their ATen calls but gave CUDA inputs no
// gradient (a warning at most); with this kernel a backward through any op raises, on every device.
void autograd_without_derivative(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const size_t arguments = op.schema().arguments().size();
  std::vector<at::Tensor> inputs;
  bool requires_grad = false;
  for (const c10::IValue& value : torch::jit::last(*stack, arguments)) {
    if (!value.isTensor()) continue;
    const at::Tensor& tensor = value.toTensor();
    TORCH_CHECK_NOT_IMPLEMENTED(!torch::autograd::isFwGradDefined(tensor), "Trying to use forward AD with ",
                                op.schema().name(), " that does not support it");
    requires_grad |= tensor.requires_grad();
    inputs.push_back(tensor);
  }
  if (!requires_grad || !at::GradMode::is_enabled() || op.schema().returns().empty()) {
    call_below_autograd(op, keys, stack);
    return;
  }
  const torch::autograd::variable_list outputs = WithoutDerivative::apply(at::TensorList(inputs), &op, keys, stack);
  for (const at::Tensor& output : outputs) stack->emplace_back(output);
}
}  // namespace

TORCH_LIBRARY_IMPL(flashhead, CompositeExplicitAutograd, m) { m.impl("no_derivative", &no_derivative); }
TORCH_LIBRARY_IMPL(flashhead, Autograd, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&autograd_without_derivative>());
}
TORCH_LIBRARY_IMPL(flashhead, AutocastCPU, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&without_autocast>());
}
TORCH_LIBRARY_IMPL(flashhead, AutocastCUDA, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&without_autocast>());
}

// `import flashhead_ext._C` loads this library, which runs the registrations above; the module
// itself is empty (no pybind11, so no ABI tie to a Python minor version beyond the build's).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
