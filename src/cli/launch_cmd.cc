// `hspmd launch` (launcher.h): a script's ranks under the launcher.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "flags.h"
#include "hspmd/core/error.h"
#include "launcher.h"

namespace hspmd::cli {

// The directory holding the hspmd Python package (hspmd/__init__.py) for
// this executable: build/python in a build tree (the executable in
// build/src/cli), else python/ beside it or above it; "" when none is.
std::string python_module_dir() {
  const std::string exe = self_executable();
  const std::string dir = exe.substr(0, exe.rfind('/'));
  for (const char* rel : {"/../../python", "/python", "/../python", "/../lib/hspmd/python"}) {
    const std::string candidate = dir + rel;
    if (access((candidate + "/hspmd/__init__.py").c_str(), F_OK) == 0) {
      char real[PATH_MAX];
      return realpath(candidate.c_str(), real) ? std::string(real) : candidate;
    }
  }
  return "";
}

// The interpreter of `hspmd launch --python`, found before any rank starts:
// a missing one would only show as ranks that "exited with code ?". A name
// without a slash is looked up on PATH as mpirun will; a path must be an
// executable file.
namespace {
void check_interpreter(const std::string& python) {
  const std::string what = "[flags] launch --python " + python + ": ";
  if (python.empty()) fail("[flags] launch --python: an empty name (the interpreter that runs the script)");
  if (python.find('/') == std::string::npos) {
    if (find_in_path(python).empty())
      fail(what, "no executable of that name on PATH (give the interpreter's path)");
    return;
  }
  struct stat st {};
  if (stat(python.c_str(), &st) != 0) fail(what, std::strerror(errno), " (the interpreter that runs the script)");
  if (S_ISDIR(st.st_mode)) fail(what, "is a directory, not an interpreter");
  if (!S_ISREG(st.st_mode)) fail(what, "is not a regular file, not an interpreter");
  if (access(python.c_str(), X_OK) != 0) fail(what, "is not executable (", std::strerror(errno), ")");
}
}  // namespace

// The interpreter the hspmd module was built for (its extension imports only
// there), when the build has the module and it is still executable; else
// python3 from PATH.
std::string default_interpreter() {
#ifdef HSPMD_PYTHON_EXECUTABLE
  if (access(HSPMD_PYTHON_EXECUTABLE, X_OK) == 0) return HSPMD_PYTHON_EXECUTABLE;
#endif
  return "python3";
}

namespace {
void print_launch_help() {
  std::printf("usage: hspmd launch [--nproc N] [--hostfile F] [--timeout S] [--max-restarts K] [--python PY]\n"
              "                    script.py [args]\n\n"
              "Runs `PY script.py args` on N MPI ranks under the supervised launcher of hspmd train --nproc\n"
              "(signals forwarded, a dead rank named in one line), PYTHONPATH starting at the hspmd module.\n"
              "  --nproc N         ranks (required without --hostfile; with one, at most its slots, default all)\n"
              "  --hostfile F      run the ranks on these hosts (Open MPI's syntax: NAME slots=N a line;\n"
              "                    docs/multi_host.md)\n"
              "  --timeout S       end the job when a rank's heartbeat stops or no step finishes for S s\n"
              "                    (Trainer steps; default: no watchdog)\n"
              "  --max-restarts K  when a rank dies of a signal, run the script again from its start, at most\n"
              "                    K times (default 0)\n"
              "  --python PY       the interpreter (default: the one the hspmd module was built for, %s)\n",
              default_interpreter().c_str());
}
}  // namespace

int launch_command(const std::vector<std::string>& args) {
  LaunchOptions o;
  o.timeout_s = 0;  // the watchdog only with --timeout: a script's steps are its own
  std::string python = default_interpreter();
  bool nproc_given = false;
  size_t i = 0;
  const auto value = [&](const std::string& flag) -> std::string {
    const std::string& a = args[i];
    if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) return a.substr(flag.size() + 1);
    if (++i >= args.size()) fail("[flags] ", flag, " needs a value");
    return args[i];
  };
  const auto number = [](const std::string& flag, const std::string& text) {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !std::isfinite(v)) fail("[flags] ", flag, ": '", text, "' is not a number");
    return v;
  };
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      print_launch_help();
      return 0;
    }
    if (a.rfind("--nproc", 0) == 0) {
      o.nproc = parse_int("nproc", value("--nproc"));  // the one integer parser (no "1e3")
      nproc_given = true;
    } else if (a.rfind("--hostfile", 0) == 0) {
      o.hostfile = read_hostfile(value("--hostfile"));
    } else if (a.rfind("--max-restarts", 0) == 0) {
      o.max_restarts = parse_int("max-restarts", value("--max-restarts"));
      check_max_restarts(o.max_restarts);
    } else if (a.rfind("--timeout", 0) == 0) {
      o.timeout_s = number("--timeout", value("--timeout"));
      if (o.timeout_s <= 0) fail("[flags] --timeout must be positive, got ", o.timeout_s);
    } else if (a.rfind("--python", 0) == 0) {
      python = value("--python");
    } else if (a.rfind("-", 0) == 0) {
      fail("[flags] launch: unknown flag '", a, "' (flags go before the script; see hspmd launch --help)");
    } else {
      break;
    }
  }
  if (o.hostfile.hosts.empty()) {
    if (!nproc_given) fail("[flags] launch: --nproc N is required (or --hostfile F)");
    check_local_ranks("[flags] --nproc", o.nproc, 1);  // the one bound on local ranks
  } else {
    if (!nproc_given) o.nproc = o.hostfile.slots();
    check_hostfile_ranks(o.hostfile, o.nproc);
  }
  check_interpreter(python);
  if (i >= args.size()) fail("[flags] launch: no script given (hspmd launch --nproc N script.py [args])");
  const std::string& script = args[i];
  if (access(script.c_str(), R_OK) != 0) fail("[flags] launch: ", script, ": ", std::strerror(errno));
  o.command = {python, script};
  o.rank_args.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  if (const std::string dir = python_module_dir(); !dir.empty()) {
    const char* old = std::getenv("PYTHONPATH");
    setenv("PYTHONPATH", (old && *old ? dir + ":" + old : dir).c_str(), 1);
  }
  return launch_ranks(o);
}

}  // namespace hspmd::cli
