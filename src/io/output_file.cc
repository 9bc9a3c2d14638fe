#include "hspmd/io/output_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"

namespace hspmd {

namespace fs = std::filesystem;

namespace {

const char* kind_of(fs::file_type t) {
  switch (t) {
    case fs::file_type::regular: return "a regular file";
    case fs::file_type::directory: return "a directory";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::socket: return "a socket";
    default: return "of another kind";
  }
}

// Creates and removes a probe file in `dir`: the one test that covers
// permissions, read-only filesystems and pseudo-filesystems such as /proc.
void probe_directory(const std::string& what, const std::string& path, const fs::path& dir) {
  std::string name = (dir / ".hspmd-probe-XXXXXX").string();
  const int fd = ::mkstemp(name.data());
  if (fd < 0) fail(what, " ", path, ": cannot create a file in ", dir.string(), ": ", std::strerror(errno));
  ::close(fd);
  ::unlink(name.c_str());
}

// What a path names: its device and inode when it exists, else its
// normalized absolute path (the parents' links resolved).
struct FileIdentity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  std::string path;
  bool operator==(const FileIdentity& o) const {
    return exists == o.exists && (exists ? dev == o.dev && ino == o.ino : path == o.path);
  }
};

FileIdentity identity(const std::string& path) {
  FileIdentity id;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    id.exists = true;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
    return id;
  }
  std::error_code ec;
  id.path = fs::weakly_canonical(fs::absolute(path, ec), ec).string();
  if (ec) id.path = fs::absolute(path).lexically_normal().string();
  return id;
}

}  // namespace

void check_outputs_apart(const std::vector<NamedPath>& inputs, const std::vector<NamedPath>& outputs) {
  std::vector<std::pair<const NamedPath*, FileIdentity>> seen;
  for (const NamedPath& in : inputs) {
    if (in.path.empty()) continue;
    FileIdentity id = identity(in.path);
    if (id.exists) seen.emplace_back(&in, std::move(id));
  }
  const size_t n_inputs = seen.size();
  for (const NamedPath& out : outputs) {
    if (out.path.empty()) continue;
    FileIdentity id = identity(out.path);
    for (size_t i = 0; i < seen.size(); ++i) {
      if (!(seen[i].second == id)) continue;
      const NamedPath& other = *seen[i].first;
      if (i < n_inputs)
        fail(options_tag(), " ", out.what, " ", out.path, ": is the same file as ", other.what, " ", other.path,
             "; writing it would destroy that input");
      fail(options_tag(), " ", out.what, " ", out.path, ": is the same file as ", other.what, " ", other.path,
           ", another output");
    }
    seen.emplace_back(&out, std::move(id));
  }
}

void check_replaceable(const std::string& what, const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st) || fs::is_regular_file(st)) return;
  fail(what, " ", path, ": is ", kind_of(st.type()), ", not a regular file; refusing to replace it");
}

void check_output_file(const std::string& what, const std::string& path, OutputWrite how) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::path dir = fs::absolute(path, ec).parent_path();
  if (!fs::is_directory(dir, ec)) fail(what, " ", path, ": directory ", dir.string(), " does not exist");
  const fs::file_status st = fs::status(path, ec);
  if (fs::is_directory(st)) fail(what, " ", path, ": is a directory, not a file");
  if (how == OutputWrite::kRename) check_replaceable(what, path);
  // Opening a FIFO for writing blocks until a reader comes (forever, for a
  // run); a socket cannot be opened at all. Devices (/dev/null) stay allowed.
  if (how == OutputWrite::kStream && (fs::is_fifo(st) || fs::is_socket(st)))
    fail(what, " ", path, ": is ", kind_of(st.type()), ", not a file or device; refusing to block on it");
  if (fs::exists(st) && ::access(path.c_str(), W_OK) != 0)
    fail(what, " ", path, ": not writable: ", std::strerror(errno));
  if (how == OutputWrite::kRename || !fs::exists(st)) probe_directory(what, path, dir);
}

void check_output_directory(const std::string& what, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  while (!fs::exists(fs::status(p, ec)) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  const fs::file_status st = fs::status(p, ec);
  if (!fs::is_directory(st))
    fail(what, " ", path, ": ", p.string(), " is ", kind_of(st.type()), ", not a directory");
  probe_directory(what, path, p);
}

}  // namespace hspmd
