// The one schema block of the flashhead op namespace. Implementations register per backend:
// csrc/cpu/ (CPU references) and csrc/ops/ (CUDA). Fake kernels live in flashhead_ext/ops.py.
//
// Conventions (docs/kernels.md): ids are int32; -1 in a candidate list marks a masked slot
// (padding, a duplicated extra token, an out-of-range id) whose logit is -inf; scores and logits
// are float32; ranking puts NaN where -inf would be and breaks ties towards the smaller id.
// Centroids are of hidden's dtype or float8_e4m3fn; the ops that score them take an optional
// centroid_scale (float32, one element on their device) that multiplies every centroid score.
#include <Python.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>
#ifdef FLASHHEAD_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
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
  // The trailing options serve Qwen2 (qkv_bias), Gemma-3 (post-norms, GELU, sliding windows, the
  // embedding scale as input_scale) and Gemma-2 (those and attn_softcap).
  m.def(
      "decoder_step(Tensor x, Tensor qkv_weight, Tensor o_weight, Tensor gate_up_weight, Tensor down_weight,"
      " Tensor attn_norm, Tensor mlp_norm, Tensor? q_norm, Tensor? k_norm, Tensor(a!) k_cache, Tensor(b!) v_cache,"
      " Tensor cos, Tensor sin, Tensor length, int num_heads, float eps, float scale, Tensor? qkv_bias=None,"
      " Tensor? post_attn_norm=None, Tensor? post_mlp_norm=None, str activation=\"silu\", int sliding_window=0,"
      " int[] sliding_layers=[], Tensor? sliding_cos=None, Tensor? sliding_sin=None, float input_scale=1.0,"
      " float attn_softcap=0.0) -> Tensor");

  // What a backward through an op's float result calls: it raises "derivative for flashhead::<op> is
  // not implemented" when a gradient other than zeros reaches it, and gives zeros like `like` (the
  // input's gradient) for zeros. Its fake kernel (flashhead_ext/ops.py) returns a tensor like `like`,
  // so that torch.compile can trace the backward of a forward on inputs that require grad; `grad`,
  // the result's incoming gradient, keeps the compiler from moving it into the forward.
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

// Whether a CUDA graph is being captured on grad's stream: its values cannot be looked at then.
bool capturing(const at::Tensor& grad) {
#ifdef FLASHHEAD_WITH_CUDA
  return grad.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

at::Tensor no_derivative(c10::string_view op, const at::Tensor& grad, const at::Tensor& like) {
  // A compiled backward passes zeros for a result the loss does not use (eager autograd never
  // reaches this node then), and zeros times any derivative are zeros: give them. Looking costs a
  // host sync, on a path that otherwise raises.
  const bool under_capture = grad.defined() && capturing(grad);
  if (grad.defined() && !under_capture && !grad.ne(0).any().item<bool>())
    return at::zeros_like(like, at::MemoryFormat::Contiguous);
  // Users meet this training a model with FlashHead attached: name the way out.
  TORCH_CHECK(false, "derivative for flashhead::", op,
              " is not implemented: the flashhead ops are for inference (run them under torch.no_grad()); "
              "to train a model FlashHead is attached to, call flashhead_ext.detach(model) first",
              under_capture ? " (inside a CUDA graph capture, where a gradient's values cannot be read, a backward "
                              "through the op raises even for a gradient of zeros)"
                            : "");
}

// torch holds autograd nodes by std::shared_ptr (2.6-2.11 here) or by c10::intrusive_ptr (2.13-2.14).
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename NodeType, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<NodeType>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<NodeType>(std::forward<Args>(args)...);
}

// The grad_fn of an op's float results where an input requires grad. Its backward calls
// no_derivative for each such input and each result's gradient, with a stride-0 tensor of that
// input's shape: a backward that runs raises where a gradient other than zeros reaches it, and one
// that is only traced (AOTAutograd under torch.compile) traces, so a compiled forward runs as an
// eager one does. It keeps no input alive.
struct NoDerivative : public torch::autograd::Node {
  explicit NoDerivative(std::string op_name) : op(std::move(op_name)) {}
  std::string name() const override { return "NoDerivative(flashhead::" + op + ")"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    static const auto raise = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("flashhead::no_derivative", "")
                                  .typed<at::Tensor(c10::string_view, const at::Tensor&, const at::Tensor&)>();
    // Every result's gradient is looked at: one of zeros must not stand for another's.
    torch::autograd::variable_list input_grads;
    for (const auto& [sizes, options] : inputs) {
      const at::Tensor like = at::zeros({}, options).expand_symint(sizes);
      at::Tensor input_grad;
      // Summed (zeros when none raises), so that a traced backward keeps every call.
      for (const at::Tensor& grad : grads) {
        if (!grad.defined()) continue;
        const at::Tensor zeros = raise.call(op, grad, like);
        input_grad = input_grad.defined() ? input_grad.add(zeros) : zeros;
      }
      input_grads.push_back(input_grad.defined() ? input_grad : raise.call(op, at::Tensor(), like));
    }
    return input_grads;
  }
  // Compiled autograd asks each node for these first (const in newer torch): raise the same error.
  void compiled_args(torch::autograd::CompiledNodeArgs&) const { no_derivative(op, {}, {}); }
  void compiled_args(torch::autograd::CompiledNodeArgs&) { no_derivative(op, {}, {}); }

  std::string op;
  std::vector<std::pair<std::vector<c10::SymInt>, at::TensorOptions>> inputs;  // those that require grad
};

// The op's name without its namespace, as the ops' own messages write it after "flashhead.".
std::string short_name(const c10::FunctionSchema& schema) {
  return schema.name().substr(std::string("flashhead::").size());
}

// A NoDerivative node of op over `inputs` (its edges to their present history).
NodePtr no_derivative_node(const c10::FunctionSchema& schema, const std::vector<at::Tensor>& inputs) {
  NodePtr node = make_node<NoDerivative>(short_name(schema));
  for (const at::Tensor& input : inputs)
    static_cast<NoDerivative&>(*node).inputs.emplace_back(input.sym_sizes().vec(), input.options());
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  return node;
}

// The ops are for inference and have no derivatives. Without an autograd kernel torch's default
// fallback differentiated the CPU references through their ATen calls but gave CUDA inputs no
// gradient (a warning at most); with this kernel a backward through any op raises, on every device.
// What an op writes (the caches, decode_greedy_out's out) is treated as torch's in-place ops treat
// theirs: a leaf that requires grad is refused, the version goes up (a backward that saved the old
// values raises), and a tensor that requires grad gets a history whose backward raises.
void autograd_without_derivative(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t arguments = schema.arguments().size();
  const auto argument = [&](size_t i) -> const c10::IValue& { return (*stack)[stack->size() - arguments + i]; };
  std::vector<at::Tensor> tracked;
  for (size_t i = 0; i < arguments; ++i) {
    if (!argument(i).isTensor()) continue;
    const at::Tensor& tensor = argument(i).toTensor();
    TORCH_CHECK_NOT_IMPLEMENTED(!torch::autograd::isFwGradDefined(tensor), "Trying to use forward AD with ",
                                schema.name(), " that does not support it.");
    if (tensor.requires_grad()) tracked.push_back(tensor);
  }
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < arguments; ++i)
    if (argument(i).isTensor() && schema.is_mutable({c10::SchemaArgType::input, i})) {
      try {
        torch::autograd::check_inplace(argument(i).toTensor(), !tracked.empty());
      } catch (const c10::Error& refusal) {  // torch's words name no argument
        TORCH_CHECK(false, "flashhead.", short_name(schema), ": ", schema.arguments()[i].name(),
                    " is written in place: ", refusal.what_without_backtrace());
      }
      written.push_back(argument(i).toTensor());
    }
  const bool record = !tracked.empty() && at::GradMode::is_enabled();
  const NodePtr node = record && !schema.returns().empty() ? no_derivative_node(schema, tracked) : NodePtr();
  call_below_autograd(op, keys, stack);
  for (const at::Tensor& tensor : written) {
    if (!tensor.is_inference()) torch::autograd::increment_version(tensor);
    if (!record || !tensor.requires_grad()) continue;
    // Its old values first: a view's CopySlices takes edge 0 for them.
    std::vector<at::Tensor> inputs{tensor};
    for (const at::Tensor& input : tracked)
      if (!input.is_same(tensor)) inputs.push_back(input);
    torch::autograd::rebase_history(tensor, no_derivative_node(schema, inputs));
  }
  if (!node) return;
  for (size_t i = stack->size() - schema.returns().size(); i < stack->size(); ++i)
    if ((*stack)[i].toTensor().is_floating_point()) torch::autograd::set_history((*stack)[i].toTensor(), node);
}

#ifndef FLASHHEAD_WITH_CUDA
// A CPU-only build on a machine with a GPU: torch's own error for a missing CUDA kernel says the op
// "may not exist for this backend", not why, nor what to do.
void no_cuda_kernels(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, op.schema().name(),
                              " got CUDA tensors, but this flashhead_ext build has no CUDA kernels "
                              "(flashhead_ext.cuda_kernels_built() is False: it was built with "
                              "FLASHHEAD_SKIP_CUDA_BUILD=1 or without a CUDA toolkit): run on the CPU, or reinstall "
                              "flashhead_ext with FLASHHEAD_SKIP_CUDA_BUILD unset and CUDA_HOME set to a CUDA toolkit");
}
#endif
}  // namespace

#ifndef FLASHHEAD_WITH_CUDA
TORCH_LIBRARY_IMPL(flashhead, CUDA, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernels>());
}
#endif
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
