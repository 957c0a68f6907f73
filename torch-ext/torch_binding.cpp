// torch stable-ABI binding of the CUDA extension: fills FlashParams once and calls the
// dispatcher (csrc/hopper/fwd_dispatch.cu). Destination-passing: the caller allocates out/lse.
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

void* current_cuda_stream(int32_t device_index) {
  const GetStreamFn get = stream_getter();
  STD_TORCH_CHECK(get != nullptr,
                  "hopper_fwd: the current CUDA stream is unavailable (libtorch_cuda is neither "
                  "linked nor loaded)");
  void* stream = nullptr;
  STD_TORCH_CHECK(get(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "hopper_fwd: could not get the current CUDA stream");
  return stream;
}

void check_input(const Tensor& t, const char* name, ScalarType dtype, int64_t dims) {
  STD_TORCH_CHECK(t.is_cuda(), "hopper_fwd: ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.scalar_type() == dtype, "hopper_fwd: ", name, " has the wrong dtype");
  STD_TORCH_CHECK(t.dim() == dims, "hopper_fwd: ", name, " must have ", dims, " dims, got ",
                  t.dim());
  STD_TORCH_CHECK(t.stride(-1) == 1, "hopper_fwd: ", name, " must have stride(-1) == 1");
}

}  // namespace

void hopper_fwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                std::optional<Tensor> cu_seqlens_q, std::optional<Tensor> cu_seqlens_k,
                std::optional<Tensor> s_aux, int64_t max_seqlen_q, int64_t max_seqlen_k,
                double scale, int64_t window_left, int64_t window_right, double softcap) {
  const bool varlen = cu_seqlens_q.has_value();
  STD_TORCH_CHECK(varlen == cu_seqlens_k.has_value(),
                  "hopper_fwd: cu_seqlens_q and cu_seqlens_k must be given together");
  const ScalarType dtype = q.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::BFloat16 || dtype == ScalarType::Half,
                  "hopper_fwd: q must be bfloat16 or float16");
  const int64_t dims = varlen ? 3 : 4;
  check_input(q, "q", dtype, dims);
  check_input(k, "k", dtype, dims);
  check_input(v, "v", dtype, dims);
  check_input(out, "out", dtype, dims);
  check_input(lse, "lse", ScalarType::Float, varlen ? 2 : 3);
  const int64_t d = q.size(-1);
  STD_TORCH_CHECK(k.size(-1) == d && v.size(-1) == d && out.size(-1) == d,
                  "hopper_fwd: q, k, v and out must share the head dim");
  for (int64_t i = 0; i < dims; ++i) {
    STD_TORCH_CHECK(out.size(i) == q.size(i), "hopper_fwd: out must have the shape of q");
    STD_TORCH_CHECK(v.size(i) == k.size(i), "hopper_fwd: v must have the shape of k");
    // the epilogue stores pairs of elements as 4-byte words
    STD_TORCH_CHECK(out.stride(i) % 2 == 0 || i == dims - 1,
                    "hopper_fwd: out strides must be even (out is normally contiguous)");
  }
  STD_TORCH_CHECK(reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 4 == 0,
                  "hopper_fwd: out must be 4-byte aligned");

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
  p.window_left = static_cast<int>(window_left);
  p.window_right = static_cast<int>(window_right);
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
                  "hopper_fwd: the query heads must be a multiple of the kv heads");

  if (varlen) {
    const Tensor& cu_q = *cu_seqlens_q;
    const Tensor& cu_k = *cu_seqlens_k;
    STD_TORCH_CHECK(cu_q.is_cuda() && cu_q.scalar_type() == ScalarType::Int && cu_q.dim() == 1 &&
                        cu_q.is_contiguous(),
                    "hopper_fwd: cu_seqlens_q must be a contiguous int32 CUDA vector");
    STD_TORCH_CHECK(cu_k.is_cuda() && cu_k.scalar_type() == ScalarType::Int &&
                        cu_k.numel() == cu_q.numel() && cu_k.is_contiguous(),
                    "hopper_fwd: cu_seqlens_k must be a contiguous int32 CUDA vector like "
                    "cu_seqlens_q");
    STD_TORCH_CHECK(lse.size(0) == p.heads_q && lse.size(1) == p.rows_q && lse.stride(1) == 1,
                    "hopper_fwd: lse must be (Hq, Tq) with unit stride on Tq");
    p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.const_data_ptr());
    p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.const_data_ptr());
    p.batch = static_cast<int>(cu_q.numel() - 1);
    p.seqlen_q = static_cast<int>(max_seqlen_q);
    p.seqlen_k = static_cast<int>(max_seqlen_k);
    p.lse_head_stride = lse.stride(0);
  } else {
    p.batch = static_cast<int>(q.size(0));
    STD_TORCH_CHECK(k.size(0) == p.batch, "hopper_fwd: k must have the batch size of q");
    p.seqlen_q = p.rows_q;
    p.seqlen_k = p.rows_k;
    p.q_batch_stride = q.stride(0);
    p.k_batch_stride = k.stride(0);
    p.v_batch_stride = v.stride(0);
    p.out_batch_stride = out.stride(0);
    STD_TORCH_CHECK(lse.size(0) == p.batch && lse.size(1) == p.heads_q &&
                        lse.size(2) == p.rows_q && lse.stride(2) == 1,
                    "hopper_fwd: lse must be (B, Hq, Sq) with unit stride on Sq");
    p.lse_batch_stride = lse.stride(0);
    p.lse_head_stride = lse.stride(1);
  }
  if (s_aux.has_value()) {
    const Tensor& sink = *s_aux;
    STD_TORCH_CHECK(sink.is_cuda() && sink.scalar_type() == ScalarType::Float &&
                        sink.numel() == p.heads_q && sink.is_contiguous(),
                    "hopper_fwd: s_aux must be a contiguous float32 CUDA vector of Hq logits");
    p.s_aux = static_cast<const float*>(sink.const_data_ptr());
  }

  const int32_t device = q.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  char why[256] = {0};
  const flash::FwdStatus status = flash::hopper_fwd(p, current_cuda_stream(device), why, sizeof(why));
  STD_TORCH_CHECK(status == flash::FwdStatus::kOk, "hopper_fwd: not supported here: ", why);
}

STABLE_TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("hopper_fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? s_aux, int max_seqlen_q, "
        "int max_seqlen_k, float scale, int window_left, int window_right, float softcap) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) {
  m.impl("hopper_fwd", TORCH_BOX(&hopper_fwd));
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
