// Open MPI hostfiles (hostfile.h).
#include "hostfile.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "hspmd/core/error.h"

namespace hspmd::cli {

namespace {

// A `key=N` value: a positive integer, else the line's one-line error.
int64_t positive(const std::string& where, const std::string& word, size_t eq) {
  const std::string text = word.substr(eq + 1);
  int64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9' || v > (int64_t{1} << 40)) v = -1;
    if (v < 0) break;
    v = v * 10 + (c - '0');
  }
  if (text.empty() || v <= 0) fail(where, word, " is not a positive integer");
  return v;
}

// One line's host, merged into `out` (slots added for a name seen before).
void add_line(const std::string& where, std::istringstream& words, const std::string& name,
              std::vector<HostSlots>& out) {
  int64_t slots = 1;
  for (std::string word; words >> word;) {
    const size_t eq = word.find('=');
    const std::string key = word.substr(0, eq);
    if (eq == std::string::npos || (key != "slots" && key != "max_slots" && key != "max-slots"))
      fail(where, "'", word, "' is not slots=N or max_slots=N (Open MPI's hostfile syntax: NAME slots=N)");
    const int64_t v = positive(where, word, eq);
    if (key == "slots") slots = v;
  }
  for (HostSlots& h : out)
    if (h.name == name) {
      h.slots += slots;
      return;
    }
  out.push_back({name, slots});
}

}  // namespace

int64_t Hostfile::slots() const {
  int64_t n = 0;
  for (const HostSlots& h : hosts) n += h.slots;
  return n;
}

const std::string& Hostfile::host_of(int64_t rank) const {
  for (const HostSlots& h : hosts) {
    if (rank < h.slots) return h.name;
    rank -= h.slots;
  }
  HSPMD_CHECK(false, "rank beyond the hostfile's ", slots(), " slots");
}

std::string Hostfile::summary() const {
  std::string s;
  for (const HostSlots& h : hosts) s += (s.empty() ? "" : ", ") + h.name + " " + std::to_string(h.slots);
  return s;
}

Hostfile read_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("[flags] --hostfile ", path, ": ", std::strerror(errno));
  Hostfile f;
  f.path = path;
  int lineno = 0;
  for (std::string line; std::getline(in, line);) {
    ++lineno;
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string name;
    if (!(words >> name)) continue;
    add_line("[flags] --hostfile " + path + ":" + std::to_string(lineno) + ": ", words, name, f.hosts);
  }
  if (f.hosts.empty()) fail("[flags] --hostfile ", path, ": names no host (one a line: NAME slots=N)");
  return f;
}

void check_hostfile_ranks(const Hostfile& hostfile, int64_t nproc) {
  if (nproc < 1) fail("[flags] --nproc must be positive, got ", nproc);
  if (nproc > hostfile.slots())
    fail("[flags] --nproc ", nproc, " exceeds the ", hostfile.slots(), " slots of --hostfile ", hostfile.path, " (",
         hostfile.summary(), ")");
}

void write_hostfile(const Hostfile& hostfile, const std::string& path) {
  std::ofstream out(path, std::ios::trunc);
  for (const HostSlots& h : hostfile.hosts) out << h.name << " slots=" << h.slots << "\n";
  out.close();
  if (!out) fail("[launch] cannot write the job's hostfile ", path, ": ", std::strerror(errno));
}

}  // namespace hspmd::cli
