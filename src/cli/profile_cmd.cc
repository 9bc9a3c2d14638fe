// hspmd profile: measure a model's parts on this machine -> profile JSON
// (docs/profiling.md).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "commands.h"
#include "flags.h"
#include "hspmd/core/error.h"
#include "hspmd/train/profiler.h"

namespace hspmd::cli {

namespace {

// "1,2,4" -> {1, 2, 4}; "[profile] --<flag>: ..." for anything else.
std::vector<int64_t> parse_list(const std::string& flag, const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    int64_t v = 0;
    try {
      v = parse_int(flag, item);
    } catch (const Error&) {
      fail("[profile] --", flag, ": '", item, "' in '", text, "' is not an integer");
    }
    if (v < 1) fail("[profile] --", flag, ": ", v, " must be positive");
    out.push_back(v);
  }
  if (out.empty() || text.back() == ',') fail("[profile] --", flag, ": '", text, "' is not a list like 1,2,4");
  return out;
}

std::vector<int> to_ints(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

void print_table(const Profile& p, double seconds) {
  std::fprintf(stderr, "%-10s %3s %3s %12s %12s %12s %8s\n", "part", "tp", "cp", "a", "c", "d", "max err");
  for (const ProfileEntry& e : p.entries)
    for (const char* part : kProfileParts) {
      const PartFit& f = e.parts.at(part);
      std::fprintf(stderr, "%-10s %3d %3d %12.4e %12.4e %12.4e %7.1f%%\n", part, e.tp, e.cp, f.a, f.c, f.d,
                   100 * f.max_rel_error);
    }
  std::fprintf(stderr, "optimizer: %.4e s/param + %.4e s (max err %.1f%%)\n", p.optimizer.per_param_s,
               p.optimizer.fixed_s, 100 * p.optimizer.max_rel_error);
  for (const LayerMemory& m : p.memory)
    std::fprintf(stderr, "memory tp %d cp %d: layer params %lld B, activations %.1f B/token (recompute %.1f)\n", m.tp,
                 m.cp, static_cast<long long>(m.param_bytes), m.activation_bytes_per_token,
                 m.activation_bytes_per_token_recompute);
  std::fprintf(stderr, "op fits: %zu op types; profiled in %.1f s\n", p.ops.size() - p.ops.count(kAnyOp), seconds);
}

}  // namespace

int profile_command(const std::vector<std::string>& args) {
  std::string model, output, tp = "1", cp = "1", seqs = "16,32,64", batches = "1,2";
  int64_t repetitions = 5, threads = 1;
  FlagSet f("profile",
            "Measure a model's embedding, block and head (forward and backward) on one rank of a\n"
            "tensor-parallel x context-parallel group with the real executor, and fit them\n"
            "(docs/profiling.md). Times are the CPU time the emulator bills for the same work.");
  f.add_string("model", &model, "Hugging Face config.json of the model", true);
  f.add_string("output", &output, "profile JSON to write (also -o)", true);
  f.add_string("tp", &tp, "tensor-parallel degrees, e.g. 1,2,4 (default 1)");
  f.add_string("cp", &cp, "context-parallel degrees (default 1)");
  f.add_string("seq-lens", &seqs, "sequence lengths (default 16,32,64)");
  f.add_string("micro-batch-sizes", &batches, "micro-batch sizes (default 1,2)");
  f.add_int("repetitions", &repetitions, "timed runs per point after one warm-up; the median counts (default 5)");
  f.add_int("threads", &threads, "kernel threads, as the emulated ranks run (default 1)");
  std::vector<std::string> expanded;
  for (const std::string& a : args) expanded.push_back(a == "-o" ? "--output" : a);
  if (!f.parse(expanded)) return 0;

  if (!std::filesystem::is_regular_file(model)) fail("[profile] --model ", model, ": no such file");
  const auto dir = std::filesystem::absolute(output).parent_path();
  if (!std::filesystem::is_directory(dir))
    fail("[profile] --output ", output, ": directory ", dir.string(), " does not exist");
  ProfileOptions o;
  o.model_path = model;
  o.config = LlamaConfig::load(model);
  o.tp = to_ints(parse_list("tp", tp));
  o.cp = to_ints(parse_list("cp", cp));
  o.seq_lens = parse_list("seq-lens", seqs);
  o.micro_batch_sizes = parse_list("micro-batch-sizes", batches);
  o.repetitions = static_cast<int>(repetitions);
  o.threads = static_cast<int>(threads);
  check_profile_options(o);
  o.progress = [](const std::string& what) { std::fprintf(stderr, "[profile] %s\n", what.c_str()); };
  const auto t0 = std::chrono::steady_clock::now();
  const Profile p = profile_model(o);
  p.save(output);
  print_table(p, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::fprintf(stderr, "wrote %s\n", output.c_str());
  return 0;
}

}  // namespace hspmd::cli
