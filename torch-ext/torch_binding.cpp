// torch stable-ABI binding of the CUDA extension: fills FlashParams (FlashBwdParams) once and
// calls the dispatcher (csrc/hopper/fwd_dispatch.cu, bwd_dispatch.cu). Destination-passing: the
// caller allocates out/lse, and the gradients and workspaces of the backward.
//
// The Python side (_cuda.py) has already validated the user's inputs; the checks here guard the
// op's own contract (it can be called directly through torch.ops) and name the argument.
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x03090000
#endif
#include <Python.h>

#include <dlfcn.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include "../csrc/flash_params.h"
#include "torch_binding.h"

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Provided by libtorch_cuda (declared in the shim under USE_CUDA). Weak, so that a binary linked
// without libtorch_cuda still loads; the symbol is then looked up in the already loaded library.
extern "C" __attribute__((weak)) AOTITorchError aoti_torch_get_current_cuda_stream(
    int32_t device_index, void** ret_stream);

// [Note] Finding the current stream without a link to libtorch_cuda
// A build made on a machine without CUDA torch cannot link libtorch_cuda, and torch loads that
// library privately, so the weak symbol above stays null. The fallback asks the dynamic loader
// for the copy torch already loaded (RTLD_NOLOAD). dlopen/dlsym are pinned to their oldest
// symbol version (manylinux_2_28 allows glibc <= 2.28) and are weak, so a loader without them
// only disables the fallback.
#pragma weak dlopen
#pragma weak dlsym
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");

namespace {

using GetStreamFn = AOTITorchError (*)(int32_t, void**);

GetStreamFn stream_getter() {
  static const GetStreamFn fn = []() -> GetStreamFn {
    if (aoti_torch_get_current_cuda_stream != nullptr) return &aoti_torch_get_current_cuda_stream;
    if (&dlopen == nullptr || &dlsym == nullptr) return nullptr;
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY);
    if (lib == nullptr) return nullptr;
    return reinterpret_cast<GetStreamFn>(dlsym(lib, "aoti_torch_get_current_cuda_stream"));
  }();
  return fn;
}

void* current_cuda_stream(const char* op, int32_t device_index) {
  const GetStreamFn get = stream_getter();
  STD_TORCH_CHECK(get != nullptr, op,
                  ": the current CUDA stream is unavailable (libtorch_cuda is neither linked nor "
                  "loaded)");
  void* stream = nullptr;
  STD_TORCH_CHECK(get(device_index, &stream) == AOTI_TORCH_SUCCESS, op,
                  ": could not get the current CUDA stream");
  return stream;
}

void check_input(const char* op, const Tensor& t, const char* name, ScalarType dtype,
                 int64_t dims) {
  STD_TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " has the wrong dtype");
  STD_TORCH_CHECK(t.dim() == dims, op, ": ", name, " must have ", dims, " dims, got ", t.dim());
  STD_TORCH_CHECK(t.stride(-1) == 1, op, ": ", name, " must have stride(-1) == 1");
}

// A tensor the kernels write as pairs of elements (4-byte words): even strides, 4-byte base.
void check_pair_stores(const char* op, const Tensor& t, const char* name) {
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    STD_TORCH_CHECK(t.stride(i) % 2 == 0, op, ": ", name,
                    " strides must be even (it is normally contiguous)");
  }
  STD_TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0, op, ": ", name,
                  " must be 4-byte aligned");
}

void check_same_shape(const char* op, const Tensor& a, const char* a_name, const Tensor& b,
                      const char* b_name) {
  STD_TORCH_CHECK(a.dim() == b.dim(), op, ": ", a_name, " must have the shape of ", b_name);
  for (int64_t i = 0; i < a.dim(); ++i) {
    STD_TORCH_CHECK(a.size(i) == b.size(i), op, ": ", a_name, " must have the shape of ", b_name);
  }
}

// A window side as the kernels hold it. They compute positions in int, and flash-attn 2 takes
// any int: a side wider than any sequence hides no key, so one past 2^30 is held at 2^30
// (the same mask for any sequence shorter than 2^30 tokens) instead of wrapping when narrowed.
int window_side(int64_t w) {
  constexpr int64_t kWidest = int64_t(1) << 30;
  return static_cast<int>(w < kWidest ? w : kWidest);
}

// The fields shared by the forward and the backward, checked and filled from the forward's
// tensors (out and lse are the forward's outputs, or the backward's saved inputs).
flash::FlashParams forward_params(const char* op, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  const std::optional<Tensor>& cu_seqlens_q,
                                  const std::optional<Tensor>& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                  int64_t window_left, int64_t window_right, double softcap) {
  const bool varlen = cu_seqlens_q.has_value();
  STD_TORCH_CHECK(varlen == cu_seqlens_k.has_value(), op,
                  ": cu_seqlens_q and cu_seqlens_k must be given together");
  const ScalarType dtype = q.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::BFloat16 || dtype == ScalarType::Half, op,
                  ": q must be bfloat16 or float16");
  const int64_t dims = varlen ? 3 : 4;
  check_input(op, q, "q", dtype, dims);
  check_input(op, k, "k", dtype, dims);
  check_input(op, v, "v", dtype, dims);
  check_input(op, out, "out", dtype, dims);
  check_input(op, lse, "lse", ScalarType::Float, varlen ? 2 : 3);
  const int64_t d = q.size(-1);
  STD_TORCH_CHECK(k.size(-1) == d && v.size(-1) == d, op, ": q, k and v must share the head dim");
  check_same_shape(op, out, "out", q, "q");
  check_same_shape(op, v, "v", k, "k");

  flash::FlashParams p{};
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.lse = static_cast<float*>(lse.mutable_data_ptr());
  p.is_bf16 = dtype == ScalarType::BFloat16;
  p.head_dim = static_cast<int>(d);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window_left = window_side(window_left);
  p.window_right = window_side(window_right);
  // (.., rows, heads, d): the last three dims are shared by both layouts.
  p.heads_q = static_cast<int>(q.size(-2));
  p.heads_kv = static_cast<int>(k.size(-2));
  p.rows_q = static_cast<int>(q.size(-3));
  p.rows_k = static_cast<int>(k.size(-3));
  p.q_row_stride = q.stride(-3);
  p.q_head_stride = q.stride(-2);
  p.k_row_stride = k.stride(-3);
  p.k_head_stride = k.stride(-2);
  p.v_row_stride = v.stride(-3);
  p.v_head_stride = v.stride(-2);
  p.out_row_stride = out.stride(-3);
  p.out_head_stride = out.stride(-2);
  STD_TORCH_CHECK(p.heads_kv > 0 && p.heads_q % p.heads_kv == 0,
                  op, ": the query heads must be a multiple of the kv heads");

  if (varlen) {
    const Tensor& cu_q = *cu_seqlens_q;
    const Tensor& cu_k = *cu_seqlens_k;
    STD_TORCH_CHECK(cu_q.is_cuda() && cu_q.scalar_type() == ScalarType::Int && cu_q.dim() == 1 &&
                        cu_q.is_contiguous(),
                    op, ": cu_seqlens_q must be a contiguous int32 CUDA vector");
    STD_TORCH_CHECK(cu_k.is_cuda() && cu_k.scalar_type() == ScalarType::Int &&
                        cu_k.numel() == cu_q.numel() && cu_k.is_contiguous(),
                    op, ": cu_seqlens_k must be a contiguous int32 CUDA vector like "
                    "cu_seqlens_q");
    STD_TORCH_CHECK(lse.size(0) == p.heads_q && lse.size(1) == p.rows_q && lse.stride(1) == 1,
                    op, ": lse must be (Hq, Tq) with unit stride on Tq");
    p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.const_data_ptr());
    p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.const_data_ptr());
    p.batch = static_cast<int>(cu_q.numel() - 1);
    p.seqlen_q = static_cast<int>(max_seqlen_q);
    p.seqlen_k = static_cast<int>(max_seqlen_k);
    p.lse_head_stride = lse.stride(0);
  } else {
    p.batch = static_cast<int>(q.size(0));
    STD_TORCH_CHECK(k.size(0) == p.batch, op, ": k must have the batch size of q");
    p.seqlen_q = p.rows_q;
    p.seqlen_k = p.rows_k;
    p.q_batch_stride = q.stride(0);
    p.k_batch_stride = k.stride(0);
    p.v_batch_stride = v.stride(0);
    p.out_batch_stride = out.stride(0);
    STD_TORCH_CHECK(lse.size(0) == p.batch && lse.size(1) == p.heads_q &&
                        lse.size(2) == p.rows_q && lse.stride(2) == 1,
                    op, ": lse must be (B, Hq, Sq) with unit stride on Sq");
    p.lse_batch_stride = lse.stride(0);
    p.lse_head_stride = lse.stride(1);
  }
  return p;
}

void launch_check(const char* op, flash::FwdStatus status, const char* why) {
  STD_TORCH_CHECK(status == flash::FwdStatus::kOk, op, ": not supported here: ", why);
}

}  // namespace

void hopper_fwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                std::optional<Tensor> cu_seqlens_q, std::optional<Tensor> cu_seqlens_k,
                std::optional<Tensor> s_aux, int64_t max_seqlen_q, int64_t max_seqlen_k,
                double scale, int64_t window_left, int64_t window_right, double softcap) {
  constexpr const char* op = "hopper_fwd";
  flash::FlashParams p = forward_params(op, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, scale, window_left,
                                        window_right, softcap);
  check_pair_stores(op, out, "out");
  if (s_aux.has_value()) {
    const Tensor& sink = *s_aux;
    STD_TORCH_CHECK(sink.is_cuda() && sink.scalar_type() == ScalarType::Float &&
                        sink.numel() == p.heads_q && sink.is_contiguous(),
                    op, ": s_aux must be a contiguous float32 CUDA vector of Hq logits");
    p.s_aux = static_cast<const float*>(sink.const_data_ptr());
  }
  const int32_t device = q.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  char why[256] = {0};
  launch_check(op, flash::hopper_fwd(p, current_cuda_stream(op, device), why, sizeof(why)), why);
}

void hopper_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dq,
                Tensor dk, Tensor dv, Tensor dq_acc, Tensor lse2, Tensor delta,
                std::optional<Tensor> dq_semaphore, std::optional<Tensor> cu_seqlens_q,
                std::optional<Tensor> cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                double scale, int64_t window_left, int64_t window_right, double softcap,
                std::optional<Tensor> dkv_partial, int64_t group_splits) {
  constexpr const char* op = "hopper_bwd";
  flash::FlashBwdParams b{};
  b.fwd = forward_params(op, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, scale, window_left, window_right, softcap);
  const flash::FlashParams& p = b.fwd;
  const ScalarType dtype = q.scalar_type();
  const int64_t dims = q.dim();
  check_input(op, dout, "dout", dtype, dims);
  check_input(op, dq, "dq", dtype, dims);
  check_input(op, dk, "dk", dtype, dims);
  check_input(op, dv, "dv", dtype, dims);
  check_same_shape(op, dout, "dout", q, "q");
  check_same_shape(op, dq, "dq", q, "q");
  check_same_shape(op, dk, "dk", k, "k");
  check_same_shape(op, dv, "dv", k, "k");
  check_pair_stores(op, dk, "dk");
  check_pair_stores(op, dv, "dv");
  // workspaces: [Note] Backward workspaces in csrc/flash_params.h
  const int64_t batch_rows = dims == 4 ? int64_t(p.batch) * p.heads_q : p.heads_q;
  STD_TORCH_CHECK(lse2.is_cuda() && lse2.scalar_type() == ScalarType::Float &&
                      lse2.dim() == 1 && lse2.is_contiguous() && lse2.numel() % batch_rows == 0,
                  op, ": lse2 must be a contiguous float32 CUDA vector of whole workspace rows");
  const int64_t ws_rows = lse2.numel() / batch_rows;
  constexpr int64_t align = flash::kBwdWorkspaceAlign;
  const int64_t rows = dims == 4 ? int64_t(p.seqlen_q) : int64_t(p.rows_q) + align * p.batch;
  const int64_t need = (rows + align - 1) / align * align;
  STD_TORCH_CHECK(ws_rows >= need && ws_rows % align == 0, op, ": lse2 has ", ws_rows,
                  " rows per head, needs a multiple of ", align, " of at least ", need);
  STD_TORCH_CHECK(delta.is_cuda() && delta.scalar_type() == ScalarType::Float &&
                      delta.is_contiguous() && delta.numel() == lse2.numel(),
                  op, ": delta must be a contiguous float32 CUDA vector like lse2");
  STD_TORCH_CHECK(dq_acc.is_cuda() && dq_acc.scalar_type() == ScalarType::Float &&
                      dq_acc.dim() == 2 && dq_acc.is_contiguous() &&
                      dq_acc.size(0) == lse2.numel() && dq_acc.size(1) >= q.size(-1) &&
                      reinterpret_cast<uintptr_t>(dq_acc.const_data_ptr()) % 16 == 0,
                  op, ": dq_acc must be a contiguous, 16-byte aligned float32 CUDA (lse2 rows, "
                  "compiled head dim) matrix");

  b.dout = dout.const_data_ptr();
  b.dout_row_stride = dout.stride(-3);
  b.dout_head_stride = dout.stride(-2);
  b.dq = dq.mutable_data_ptr();
  b.dq_row_stride = dq.stride(-3);
  b.dq_head_stride = dq.stride(-2);
  b.dk = dk.mutable_data_ptr();
  b.dk_row_stride = dk.stride(-3);
  b.dk_head_stride = dk.stride(-2);
  b.dv = dv.mutable_data_ptr();
  b.dv_row_stride = dv.stride(-3);
  b.dv_head_stride = dv.stride(-2);
  if (dims == 4) {
    b.dout_batch_stride = dout.stride(0);
    b.dq_batch_stride = dq.stride(0);
    b.dk_batch_stride = dk.stride(0);
    b.dv_batch_stride = dv.stride(0);
  }
  b.dq_acc = static_cast<float*>(dq_acc.mutable_data_ptr());
  b.lse2 = static_cast<float*>(lse2.mutable_data_ptr());
  b.delta = static_cast<float*>(delta.mutable_data_ptr());
  b.ws_rows = ws_rows;
  b.dq_acc_cols = static_cast<int>(dq_acc.size(1));
  if (dq_semaphore.has_value()) {
    const Tensor& sem = *dq_semaphore;
    STD_TORCH_CHECK(sem.is_cuda() && sem.scalar_type() == ScalarType::Int &&
                        sem.is_contiguous() &&
                        sem.numel() * flash::kBwdWorkspaceBlock == lse2.numel(),
                    op, ": dq_semaphore must be a contiguous int32 CUDA vector, one per ",
                    flash::kBwdWorkspaceBlock, " workspace rows");
    b.dq_semaphore = static_cast<int*>(sem.mutable_data_ptr());
  }
  // [Note] Backward group split in csrc/flash_params.h
  b.group_splits = 1;
  STD_TORCH_CHECK(group_splits == 0 || dkv_partial.has_value(), op,
                  ": group_splits > 0 needs dkv_partial");
  if (dkv_partial.has_value()) {
    const Tensor& part = *dkv_partial;
    bool shape_ok = part.dim() == dims + 2 && part.size(0) == 2 && part.size(1) >= 1;
    for (int64_t i = 0; shape_ok && i < dims; ++i) shape_ok = part.size(i + 2) == k.size(i);
    STD_TORCH_CHECK(part.is_cuda() && part.scalar_type() == ScalarType::Float &&
                        part.is_contiguous() && shape_ok,
                    op, ": dkv_partial must be a contiguous float32 CUDA tensor of shape "
                    "(2, group_splits, *k.shape)");
    // group_splits 0: one slice per split, stored; > 0: every split adds into one slice
    STD_TORCH_CHECK(group_splits == 0 || (group_splits > 1 && part.size(1) == 1 &&
                                          !dq_semaphore.has_value()),
                    op, ": group_splits must be 0 (one dkv_partial slice per split) or > 1 with "
                    "a single zeroed slice, outside deterministic mode (got ", group_splits, ")");
    const int64_t splits = group_splits > 0 ? group_splits : part.size(1);
    STD_TORCH_CHECK((p.heads_q / p.heads_kv) % splits == 0, op, ": group_splits (", splits,
                    ") must divide Hq / Hkv = ", p.heads_q / p.heads_kv);
    b.dkv_partial = static_cast<float*>(part.mutable_data_ptr());
    b.group_splits = static_cast<int>(splits);
    b.dkv_add = group_splits > 0;
    b.part_half_stride = part.stride(0);
    b.part_split_stride = b.dkv_add ? 0 : part.stride(1);
    b.part_row_stride = part.stride(-3);
    b.part_head_stride = part.stride(-2);
    b.part_batch_stride = dims == 4 ? part.stride(2) : 0;
  }
  const int32_t device = q.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  char why[256] = {0};
  launch_check(op, flash::hopper_bwd(b, current_cuda_stream(op, device), why, sizeof(why)), why);
}

STABLE_TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("hopper_fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? s_aux, int max_seqlen_q, "
        "int max_seqlen_k, float scale, int window_left, int window_right, float softcap) -> ()");
  m.def("hopper_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dq_acc, Tensor(e!) lse2, "
        "Tensor(f!) delta, Tensor(g!)? dq_semaphore, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "int max_seqlen_q, "
        "int max_seqlen_k, float scale, int window_left, int window_right, float softcap, "
        "Tensor(h!)? dkv_partial=None, int group_splits=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) {
  m.impl("hopper_fwd", TORCH_BOX(&hopper_fwd));
  m.impl("hopper_bwd", TORCH_BOX(&hopper_bwd));
}

// The Python module the generated _ops.py imports; it only has to exist (the ops register on
// load through the static initialisers above).
#define FLASH_CONCAT_INNER(a, b) a##b
#define FLASH_CONCAT(a, b) FLASH_CONCAT_INNER(a, b)
#define FLASH_STRINGIFY_INNER(x) #x
#define FLASH_STRINGIFY(x) FLASH_STRINGIFY_INNER(x)

extern "C" PyObject* FLASH_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, FLASH_STRINGIFY(TORCH_EXTENSION_NAME),
                               nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
