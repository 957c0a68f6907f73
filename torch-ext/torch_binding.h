// Ops of the compiled extension (torch stable ABI). Registered in torch_binding.cpp.
#pragma once

#include <optional>

#include <torch/csrc/stable/tensor.h>

// hopper_fwd: sm90 forward attention into caller-allocated out / lse (see _cuda.py for the
// Python side and csrc/flash_params.h for the semantics of every field).
void hopper_fwd(torch::stable::Tensor q, torch::stable::Tensor k, torch::stable::Tensor v,
                torch::stable::Tensor out, torch::stable::Tensor lse,
                std::optional<torch::stable::Tensor> cu_seqlens_q,
                std::optional<torch::stable::Tensor> cu_seqlens_k,
                std::optional<torch::stable::Tensor> s_aux, int64_t max_seqlen_q,
                int64_t max_seqlen_k, double scale, int64_t window_left, int64_t window_right,
                double softcap);

// hopper_bwd: sm90 backward into caller-allocated dq / dk / dv, with the fp32 workspaces dq_acc
// (as many columns as the compiled head dim the call runs on; zeroed by the kernel), lse2 and
// delta laid out as [Note] Backward workspaces in csrc/flash_params.h says; dq_semaphore (int32,
// one per 64 workspace rows) makes dq bitwise reproducible. With dkv_partial (fp32,
// (2, group_splits, *k.shape)), each kv head's query heads are split over group_splits CTAs
// that write partial dK / dV there instead of into dk / dv; the caller sums them ([Note]
// Backward group split). With group_splits > 0 instead, dkv_partial holds one zeroed slice
// (2, 1, *k.shape) that all group_splits CTAs add into (not in deterministic mode).
void hopper_bwd(torch::stable::Tensor dout, torch::stable::Tensor q, torch::stable::Tensor k,
                torch::stable::Tensor v, torch::stable::Tensor out, torch::stable::Tensor lse,
                torch::stable::Tensor dq, torch::stable::Tensor dk, torch::stable::Tensor dv,
                torch::stable::Tensor dq_acc, torch::stable::Tensor lse2,
                torch::stable::Tensor delta,
                std::optional<torch::stable::Tensor> dq_semaphore,
                std::optional<torch::stable::Tensor> cu_seqlens_q,
                std::optional<torch::stable::Tensor> cu_seqlens_k, int64_t max_seqlen_q,
                int64_t max_seqlen_k, double scale, int64_t window_left, int64_t window_right,
                double softcap, std::optional<torch::stable::Tensor> dkv_partial,
                int64_t group_splits);
