// CUDA MPS partitions for a job's ranks (mps.h).
#include "mps.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <thread>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "hspmd/core/error.h"

extern char** environ;

namespace hspmd::cli {
namespace {

// Waits for child `pid` at most `timeout_s` seconds (< 0: no limit), then
// kills it; its exit code, -1 when it was killed or could not be waited.
int wait_child(pid_t pid, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, timeout_s < 0 ? 0 : WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0 && errno != EINTR) return -1;  // not our child any more (ECHILD): nothing to wait for
    if (r == 0 && std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      return -1;
    }
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Runs `argv` with `input` on its stdin; its exit code (-1: not started,
// killed, or still running after `timeout_s` seconds, when it is killed).
int run(const std::vector<std::string>& argv, const std::string& input, double timeout_s = -1) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_adddup2(&files, fds[0], STDIN_FILENO);
  posix_spawn_file_actions_addclose(&files, fds[1]);
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, cargv[0], &files, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  close(fds[0]);
  if (rc == 0 && !input.empty()) {
    const ssize_t n = write(fds[1], input.data(), input.size());
    (void)n;
  }
  close(fds[1]);
  if (rc != 0) return -1;
  return wait_child(pid, timeout_s);
}

// The guardian: a shell in a session of its own that waits for this process
// to end, then sends the daemon "quit" and removes its directory. It is
// what stops the daemon when this process is killed outright (SIGKILL, a
// `timeout` that kills the process group) and no destructor runs; after a
// normal stop the destructor kills it first. Returns its pid (0 if it could
// not start: the daemon is then stopped only by the destructor).
pid_t start_guardian(const std::string& control, const std::string& dir) {
  const std::string script =
      "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; echo quit | \"$2\" >/dev/null 2>&1; rm -rf \"$3\"";
  const std::string parent = std::to_string(getpid());
  std::vector<std::string> argv = {"/bin/sh", "-c", script, "hspmd-mps-guardian", parent, control, dir};
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  // Not the launcher's stdin, stdout or stderr: a pipe a caller reads to
  // its end must not stay open for the guardian's sake.
  posix_spawn_file_actions_addopen(&files, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&files, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, cargv[0], &files, &attr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  return rc == 0 ? pid : 0;
}

}  // namespace

std::vector<int> parse_mps_percents(const std::string& text, int64_t nproc, Device device) {
  if (device.type != DeviceType::CUDA && !(device == Device::host_double()))
    fail("[flags] --mps-percent partitions a GPU: it needs --device cuda:N (or the test double cpu:1)");
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > 100)
      fail("[flags] --mps-percent: '", item, "' is not a percentage of the SMs in [1, 100]");
    out.push_back(static_cast<int>(v));
  }
  if (static_cast<int64_t>(out.size()) != nproc)
    fail("[flags] --mps-percent gives ", out.size(), " percentages for --nproc ", nproc, " ranks (one per rank)");
  return out;
}

MpsDaemon::MpsDaemon(const std::vector<int>& percents) {
  const char* control = std::getenv("HSPMD_MPS_CONTROL");
  control_ = control && *control ? control : "nvidia-cuda-mps-control";
  char tmpl[] = "/tmp/hspmd-mps-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) fail("[launch] --mps-percent: cannot make a directory for the MPS daemon");
  dir_ = tmpl;
  std::filesystem::create_directories(dir_ + "/pipe");
  std::filesystem::create_directories(dir_ + "/log");
  std::string list;
  for (int p : percents) list += (list.empty() ? "" : ",") + std::to_string(p);
  setenv("CUDA_MPS_PIPE_DIRECTORY", (dir_ + "/pipe").c_str(), 1);
  setenv("CUDA_MPS_LOG_DIRECTORY", (dir_ + "/log").c_str(), 1);
  setenv("HSPMD_MPS_PERCENTS", list.c_str(), 1);
  const int rc = run({control_, "-d"}, "");
  if (rc != 0) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
    fail("[launch] --mps-percent: cannot start the MPS daemon '", control_, " -d' (",
         rc < 0 ? "not found or killed" : "exit code " + std::to_string(rc),
         "; it needs a CUDA driver with MPS, run as the GPU's user)");
  }
  guardian_ = start_guardian(control_, dir_);
}

MpsDaemon::~MpsDaemon() {
  if (guardian_ > 0) {  // the stop below is this process's own
    kill(guardian_, SIGKILL);
    wait_child(guardian_, 5);
  }
  // "quit" may wait for the daemon's clients, this process among them when
  // it used the GPU itself (`hspmd profile --mps-percent`): the daemon has
  // the command once the control program ran, so at most 10 s here, and it
  // ends when its last client does.
  if (run({control_}, "quit\n", 10) != 0)
    std::fprintf(stderr, "hspmd: warning: [launch] the MPS daemon (pipe %s/pipe) did not take 'quit' within 10 s\n",
                 dir_.c_str());
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
  unsetenv("HSPMD_MPS_PERCENTS");
}

void apply_mps_partition() {
  const char* list = std::getenv("HSPMD_MPS_PERCENTS");
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (list == nullptr || rank == nullptr) return;
  std::stringstream in(list);
  std::string item;
  for (int r = 0; std::getline(in, item, ','); ++r)
    if (r == std::atoi(rank)) {
      setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", item.c_str(), 1);
      return;
    }
}

}  // namespace hspmd::cli
