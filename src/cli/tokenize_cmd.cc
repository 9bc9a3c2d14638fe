// hspmd tokenize: text files -> token file, one document per file.
#include <cstdint>
#include <cstdio>

#include "commands.h"
#include "flags.h"
#include "hspmd/core/error.h"
#include "hspmd/data/tokenizer.h"
#include "hspmd/io/output_file.h"
#include "hspmd/models/config.h"

namespace hspmd::cli {

int tokenize_command(const std::vector<std::string>& args) {
  std::string output, model;
  int64_t eos = -1;
  FlagSet f("tokenize",
            "Byte-level tokenizer: each input text file becomes one document (its bytes,\n"
            "then the EOS token) in the output token file.");
  f.add_string("output", &output, "token file to write (.bin)", true);
  f.add_string("model", &model, "config.json whose eos_token_id to use");
  f.add_int("eos", &eos, "EOS token id (>= 256); overrides --model");
  f.allow_positional("FILE...");
  if (!f.parse(args)) return 0;
  if (f.positional().empty()) fail("[flags] tokenize: no input files given");
  std::vector<NamedPath> inputs = {{"--model", model}};
  for (const std::string& in : f.positional()) inputs.push_back({"input", in});
  check_outputs(inputs, {{"--output", output, OutputWrite::kRename}});
  for (const std::string& in : f.positional()) check_input_file("input", in);
  if (f.given("eos") && (eos < 0 || eos > int64_t{UINT32_MAX}))
    fail("[flags] --eos ", eos, " is outside the token ids [256, ", UINT32_MAX, "]");
  if (!f.given("eos")) {
    if (model.empty()) fail("[flags] tokenize: give --eos or --model");
    eos = ModelConfig::load(model).eos_token_id;
  }
  int64_t n = tokenize_files(f.positional(), output, static_cast<uint32_t>(eos));
  std::fprintf(stderr, "wrote %lld tokens from %zu documents to %s\n", static_cast<long long>(n),
               f.positional().size(), output.c_str());
  return 0;
}

}  // namespace hspmd::cli
