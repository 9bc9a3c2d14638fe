// hspmd data stats: document-length statistics of a token file (docs/data.md).
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "hspmd/core/error.h"
#include "hspmd/data/length_stats.h"
#include "hspmd/data/token_data.h"
#include "hspmd/io/output_file.h"
#include "hspmd/io/text_output.h"
#include "hspmd/models/config.h"

namespace hspmd::cli {
namespace {

constexpr const char* kDataUsage =
    "usage: hspmd data <subcommand> [flags]\n\n"
    "Token files.\n\n"
    "subcommands:\n"
    "  stats      document lengths: percentiles, a powers-of-two histogram, pieces under a max length\n\n"
    "Run 'hspmd data <subcommand> --help' for its flags.\n";

struct StatsFlags {
  std::string data, model, svg;
  int64_t eos = 0;
  std::vector<int64_t> max_seq_lens;
  bool json = false;
};

// Parses and checks every flag before the data is read. False on --help.
bool parse_stats_flags(const std::vector<std::string>& args, StatsFlags& out) {
  std::vector<std::string> lens;
  FlagSet f("data stats",
            "Document lengths of a token file: documents end at the eos token (docs/data.md).\n"
            "Prints percentiles, a powers-of-two histogram and, per --max-seq-len L, the pieces\n"
            "that packing into samples of L tokens cuts documents into.");
  f.add_int("eos", &out.eos, "eos token id (default 0)");
  f.add_string("model", &out.model, "config.json whose eos_token_id to use (instead of --eos)");
  f.add_list("max-seq-len", &lens, "cut documents into pieces of at most L tokens (repeatable)");
  f.add_string("svg", &out.svg, "write the histogram as an SVG image to this file");
  f.add_bool("json", &out.json, "print one JSON document with every figure instead of the table");
  f.allow_positional("DATA.bin");
  if (!f.parse(args)) return false;
  if (f.positional().size() != 1)
    fail("[flags] data stats: expected one token file, got ", f.positional().size(), " arguments");
  out.data = f.positional()[0];
  if (f.given("eos") && f.given("model")) fail("[flags] data stats: give --eos or --model, not both");
  if (out.eos < 0 || out.eos > int64_t{UINT32_MAX})
    fail("[flags] --eos ", out.eos, " is outside the token ids [0, ", UINT32_MAX, "]");
  for (const std::string& v : lens) {
    out.max_seq_lens.push_back(parse_int("max-seq-len", v));
    if (out.max_seq_lens.back() <= 0) fail("[flags] --max-seq-len ", v, " must be positive");
  }
  check_input_file("--model", out.model);
  check_outputs({{"token file", out.data}, {"--model", out.model}}, {{"--svg", out.svg}});
  return true;
}

std::string percent(int64_t part, int64_t whole) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", whole > 0 ? 100.0 * static_cast<double>(part) / whole : 0.0);
  return buf;
}

void print_bins(const std::vector<LengthBin>& bins, const char* what, int64_t count_total, int64_t token_total) {
  std::printf("  %-22s %10s %7s %12s %7s\n", "length", what, "share", "tokens", "share");
  for (const LengthBin& b : bins) {
    char range[64];
    std::snprintf(range, sizeof range, "(%lld, %lld]", static_cast<long long>(b.lo), static_cast<long long>(b.hi));
    std::printf("  %-22s %10lld %7s %12lld %7s\n", range, static_cast<long long>(b.count),
                percent(b.count, count_total).c_str(), static_cast<long long>(b.tokens),
                percent(b.tokens, token_total).c_str());
  }
}

void print_table(const StatsFlags& flags, const LengthStats& s) {
  std::printf("%s: %lld tokens in %lld documents (eos %lld)\n", flags.data.c_str(),
              static_cast<long long>(s.tokens), static_cast<long long>(s.documents),
              static_cast<long long>(flags.eos));
  std::printf("document length: p50 %lld  p90 %lld  p97 %lld  p99 %lld  max %lld  mean %.1f\n",
              static_cast<long long>(s.p50), static_cast<long long>(s.p90), static_cast<long long>(s.p97),
              static_cast<long long>(s.p99), static_cast<long long>(s.max), s.mean);
  std::printf("\ndocuments by length (powers-of-two bins):\n");
  print_bins(s.histogram, "documents", s.documents, s.tokens);
  for (const PieceStats& p : s.pieces) {
    std::printf("\nmax-seq-len %lld: %lld pieces; documents cut: %lld\n", static_cast<long long>(p.max_seq_len),
                static_cast<long long>(p.pieces), static_cast<long long>(p.cut_documents));
    print_bins(p.intervals, "pieces", p.pieces, s.tokens);
  }
}

int stats_command(const std::vector<std::string>& args) {
  StatsFlags flags;
  if (!parse_stats_flags(args, flags)) return 0;
  if (!flags.model.empty()) flags.eos = ModelConfig::load(flags.model).eos_token_id;
  // Any uint32 is a token id here: the statistics need no vocabulary.
  const TokenData data = TokenData::load(flags.data, int64_t{1} << 32);
  const std::vector<int64_t> lengths = document_lengths(data.tokens(), static_cast<uint32_t>(flags.eos));
  const LengthStats stats = length_stats(lengths, flags.max_seq_lens, flags.data);
  if (stats.documents == 1 && data.tokens().back() != flags.eos)
    std::fprintf(stderr, "hspmd: warning: [data] %s: eos %lld never occurs; the file is one document\n",
                 flags.data.c_str(), static_cast<long long>(flags.eos));
  if (!flags.svg.empty())
    write_output_file("[data] --svg", flags.svg, histogram_svg(stats, flags.data + ": document lengths"));
  if (!flags.json) {
    print_table(flags, stats);
    return 0;
  }
  nlohmann::json j = to_json(stats);
  j["file"] = flags.data;
  j["eos_token_id"] = flags.eos;
  std::printf("%s\n", j.dump(1).c_str());
  return 0;
}

}  // namespace

int data_command(const std::vector<std::string>& args) {
  if (args.empty()) fail("[flags] data: missing subcommand (stats; see hspmd data --help)");
  const std::string& sub = args[0];
  if (sub == "--help" || sub == "-h") {
    std::fputs(kDataUsage, stdout);
    return 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (sub == "stats") return stats_command(rest);
  fail("[flags] data: unknown subcommand '", sub, "' (expected stats)");
}

}  // namespace hspmd::cli
