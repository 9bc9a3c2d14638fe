// hspmd: the command-line entry point.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "commands.h"
#include "launcher.h"
#include "mps.h"
#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/error.h"
#include "hspmd/core/threads.h"

namespace {

constexpr const char* kUsage =
    "usage: hspmd <command> [flags]\n\n"
    "commands:\n"
    "  train      train a model on a token file\n"
    "  tokenize   turn text files into a token file (byte-level tokenizer)\n"
    "  data       statistics of a token file: document lengths, pieces under a max length\n"
    "  plan       compile a strategy into an annotation plan; explain a plan's communication\n"
    "  profile    time a model's parts on this machine for the planner and the model clock\n"
    "  launch     run a Python script (import hspmd) on N supervised MPI ranks\n\n"
    "Run 'hspmd <command> --help' for the flags of a command.\n";

// Errors are one line: newlines inside a message are flattened.
void print_error(const char* kind, const char* what) {
  std::string line = what;
  for (char& c : line)
    if (c == '\n') c = ' ';
  std::fprintf(stderr, "hspmd: %s%s\n", kind, line.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  hspmd::cli::apply_mps_partition();  // a rank's GPU share, before any CUDA call
  hspmd::ensure_passive_omp_wait(argv);
  hspmd::tune_host_malloc();
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    hspmd::cpu_isa();  // a bad HSPMD_CPU_ISA fails here, in one line, before any work
    if (command == "train") return hspmd::cli::train_command(args);
    if (command == "tokenize") return hspmd::cli::tokenize_command(args);
    if (command == "data") return hspmd::cli::data_command(args);
    if (command == "plan") return hspmd::cli::plan_command(args);
    if (command == "profile") return hspmd::cli::profile_command(args);
    if (command == "launch") return hspmd::cli::launch_command(args);
    print_error("", ("[cli] unknown command '" + command + "' (see hspmd --help)").c_str());
    return 2;
  } catch (const hspmd::Error& e) {
    print_error("error: ", e.what());
  } catch (const hspmd::InternalError& e) {
    print_error("internal error: ", e.what());
  } catch (const std::exception& e) {
    print_error("error: ", e.what());
  }
  return 1;
}
