// The memory-traffic arithmetic behind IO-aware attention, and the online-softmax worked
// example, as numbers (the CLI's `ioattn explain` and Python's ioattn.explain print them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ioattn {

struct ExplainInput {
  int64_t seqlen = 8192;
  int64_t head_dim = 128;
  int64_t heads = 64;
  int64_t layers = 80;
  int64_t dtype_bytes = 2;        // fp16
  int64_t naive_passes = 4;       // write S, read S, write P, read P
  double bandwidth_Bps = 3e12;    // HBM bytes/s
  double flops_per_s = 500e12;    // matrix FLOP/s
  double attention_share = 0.0;   // share of a model step spent in attention (0 = skip)
  double kernel_speedup = 1.0;    // speedup of the attention kernel
};

struct ExplainReport {
  double score_bytes_per_head;    // n^2 * bytes
  double naive_bytes_per_head;    // passes * score bytes
  double naive_bytes_per_layer;   // * heads
  double naive_bytes_per_model;   // * layers
  double flash_bytes_per_head;    // read Q, K, V, write O: 4 * n * d * bytes
  double traffic_ratio;           // naive / flash
  double flops_per_head;          // 4 * n^2 * d (QK^T and PV)
  double flops_per_model;         // * heads * layers
  double naive_traffic_seconds;   // naive_bytes_per_model / bandwidth
  double flash_traffic_seconds;
  double math_seconds;            // flops_per_model / flops_per_s
  double end_to_end_speedup;      // 1 / ((1 - share) + share / speedup); 1 if share = 0
  double end_to_end_limit;        // the same with an infinitely fast kernel: 1 / (1 - share)
};

ExplainReport explain(const ExplainInput& in);

// One step of the online softmax over key blocks.
struct OnlineSoftmaxStep {
  std::vector<double> block_scores;
  double max_before, max_after;
  double rescale;        // exp(max_before - max_after) applied to the running sum and output
  double sum_after;      // running l
  double acc_after;      // running unnormalised output (scalar values)
};
struct OnlineSoftmaxExample {
  std::vector<OnlineSoftmaxStep> steps;
  std::vector<double> probabilities;  // final softmax
  double output;                      // sum p_j v_j
  double output_direct;               // the same by the two-pass softmax, for comparison
};
// Scores split into blocks of block_size; values are scalars (head_dim 1). A score of -inf is a
// masked key (weight 0; all masked: output 0, probabilities 0); NaN and +inf are errors.
OnlineSoftmaxExample online_softmax_example(const std::vector<double>& scores,
                                            const std::vector<double>& values, int block_size);

std::string explain_text(const ExplainInput& in);

}  // namespace ioattn
