// Checks that an output can be written, made before the work that produces
// it (docs/reliability.md): a run should fail at once, not after its last
// step.
#pragma once

#include <string>
#include <vector>

namespace hspmd {

// How a writer puts its output at a path.
enum class OutputWrite {
  kRename,  // a temporary file beside it, renamed into place (safetensors, token files)
  kStream,  // opened and written in place (logs, traces): a device such as /dev/full is allowed, a FIFO
            // or socket is not (opening a FIFO would block until a reader comes)
};

// Throws hspmd::Error "<what> <path>: <why>" (one line) unless `path` can be
// written as a file by `how`: its directory exists and accepts a new file
// (a probe file is created there and removed), the path is not a directory,
// and an existing path is writable. With kRename, also unless an existing
// path (symbolic links followed) is a regular file: renaming over a device,
// FIFO or socket would replace it. Creates nothing that outlives the call.
// An empty path is accepted (no output).
void check_output_file(const std::string& what, const std::string& path, OutputWrite how);

// Throws hspmd::Error "<what> <path>: <why>" unless `path` is a directory
// that accepts a new file, or does not exist and its nearest existing
// ancestor is one (the writer creates the missing levels). An empty path is
// accepted.
void check_output_directory(const std::string& what, const std::string& path);

// Throws hspmd::Error "<what> <path>: ..." when `path` exists and is not a
// regular file (symbolic links followed): the check a kRename writer makes
// right before it writes.
void check_replaceable(const std::string& what, const std::string& path);

// A file a command reads or writes, and the flag (or role) that names it.
struct NamedPath {
  std::string what;  // e.g. "--data", "input"
  std::string path;
};

// Throws hspmd::Error "[flags] <what> <path>: is the same file as <what'>
// <path'>; writing it would destroy that input" (or "... as <what'> <path'>,
// another output") when an output resolves to an input -- the same inode,
// through any symbolic or hard link -- or two outputs name the same file,
// existing or not (compared by inode, else by their absolute, normalized
// path with existing parents' links resolved). Empty paths and inputs that
// do not exist are skipped (their loaders report them).
void check_outputs_apart(const std::vector<NamedPath>& inputs, const std::vector<NamedPath>& outputs);

}  // namespace hspmd
