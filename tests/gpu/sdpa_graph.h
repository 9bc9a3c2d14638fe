// The cudnn_frontend part of probe_cudnn_sdpa, behind a small interface so
// that the frontend's large headers (graph API + nlohmann json) are compiled
// once by the host compiler (sdpa_graph.cpp), not three times by nvcc's
// passes: that keeps the probe's build at about a minute.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace sdpa {

// Tensor uids of the variant packs.
enum Uid : int64_t {
  U_Q = 1, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV,
  U_SEQ_Q, U_SEQ_KV, U_OFF_Q, U_OFF_K, U_OFF_V, U_OFF_O
};

struct Spec {
  int64_t B, Hq, Hkv, S, D;
  std::vector<int64_t> q_strides, kv_strides;  // [B, H, S, D] strides: Q, O, dO, dQ / K, V, dK, dV
  bool padding_mask;  // int32 [B] seq_len_q, seq_len_kv inputs (U_SEQ_Q, U_SEQ_KV)
  bool ragged;        // int32 [B+1] ragged offsets in elements (U_OFF_Q/K/V/O): packed (THD) tensors
  // Sliding window on top of the causal mask: > 0 sets the frontend's
  // SDPA_attributes / SDPA_backward_attributes::set_diagonal_band_left_bound(window)
  // (top-left diagonal alignment, right bound 0 from set_causal_mask). The
  // frontend's composite graph keeps score (i, j) when j + window > i, i.e.
  // keys i - window < j <= i; probe_cudnn_sdpa checks that empirically.
  int64_t window = 0;
};

struct Graph;
struct GraphDeleter {
  void operator()(Graph*) const;
};
using GraphPtr = std::unique_ptr<Graph, GraphDeleter>;

// Causal SDPA (optionally sliding-window, Spec::window), bf16 I/O, fp32 compute, scale 1/sqrt(D). The forward also
// writes the fp32 softmax stats [B, Hq, S, 1] (U_STATS) that the backward
// reads. Null on failure, *err = "<stage>: <frontend message>".
GraphPtr build(const Spec& spec, bool backward, cudnnHandle_t handle, std::string* err, double* build_ms);
int64_t workspace_size(const Graph& g);
// "" on success, else the frontend's message.
std::string execute(const Graph& g, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack, void* ws);
int frontend_version();

}  // namespace sdpa
