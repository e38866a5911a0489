// The compiled host path: eager entry points registered with torch's dispatcher in C++, so that a
// warm call costs torch's own op dispatch, a record lookup, the output's allocation and one
// cuLaunchKernel, and no Python (docs/measurements.md, "Host cost", has what the Python launch
// path costs against torch's own calls).
//
// Python decides once per input signature: it builds the plan (compiles the kernel, reads the
// tuned config, sizes the grid) and hands its launch record here (set_norm_record). A call whose
// signature has no record, or whose inputs this path does not take (strides, devices, dtypes,
// empty tensors), returns an undefined tensor: Python sees None and takes its own path, which
// judges the inputs, refuses bad ones by name, and records the plan for the next call. So this
// file never decides anything Python has not decided first.
//
// The driver is reached through dlopen (libcuda.so.1), not linked: the library builds and loads
// on a machine without a GPU (CI), where no record is ever set and every call misses.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace cutlass_ops_host {
namespace {

using at::Tensor;

// ---- the driver, through dlopen --------------------------------------------------------------

struct Driver {
  decltype(&cuLaunchKernel) launch = nullptr;
  decltype(&cuLaunchKernelEx) launch_ex = nullptr;
  decltype(&cuCtxGetCurrent) ctx_get_current = nullptr;
  decltype(&cuCtxSetCurrent) ctx_set_current = nullptr;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDevicePrimaryCtxRetain) primary_ctx_retain = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;
  decltype(&cuStreamIsCapturing) stream_is_capturing = nullptr;
  std::string why_not;  // empty when every entry point was found
};

template <typename F>
void find_symbol(void* lib, const char* name, F& out, std::string& why_not) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  if (!out && why_not.empty()) why_not = std::string("libcuda.so.1 lacks ") + name;
}

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d.why_not = "libcuda.so.1 cannot be loaded";
      return d;
    }
    // The *_v2 names are the current ABI of these entry points (cuda.h maps the plain names to
    // them); cuLaunchKernel and cuLaunchKernelEx take an explicit stream, so the legacy-stream
    // variants are the right ones.
    find_symbol(lib, "cuLaunchKernel", d.launch, d.why_not);
    find_symbol(lib, "cuLaunchKernelEx", d.launch_ex, d.why_not);
    find_symbol(lib, "cuCtxGetCurrent", d.ctx_get_current, d.why_not);
    find_symbol(lib, "cuCtxSetCurrent", d.ctx_set_current, d.why_not);
    find_symbol(lib, "cuDeviceGet", d.device_get, d.why_not);
    find_symbol(lib, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain, d.why_not);
    find_symbol(lib, "cuGetErrorString", d.error_string, d.why_not);
    find_symbol(lib, "cuStreamIsCapturing", d.stream_is_capturing, d.why_not);
    return d;
  }();
  return d;
}

void check(CUresult status, const char* what) {
  if (status == CUDA_SUCCESS) return;
  const char* text = nullptr;
  driver().error_string(status, &text);
  TORCH_CHECK(false, "cutlass_ops host path: ", what, " failed: ", text ? text : "unknown error",
              " (", static_cast<int>(status), ")");
}

// The driver API needs a current context in the calling thread. torch binds the device's primary
// context lazily per thread, so the autograd engine's worker thread may have none when its first
// CUDA work is ours: bind the primary context then (as custom_kernels.launch does).
void bind_context(int device) {
  thread_local bool bound = false;
  if (bound) return;
  const Driver& d = driver();
  CUcontext current = nullptr;
  check(d.ctx_get_current(&current), "cuCtxGetCurrent");
  if (!current) {
    CUdevice dev;
    check(d.device_get(&dev, device), "cuDeviceGet");
    CUcontext primary;
    check(d.primary_ctx_retain(&primary, dev), "cuDevicePrimaryCtxRetain");
    check(d.ctx_set_current(primary), "cuCtxSetCurrent");
  }
  bound = true;
}

CUstream current_stream(const c10::Device& device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return static_cast<CUstream>(impl->getStream(device).native_handle());
}

struct Launch {
  CUfunction kernel;
  unsigned grid;
  unsigned block;
  unsigned shared_mem;
  unsigned cluster;
};

void launch(const Launch& l, void** args, CUstream stream) {
  const Driver& d = driver();
  if (l.cluster <= 1) {
    check(d.launch(l.kernel, l.grid, 1, 1, l.block, 1, 1, l.shared_mem, stream, args, nullptr),
          "cuLaunchKernel");
    return;
  }
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attr.value.clusterDim.x = l.cluster;
  attr.value.clusterDim.y = 1;
  attr.value.clusterDim.z = 1;
  CUlaunchConfig config{};
  config.gridDimX = l.grid;  // blocks, a multiple of the cluster (the driver's convention)
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = l.block;
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = l.shared_mem;
  config.hStream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  check(d.launch_ex(&config, l.kernel, args, nullptr), "cuLaunchKernelEx");
}

// ---- norm launch records ---------------------------------------------------------------------

// What the Python path keys a forward plan by (custom_kernels.norms.norm_ops._fwd_plan, with no
// config override): the norm, the hidden size, the dtypes, the 16-byte vector path, a residual,
// the device.
struct NormKey {
  int64_t kind;  // 0 RMSNorm, 1 LayerNorm
  int64_t hidden;
  int64_t x_dtype, out_dtype, w_dtype;  // c10::ScalarType values
  bool aligned, residual;
  int64_t device;
  bool operator==(const NormKey& o) const {
    return kind == o.kind && hidden == o.hidden && x_dtype == o.x_dtype &&
           out_dtype == o.out_dtype && w_dtype == o.w_dtype && aligned == o.aligned &&
           residual == o.residual && device == o.device;
  }
};

struct NormKeyHash {
  size_t operator()(const NormKey& k) const {
    uint64_t h = static_cast<uint64_t>(k.hidden);
    for (int64_t part : {k.kind, k.x_dtype, k.out_dtype, k.w_dtype, int64_t(k.aligned),
                         int64_t(k.residual), k.device})
      h = h * 1000003u ^ static_cast<uint64_t>(part);
    return static_cast<size_t>(h);
  }
};

// A forward plan (custom_kernels.norms.norm_ops._NormPlan) in launch terms.
struct NormRecord {
  CUfunction kernel;
  unsigned threads, cluster, shared_mem;
  int64_t rows_per_unit;
  bool persistent;
  int64_t max_units;
};

std::shared_mutex records_mutex;
std::unordered_map<NormKey, NormRecord, NormKeyHash> norm_records;

void set_norm_record(int64_t kind, int64_t hidden, c10::ScalarType x_dtype,
                     c10::ScalarType out_dtype, c10::ScalarType w_dtype, bool aligned,
                     bool residual, int64_t device, int64_t kernel, int64_t threads,
                     int64_t cluster, int64_t shared_mem, int64_t rows_per_unit, bool persistent,
                     int64_t max_units) {
  TORCH_CHECK(kind == 0 || kind == 1, "norm kind must be 0 (RMSNorm) or 1 (LayerNorm)");
  TORCH_CHECK(kernel != 0, "a norm record needs a kernel handle");
  TORCH_CHECK(threads > 0 && threads <= 1024 && cluster >= 1 && cluster <= 16 &&
                  shared_mem >= 0 && rows_per_unit > 0 && max_units > 0 && hidden > 0,
              "norm record out of range: threads ", threads, ", cluster ", cluster,
              ", shared memory ", shared_mem, ", rows per unit ", rows_per_unit, ", units ",
              max_units);
  NormKey key{kind, hidden, int64_t(x_dtype), int64_t(out_dtype), int64_t(w_dtype), aligned,
              residual, device};
  NormRecord record{reinterpret_cast<CUfunction>(static_cast<uintptr_t>(kernel)),
                    static_cast<unsigned>(threads), static_cast<unsigned>(cluster),
                    static_cast<unsigned>(shared_mem), rows_per_unit, persistent, max_units};
  std::unique_lock lock(records_mutex);
  norm_records[key] = record;
}

// Defined with the GEMM records below.
void clear_records();
int64_t record_count();

bool find_norm_record(const NormKey& key, NormRecord& out) {
  std::shared_lock lock(records_mutex);
  auto it = norm_records.find(key);
  if (it == norm_records.end()) return false;
  out = it->second;
  return true;
}

// ---- the norm call ---------------------------------------------------------------------------

bool is_half_float(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half ||
         t == c10::ScalarType::BFloat16;
}

bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// A parameter vector the kernels read: [hidden], contiguous, on x's device.
bool takes_vector(const Tensor& t, const Tensor& x, int64_t hidden) {
  return t.defined() && t.dim() == 1 && t.size(0) == hidden && t.stride(0) == 1 &&
         t.device() == x.device() && is_half_float(t.scalar_type()) && !t.is_sparse();
}

// The inputs this path takes, and the record for them; false sends the call to Python. Taken:
// contiguous x (and residual of x's shape, dtype), [hidden] weight (and bias) on one CUDA device,
// the output in x's dtype. The dtype rules are Python's (a record exists only for a signature
// Python judged).
bool usual_call(int64_t kind, const Tensor& x, const Tensor& weight,
                const std::optional<Tensor>& bias, const std::optional<Tensor>& residual,
                NormKey& key) {
  if (!x.is_cuda() || x.dim() == 0 || !x.is_contiguous() || x.numel() == 0 ||
      !is_half_float(x.scalar_type()))
    return false;
  const int64_t hidden = x.size(-1);
  if (!takes_vector(weight, x, hidden)) return false;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias != (kind == 1) || (has_bias && !takes_vector(*bias, x, hidden))) return false;
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res && (residual->sizes() != x.sizes() || !residual->is_contiguous() ||
                  residual->scalar_type() != x.scalar_type() || residual->device() != x.device()))
    return false;
  const int64_t vec = 16 / static_cast<int64_t>(x.element_size());
  bool aligned = hidden % vec == 0 && aligned16(x) && aligned16(weight) &&
                 (!has_bias || aligned16(*bias)) && (!has_res || aligned16(*residual));
  key = NormKey{kind, hidden, int64_t(x.scalar_type()), int64_t(x.scalar_type()),
                int64_t(weight.scalar_type()), aligned, has_res, x.device().index()};
  return true;
}

void* ptr(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

struct NormOutputs {
  Tensor y, res_out, mean, rstd;
};

// The forward kernel's launch (custom_kernels.norms.norm_ops._launch_fwd): outputs allocated
// here, every argument in the kernel's own C type.
NormOutputs norm_forward(const NormRecord& r, const Tensor& x, const Tensor& weight,
                         const std::optional<Tensor>& bias, const std::optional<Tensor>& residual,
                         double eps, bool stats) {
  const bool has_res = residual.has_value() && residual->defined();
  const bool layer = bias.has_value() && bias->defined();
  NormOutputs out;
  out.y = at::empty(x.sizes(), x.options());
  if (has_res) out.res_out = at::empty(x.sizes(), x.options());
  if (stats) {
    auto stat_sizes = x.sizes().slice(0, x.dim() - 1);
    auto opts = x.options().dtype(at::kFloat);
    out.rstd = at::empty(stat_sizes, opts);
    if (layer) out.mean = at::empty(stat_sizes, opts);
  }
  long long hidden = x.size(-1);
  long long rows = x.numel() / hidden;
  long long x_stride = hidden;
  long long res_stride = has_res ? hidden : 0;
  int hidden32 = static_cast<int>(hidden);
  float eps32 = static_cast<float>(eps);
  const void* x_ptr = x.data_ptr();
  const void* res_ptr = ptr(residual);
  const void* w_ptr = weight.data_ptr();
  const void* b_ptr = ptr(bias);
  void* y_ptr = out.y.data_ptr();
  void* res_out_ptr = has_res ? out.res_out.data_ptr() : nullptr;
  void* mean_ptr = out.mean.defined() ? out.mean.data_ptr() : nullptr;
  void* rstd_ptr = out.rstd.defined() ? out.rstd.data_ptr() : nullptr;
  void* args[] = {&x_ptr, &res_ptr,   &w_ptr,      &b_ptr,     &y_ptr,      &res_out_ptr, &mean_ptr,
                  &rstd_ptr, &rows, &hidden32, &x_stride, &res_stride, &eps32};
  int64_t units = (rows + r.rows_per_unit - 1) / r.rows_per_unit;
  if (r.persistent && units > r.max_units) units = r.max_units;
  Launch l{r.kernel, static_cast<unsigned>(units * r.cluster), r.threads, r.shared_mem,
           r.cluster};
  const c10::Device device = x.device();
  c10::OptionalDeviceGuard guard;
  if (c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice() != device)
    guard.reset_device(device);
  bind_context(device.index());
  launch(l, args, current_stream(device));
  return out;
}

// The autograd nodes are written by hand, as torch's generated ones are (a Node subclass with
// SavedVariable members, set_history on the outputs), not through torch::autograd::Function,
// whose machinery (its saved_data map, output wrapping and view checks) costs a grad-enabled call
// more host time than the launch itself (docs/measurements.md, "Host cost", has the figures).
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// A node's owning pointer: std::shared_ptr up to torch 2.12, c10::intrusive_ptr from 2.13. Both
// are built here, so that the same file builds against either torch.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>)
    return std::make_shared<T>();
  else
    return c10::make_intrusive<T>();
}

// A gradient for every input that needs one, through the Python custom ops
// (custom_kernels::rms_norm_bwd / layer_norm_bwd): the same kernels and formulas as the Python
// path's autograd. Inputs in order: x, weight, bias, residual.
struct NormBackward : public Node {
  SavedVariable h, weight, mean, rstd;  // h: the normalized input (x, or x + residual)
  bool layer = false, has_residual = false;

  std::string name() const override { return "CutlassOpsNormBackward"; }

  void release_variables() override {
    h.reset_data();
    weight.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    // h is an output when a residual was added (the new residual), an input otherwise.
    const Tensor h_ = has_residual ? h.unpack(getptr()) : h.unpack();
    const Tensor w_ = weight.unpack();
    Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(h_);
    c10::IValue d_res = has_residual && grads.size() > 1 && grads[1].defined()
                            ? c10::IValue(grads[1])
                            : c10::IValue();
    static const c10::OperatorHandle rms_bwd =
        c10::Dispatcher::singleton().findSchemaOrThrow("custom_kernels::rms_norm_bwd", "");
    static const c10::OperatorHandle ln_bwd =
        c10::Dispatcher::singleton().findSchemaOrThrow("custom_kernels::layer_norm_bwd", "");
    torch::jit::Stack stack;
    if (layer)
      stack = {dy, h_, w_, mean.unpack(), rstd.unpack(), d_res, c10::IValue()};
    else
      stack = {dy, h_, w_, rstd.unpack(), d_res, c10::IValue()};
    (layer ? ln_bwd : rms_bwd).callBoxed(&stack);
    Tensor dx = stack[0].toTensor();
    variable_list out(4);
    if (should_compute_output(0)) out[0] = dx;
    if (should_compute_output(1)) out[1] = stack[1].toTensor();
    if (layer && should_compute_output(2)) out[2] = stack[2].toTensor();
    if (has_residual && should_compute_output(3)) out[3] = dx;  // d(x + residual)/d residual = 1
    return out;
  }
};

NormOutputs norm_with_grad(const NormRecord& record, const Tensor& x, const Tensor& weight,
                           const std::optional<Tensor>& bias,
                           const std::optional<Tensor>& residual, double eps) {
  NormOutputs out = norm_forward(record, x, weight, bias, residual, eps, /*stats=*/true);
  NodePtr node = make_node<NormBackward>();
  auto* raw = static_cast<NormBackward*>(node.get());
  raw->layer = bias.has_value() && bias->defined();
  raw->has_residual = residual.has_value() && residual->defined();
  raw->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias, residual));
  torch::autograd::set_history(out.y, node);
  if (raw->has_residual) torch::autograd::set_history(out.res_out, node);
  // Saved after set_history: a saved output must already have this node as its grad_fn.
  raw->h = raw->has_residual ? SavedVariable(out.res_out, /*is_output=*/true)
                             : SavedVariable(x, /*is_output=*/false);
  raw->weight = SavedVariable(weight, false);
  if (raw->layer) raw->mean = SavedVariable(out.mean, false);
  raw->rstd = SavedVariable(out.rstd, false);
  return out;
}

bool forward_grad_defined(const Tensor& t) { return t.defined() && t._fw_grad(0).defined(); }

// (y, new residual): y undefined when this path does not take the call (Python's None).
// kind: 0 RMSNorm (bias None), 1 LayerNorm (bias given); any other pairing misses.
std::tuple<Tensor, Tensor> norm(int64_t kind, const Tensor& x, const Tensor& weight,
                                const std::optional<Tensor>& bias,
                                const std::optional<Tensor>& residual, double eps) {
  NormKey key;
  NormRecord record;
  if (!usual_call(kind, x, weight, bias, residual, key) || !find_norm_record(key, record) ||
      !driver().why_not.empty())
    return {Tensor(), Tensor()};
  const bool grad = c10::GradMode::is_enabled() &&
                    (x.requires_grad() || weight.requires_grad() ||
                     (bias.has_value() && bias->defined() && bias->requires_grad()) ||
                     (residual.has_value() && residual->defined() && residual->requires_grad()));
  if (!grad) {
    NormOutputs out = norm_forward(record, x, weight, bias, residual, eps, /*stats=*/false);
    return {out.y, out.res_out};
  }
  // Forward-mode gradients: neither path computes them; the Python path refuses them by name.
  if (forward_grad_defined(x) || forward_grad_defined(weight)) return {Tensor(), Tensor()};
  NormOutputs out = norm_with_grad(record, x, weight, bias, residual, eps);
  return {out.y, out.res_out};
}

// ---- GEMM launch records ---------------------------------------------------------------------

// A GEMM route Python prepared (cutlass_ops.gemms.dispatch's CUTLASS route of a plain product): the
// kernel library's C entry point, the launch arguments it checked (bytes, laid out as the library's
// own struct), where in them the operand and output pointers go, and the workspace it needs. This
// file does not know the struct: Python gives the offsets, as ctypes reads them from its mirror.
// A record without a kernel (run null) is dispatch's torch route of the signature: the product
// goes to at::matmul_out, as the route's torch.matmul would run it, without the Python around it.
struct GemmRecord {
  using Run = int (*)(const void* args, void* workspace, size_t workspace_bytes, void* stream);
  using LastError = const char* (*)();
  Run run = nullptr;
  LastError last_error;
  std::vector<uint8_t> args;
  int64_t off_a, off_b, off_c, off_d;
  bool swap_ab;
  int64_t workspace_bytes;
  c10::ScalarType out_dtype;
  std::vector<int64_t> out_sizes;
  // The kernel for eager calls only: the tuner found torch.matmul's kernel faster but its
  // whole eager call slower. Under stream capture the record is not taken (a graph has no host
  // cost), and dispatch's Python route runs torch.matmul there.
  bool eager_only = false;
};

struct VectorHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

std::unordered_map<std::vector<int64_t>, std::shared_ptr<const GemmRecord>, VectorHash>
    gemm_records;

// What dispatch keys a plain product's route by (its _signature): the device, the dtypes, the
// shapes and strides of both operands, and whether both pointers are 16-byte aligned.
std::vector<int64_t> gemm_key(int64_t device, c10::ScalarType a_dtype, at::IntArrayRef a_sizes,
                              at::IntArrayRef a_strides, c10::ScalarType b_dtype,
                              at::IntArrayRef b_sizes, at::IntArrayRef b_strides, bool aligned) {
  std::vector<int64_t> key{device, int64_t(a_dtype), int64_t(b_dtype), int64_t(aligned),
                           static_cast<int64_t>(a_sizes.size())};
  key.insert(key.end(), a_sizes.begin(), a_sizes.end());
  key.insert(key.end(), a_strides.begin(), a_strides.end());
  key.push_back(static_cast<int64_t>(b_sizes.size()));
  key.insert(key.end(), b_sizes.begin(), b_sizes.end());
  key.insert(key.end(), b_strides.begin(), b_strides.end());
  return key;
}

void set_gemm_record(at::IntArrayRef a_sizes, at::IntArrayRef a_strides, c10::ScalarType a_dtype,
                     at::IntArrayRef b_sizes, at::IntArrayRef b_strides, c10::ScalarType b_dtype,
                     int64_t device, bool aligned, int64_t run, int64_t last_error,
                     const Tensor& args, int64_t off_a, int64_t off_b, int64_t off_c,
                     int64_t off_d, bool swap_ab, int64_t workspace_bytes,
                     c10::ScalarType out_dtype, bool eager_only) {
  TORCH_CHECK(run != 0 && last_error != 0, "a GEMM record needs the library's entry points");
  TORCH_CHECK(a_sizes.size() >= 2 && a_sizes.size() == a_strides.size() &&
                  b_sizes.size() == b_strides.size() && b_sizes.size() >= 2,
              "GEMM record: operands of at least two dimensions, a stride per dimension");
  TORCH_CHECK(args.device().is_cpu() && args.scalar_type() == at::kByte && args.dim() == 1 &&
                  args.is_contiguous() && args.numel() > 0,
              "GEMM record: the launch arguments as a contiguous 1-D uint8 CPU tensor");
  const int64_t size = args.numel();
  for (int64_t off : {off_a, off_b, off_c, off_d})
    TORCH_CHECK(off >= 0 && off % 8 == 0 && off + 8 <= size,
                "GEMM record: a pointer offset outside the launch arguments: ", off);
  TORCH_CHECK(workspace_bytes >= 0, "GEMM record: a negative workspace");
  auto record = std::make_shared<GemmRecord>();
  record->run = reinterpret_cast<GemmRecord::Run>(static_cast<uintptr_t>(run));
  record->last_error = reinterpret_cast<GemmRecord::LastError>(static_cast<uintptr_t>(last_error));
  const auto* bytes = args.data_ptr<uint8_t>();
  record->args.assign(bytes, bytes + size);
  record->off_a = off_a;
  record->off_b = off_b;
  record->off_c = off_c;
  record->off_d = off_d;
  record->swap_ab = swap_ab;
  record->workspace_bytes = workspace_bytes;
  record->out_dtype = out_dtype;
  record->eager_only = eager_only;
  record->out_sizes.assign(a_sizes.begin(), a_sizes.end() - 1);
  record->out_sizes.push_back(b_sizes.back());
  auto key = gemm_key(device, a_dtype, a_sizes, a_strides, b_dtype, b_sizes, b_strides, aligned);
  std::unique_lock lock(records_mutex);
  gemm_records[std::move(key)] = std::move(record);
}

void set_gemm_torch_record(at::IntArrayRef a_sizes, at::IntArrayRef a_strides,
                           c10::ScalarType a_dtype, at::IntArrayRef b_sizes,
                           at::IntArrayRef b_strides, c10::ScalarType b_dtype, int64_t device,
                           bool aligned) {
  TORCH_CHECK(a_sizes.size() == 2 && b_sizes.size() == 2 && a_strides.size() == 2 &&
                  b_strides.size() == 2 && a_sizes[1] == b_sizes[0] && a_dtype == b_dtype,
              "GEMM torch record: two 2-D operands of one dtype whose inner sizes match");
  auto record = std::make_shared<GemmRecord>();
  record->out_dtype = a_dtype;
  record->out_sizes = {a_sizes[0], b_sizes[1]};
  auto key = gemm_key(device, a_dtype, a_sizes, a_strides, b_dtype, b_sizes, b_strides, aligned);
  std::unique_lock lock(records_mutex);
  gemm_records[std::move(key)] = std::move(record);
}

void put_pointer(std::vector<uint8_t>& args, int64_t offset, const void* p) {
  std::memcpy(args.data() + offset, &p, sizeof(p));
}

bool capturing(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  check(driver().stream_is_capturing(stream, &status), "cuStreamIsCapturing");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

// The record of (a, b)'s signature, or null: none, or an eager-only one while a graph is being
// captured on the current stream.
std::shared_ptr<const GemmRecord> find_gemm_record(const Tensor& a, const Tensor& b) {
  const bool aligned = reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0;
  auto key = gemm_key(a.device().index(), a.scalar_type(), a.sizes(), a.strides(),
                      b.scalar_type(), b.sizes(), b.strides(), aligned);
  std::shared_ptr<const GemmRecord> found;
  {
    std::shared_lock lock(records_mutex);
    auto it = gemm_records.find(key);
    if (it == gemm_records.end()) return nullptr;
    found = it->second;
  }
  if (found->eager_only && capturing(current_stream(a.device()))) return nullptr;
  return found;
}

// The product into a new output of the record's [M, N] shape, or of ``sizes`` (the same elements
// row-major: a Linear's leading dimensions), so that no output is a view of another tensor.
Tensor launch_gemm(const GemmRecord& r, const Tensor& a, const Tensor& b,
                   at::OptionalIntArrayRef sizes = std::nullopt) {
  Tensor out = at::empty(sizes.has_value() ? *sizes : at::IntArrayRef(r.out_sizes),
                         a.options().dtype(r.out_dtype));
  if (!r.run) {  // the torch route: computed below autograd (a node, if any, is this file's)
    at::AutoDispatchBelowAutograd below;
    // matmul_out refuses, by grad mode rather than by dispatch key, inputs that require grad
    // (seen on an H200: the Linear op's forward with gradients).
    c10::NoGradGuard no_grad;
    Tensor rows = out.view(r.out_sizes);  // out's storage, as [M, N]
    at::matmul_out(rows, a, b);
    return out;
  }
  Tensor workspace;
  if (r.workspace_bytes) workspace = at::empty({r.workspace_bytes}, a.options().dtype(at::kByte));
  std::vector<uint8_t> args = r.args;
  const Tensor& first = r.swap_ab ? b : a;  // swapped, the kernel's A is b^T
  const Tensor& second = r.swap_ab ? a : b;
  put_pointer(args, r.off_a, first.data_ptr());
  put_pointer(args, r.off_b, second.data_ptr());
  put_pointer(args, r.off_c, out.data_ptr());  // no residual: C is D (beta as checked)
  put_pointer(args, r.off_d, out.data_ptr());
  int status = r.run(args.data(), workspace.defined() ? workspace.data_ptr() : nullptr,
                     static_cast<size_t>(r.workspace_bytes), current_stream(a.device()));
  TORCH_CHECK(status == 0, "cutlass_ops: the CUTLASS kernel failed (status ", status,
              "): ", r.last_error());
  return out;
}

bool cuda_pair(const Tensor& a, const Tensor& b) {
  return a.is_cuda() && b.is_cuda() && a.device() == b.device();
}

// Plain products this op ran, on CUTLASS records and on torch records: dispatch's hot path leaves
// the counting to the op (it cannot tell the two apart without the lookup it skips), and its
// call_counts adds these to what Python counted.
std::atomic<int64_t> cutlass_products{0};
std::atomic<int64_t> torch_products{0};

std::vector<int64_t> product_calls() {
  return {cutlass_products.load(std::memory_order_relaxed),
          torch_products.load(std::memory_order_relaxed)};
}

// a @ b into a new output, or undefined (Python's None) when this path does not take the call:
// no record for the signature, or a gradient wanted (dispatch's raw product has no autograd).
Tensor gemm(const Tensor& a, const Tensor& b) {
  if (!cuda_pair(a, b) || a.dim() < 2 || b.dim() < 2) return Tensor();
  if (c10::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad())) return Tensor();
  auto record = find_gemm_record(a, b);
  if (!record) return Tensor();
  (record->run ? cutlass_products : torch_products).fetch_add(1, std::memory_order_relaxed);
  return launch_gemm(*record, a, b);
}

// ---- Linear (no bias) ------------------------------------------------------------------------

// The op that computes a backward product (cutlass_ops::mm, whose eager call is dispatch's
// matmul: the same routes as cutlass_ops.ops._EagerLinear's backward). Named by the layer that
// owns it (set_product_op), so that this file depends on no op above it.
std::mutex product_mutex;
std::optional<c10::OperatorHandle> product_op;

std::optional<c10::OperatorHandle> product() {
  std::lock_guard<std::mutex> lock(product_mutex);
  return product_op;
}

void set_product_op(c10::string_view qualname) {
  std::string name(qualname);
  auto sep = name.find("::");
  TORCH_CHECK(sep != std::string::npos, "set_product_op: a qualified name, \"ns::op\"");
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
  std::lock_guard<std::mutex> lock(product_mutex);
  product_op = op;
}

Tensor call_product(const c10::OperatorHandle& op, const Tensor& a, const Tensor& b) {
  torch::jit::Stack stack{a, b};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

std::vector<int64_t> linear_out_sizes(const Tensor& x, int64_t n) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  sizes.push_back(n);
  return sizes;
}

// dX = dY W and dW = dY^T X through the product op; inputs in order: x, weight.
struct LinearBackward : public Node {
  SavedVariable x, weight;

  std::string name() const override { return "CutlassOpsLinearBackward"; }

  void release_variables() override {
    x.reset_data();
    weight.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(2);
    if (!grads[0].defined()) return out;  // no gradient reached the output: none for the inputs
    auto op = product();
    TORCH_CHECK(op.has_value(), "cutlass_ops host path: no backward product op");
    const Tensor x_ = x.unpack();
    const Tensor rows = grads[0].reshape({-1, grads[0].size(-1)});
    if (should_compute_output(0)) out[0] = call_product(*op, rows, weight.unpack()).reshape(x_.sizes());
    if (should_compute_output(1)) out[1] = call_product(*op, rows.t(), x_.reshape({-1, x_.size(-1)}));
    return out;
  }
};

// x @ weight^T (a Linear without bias), or undefined when not taken: x must view as rows
// (contiguous), the product of its rows and weight^T must have a record, and with a gradient
// wanted the backward product op must be known.
Tensor linear(const Tensor& x, const Tensor& weight) {
  if (!cuda_pair(x, weight) || weight.dim() != 2 || x.dim() < 2 || !x.is_contiguous() ||
      x.size(-1) != weight.size(1) || x.numel() == 0)
    return Tensor();
  const Tensor rows = x.dim() == 2 ? x : x.view({-1, x.size(-1)});
  auto record = find_gemm_record(rows, weight.t());
  if (!record) return Tensor();
  const bool grad = c10::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  if (!grad) return launch_gemm(*record, rows, weight.t(), linear_out_sizes(x, weight.size(0)));
  if (!product().has_value() || forward_grad_defined(x) || forward_grad_defined(weight))
    return Tensor();
  Tensor y = launch_gemm(*record, rows, weight.t(), linear_out_sizes(x, weight.size(0)));
  NodePtr node = make_node<LinearBackward>();
  auto* raw = static_cast<LinearBackward*>(node.get());
  raw->set_next_edges(torch::autograd::collect_next_edges(x, weight));
  torch::autograd::set_history(y, node);
  raw->x = SavedVariable(x, false);
  raw->weight = SavedVariable(weight, false);
  return y;
}

void clear_records() {
  std::unique_lock lock(records_mutex);
  norm_records.clear();
  gemm_records.clear();
}

int64_t record_count() {
  std::shared_lock lock(records_mutex);
  return static_cast<int64_t>(norm_records.size() + gemm_records.size());
}

std::string driver_status() {
  return driver().why_not.empty() ? std::string("ok") : driver().why_not;
}

}  // namespace

TORCH_LIBRARY(cutlass_ops_host, m) {
  m.def("norm(int kind, Tensor x, Tensor weight, Tensor? bias, Tensor? residual, float eps)"
        " -> (Tensor, Tensor)");
  m.def("set_norm_record(int kind, int hidden, ScalarType x_dtype, ScalarType out_dtype, "
        "ScalarType w_dtype, bool aligned, bool residual, int device, int kernel, int threads, "
        "int cluster, int shared_mem, int rows_per_unit, bool persistent, int max_units) -> ()",
        &set_norm_record);
  m.def("gemm(Tensor a, Tensor b) -> Tensor");
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.def("set_product_op(str qualname) -> ()", &set_product_op);
  m.def("set_gemm_record(int[] a_sizes, int[] a_strides, ScalarType a_dtype, int[] b_sizes, "
        "int[] b_strides, ScalarType b_dtype, int device, bool aligned, int run, int last_error, "
        "Tensor args, int off_a, int off_b, int off_c, int off_d, bool swap_ab, "
        "int workspace_bytes, ScalarType out_dtype, bool eager_only=False) -> ()",
        &set_gemm_record);
  m.def("set_gemm_torch_record(int[] a_sizes, int[] a_strides, ScalarType a_dtype, "
        "int[] b_sizes, int[] b_strides, ScalarType b_dtype, int device, bool aligned) -> ()",
        &set_gemm_torch_record);
  m.def("clear_records() -> ()", &clear_records);
  m.def("record_count() -> int", &record_count);
  m.def("product_calls() -> int[]", &product_calls);
  m.def("driver_status() -> str", &driver_status);
}

// The Autograd key decides whether a node is recorded; the backends' key is reached below
// autograd (inference mode), where no gradient is wanted. Off CUDA every call misses.
TORCH_LIBRARY_IMPL(cutlass_ops_host, Autograd, m) {
  m.impl("norm", &norm);
  m.impl("gemm", &gemm);
  m.impl("linear", &linear);
}

TORCH_LIBRARY_IMPL(cutlass_ops_host, CompositeExplicitAutograd, m) {
  m.impl("norm", &norm);
  m.impl("gemm", &gemm);
  m.impl("linear", &linear);
}

}  // namespace cutlass_ops_host
