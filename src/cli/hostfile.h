// `--hostfile FILE` (hspmd train, hspmd launch): the hosts a job's ranks run
// on, in Open MPI's hostfile syntax (docs/multi_host.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hspmd::cli {

struct HostSlots {
  std::string name;
  int64_t slots = 0;
};

// A hostfile's hosts in file order, each once (a host named again adds its
// slots, as Open MPI counts them).
struct Hostfile {
  std::string path;  // as given on the command line
  std::vector<HostSlots> hosts;

  int64_t slots() const;  // the total over the hosts
  // The host of rank `rank` under `--map-by slot` (the first host's slots
  // filled first, then the next host's): what mpirun does with this file.
  const std::string& host_of(int64_t rank) const;
  // "h0 3, h1 3, h2 2"
  std::string summary() const;
};

// Reads Open MPI's hostfile syntax: one host a line, `NAME [slots=N]
// [max_slots=N]`, `#` starting a comment, blank lines ignored; a host
// without `slots=` counts one slot (Open MPI would count its cores: the
// launcher writes the slots out, so both agree). Throws hspmd::Error naming
// the file and line ("[flags] --hostfile F:3: slots=x is not a positive
// integer"), or when the file cannot be read or names no host.
Hostfile read_hostfile(const std::string& path);

// Throws hspmd::Error "[flags] --nproc 9 exceeds the 8 slots of --hostfile
// F (h0 3, h1 3, h2 2)" when nproc is not in [1, hostfile.slots()].
void check_hostfile_ranks(const Hostfile& hostfile, int64_t nproc);

// Writes the hosts as "NAME slots=N" lines into `path` (what mpirun reads).
// Throws hspmd::Error when it cannot.
void write_hostfile(const Hostfile& hostfile, const std::string& path);

}  // namespace hspmd::cli
