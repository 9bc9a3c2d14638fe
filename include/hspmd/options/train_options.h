// The training options and their rules, below the trainer: one struct per
// subsystem (hspmd/options/subsystem_options.h), each with its table and its
// validate(), and TrainOptions, all of them together. The command line's
// flags and --help and the Python Trainer's keyword arguments are generated
// from the tables (train_option_table), the rules of one subsystem are its
// validate()'s and the rules between subsystems this validate()'s, so each
// option and each rule is written once. Errors name the option as the front
// end spells it (hspmd/core/options.h). docs/training.md, "Options".
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hspmd/core/options.h"
#include "hspmd/options/subsystem_options.h"

namespace hspmd {

// Every training option: each subsystem's, reached as before (o.seq_len,
// o.adam, o.switches, TrainOptions::Switch), plus the run's hook. A
// component that needs one subsystem may take its struct alone.
struct TrainOptions : DataOptions,
                      OptimizerOptions,
                      OutputOptions,
                      ParallelOptions,
                      SwitchingOptions,
                      ElasticOptions,
                      CheckpointOptions {
  // Called on every rank after each finished step (the launcher's heartbeat,
  // src/cli/launcher.h); may be empty.
  std::function<void(int64_t step)> on_step;
};

// The defaults every front end starts from: TrainOptions{} with the peak
// learning rate 3e-4 and the machine's cores shared by this node's ranks
// (OMPI_COMM_WORLD_LOCAL_SIZE) as threads.
TrainOptions default_train_options();

// The schema: the subsystems' tables, in the order of subsystem_options.h
// (the order of the command line's --help), each row setting its
// subsystem's part of TrainOptions. One row writes two subsystems:
// `strategies` also makes its first file the run's strategy_path.
std::vector<OptionSpec<TrainOptions>> train_option_table();
// The row of `name`, or nullptr.
const OptionSpec<TrainOptions>* find_train_option(const std::string& name);

// Every rule that needs nothing but the options (the model's and the
// world's rules are the trainer's): each subsystem's validate(), then the
// rules between subsystems (a choice of one that needs or excludes one of
// another). `given`: what the user gave; a run built in code passes none.
// hspmd::Error naming the option (fail_option).
void validate(const TrainOptions& o, const GivenOptions& given = {});

}  // namespace hspmd
