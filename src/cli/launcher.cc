// The --nproc launcher and the ranks' watcher threads (launcher.h).
#include "launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>

#include "flags.h"
#include "hspmd/core/error.h"
#include "hspmd/train/trainer.h"
#include "restart.h"

extern char** environ;

namespace hspmd::cli {

// One rank's heartbeat, in a file both the launcher and the rank map.
struct Slot {
  std::atomic<int64_t> pid;
  std::atomic<int64_t> alive_ns;  // the watcher thread's last tick (monotonic clock)
  std::atomic<int64_t> steps;     // the last finished step + 1
  std::atomic<int64_t> step_ns;   // when it finished
};

namespace {

constexpr double kKillAfterS = 10;  // SIGKILL what is left this long after SIGTERM
constexpr double kWedgedS = 10;     // mpirun ends a job about 1 s after a rank's death

volatile sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

std::string job_file(const std::string& dir, const char* name) { return dir + "/" + name; }

void remove_job_dir(const std::string& dir) {
  for (const char* name : {"alive", "heartbeat", "report", "exit", "hostfile"}) unlink(job_file(dir, name).c_str());
  rmdir(dir.c_str());
}

// The launcher's side of the job directory.
class JobDir {
 public:
  explicit JobDir(int nproc) : nproc_(nproc) {
    char tmpl[] = "/tmp/hspmd-job-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) fail("[launch] cannot create a job directory in /tmp: ", std::strerror(errno));
    dir_ = tmpl;
    const std::string fifo = job_file(dir_, "alive");
    if (mkfifo(fifo.c_str(), 0600) != 0) fail("[launch] cannot create ", fifo, ": ", std::strerror(errno));
    fifo_ = open(fifo.c_str(), O_RDWR | O_CLOEXEC);  // O_RDWR: opening never blocks
    const int fd = open(job_file(dir_, "heartbeat").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    bytes_ = sizeof(Slot) * static_cast<size_t>(nproc);
    if (fifo_ < 0 || fd < 0 || ftruncate(fd, static_cast<off_t>(bytes_)) != 0)
      fail("[launch] cannot set up the job directory ", dir_);
    map_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map_ == MAP_FAILED) fail("[launch] cannot map ", dir_, "/heartbeat");
  }
  ~JobDir() {
    munmap(map_, bytes_);
    close(fifo_);
    remove_job_dir(dir_);
  }
  const std::string& dir() const { return dir_; }
  int nproc() const { return nproc_; }
  const Slot& slot(int r) const { return static_cast<const Slot*>(map_)[r]; }
  bool reported() const { return access(job_file(dir_, "report").c_str(), F_OK) == 0; }
  // The first rank that exited with a failure while MPI was up, and its
  // exit status, as it left them in `exit` before its MPI_Abort
  // (mpi_communicator.cc); false when none did.
  bool failed_exit(int& rank, int& code) const {
    FILE* f = std::fopen(job_file(dir_, "exit").c_str(), "r");
    if (f == nullptr) return false;
    const bool ok = std::fscanf(f, "%d %d", &rank, &code) == 2;
    std::fclose(f);
    return ok;
  }
  // The line the reporting rank printed, as it left it with its claim.
  std::string report() const {
    std::string text;
    if (FILE* f = std::fopen(job_file(dir_, "report").c_str(), "r")) {
      char chunk[512];
      for (size_t n; (n = std::fread(chunk, 1, sizeof chunk, f)) > 0;) text.append(chunk, n);
      std::fclose(f);
    }
    return text;
  }

 private:
  int nproc_;
  std::string dir_;
  int fifo_ = -1;
  void* map_ = nullptr;
  size_t bytes_ = 0;
};

// What mpirun said about the first rank that failed.
struct RankFailure {
  int rank = -1, signal = 0, exit_code = -1;
  std::string signal_name, node;  // node: the host mpirun named, when it did
};

// Relays mpirun's stderr (the ranks' output) line by line, leaving out Open
// MPI's help banners (blocks between dashed lines) and parsing from them
// which rank failed and how.
class StderrRelay {
 public:
  explicit StderrRelay(int fd) : fd_(fd), thread_([this] { run(); }) {}
  ~StderrRelay() {
    finish(0);
    close(fd_);
  }
  // Waits for mpirun's last words (at most `s` seconds more once mpirun has
  // exited: orphaned ranks may hold the pipe) and says which rank failed.
  RankFailure finish(double s) {
    if (thread_.joinable()) {
      deadline_ns_ = now_ns() + static_cast<int64_t>(s * 1e9);
      stop_ = true;
      thread_.join();
    }
    return failure_;
  }
  // Whether a rank's "hspmd: error:" line went through (after finish()).
  bool relayed_error() const { return relayed_error_; }

 private:
  void run() {
    std::string buf;
    char chunk[4096];
    while (!stop_ || now_ns() < deadline_ns_) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = read(fd_, chunk, sizeof(chunk));
      if (n <= 0) break;
      buf.append(chunk, static_cast<size_t>(n));
      for (size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) line(buf.substr(0, nl));
    }
    if (!buf.empty()) line(buf);
  }
  void line(const std::string& l) {
    if (l.size() >= 10 && l.find_first_not_of('-') == std::string::npos) {
      in_banner_ = !in_banner_;
      return;
    }
    // A banner's dashes glued to the end of a line another process wrote
    // without its newline ("... (104)-----..."): that line, then the dashes.
    const size_t text_end = l.find_last_not_of('-');
    if (text_end != std::string::npos && l.size() - text_end - 1 >= 10) {
      line(l.substr(0, text_end + 1));
      return line(l.substr(text_end + 1));
    }
    if (in_banner_) return parse(l);
    // mpirun's account of a rank's death, wherever it lands.
    if (l.find("mpirun noticed that process rank ") != std::string::npos) parse(l);
    // Open MPI's own runtime lines ("[host:pid] ... help message", "MCA
    // parameter", "[host:pid] [[job,0],0] ORTE_ERROR_LOG: ..." as it tears
    // down an aborted job) are its noise, not the ranks' words.
    if (l.rfind("[", 0) == 0 &&
        (l.find("help message") != std::string::npos || l.find("MCA parameter") != std::string::npos ||
         l.find("_ERROR_LOG") != std::string::npos || l.find("PMIX ERROR") != std::string::npos))
      return;
    // libevent's warnings inside Open MPI ("[warn] Epoll MOD(1) on fd 12
    // failed. ... Bad file descriptor") when ranks vanish at an abort.
    if (l.rfind("[warn] ", 0) == 0) return;
    // Its shared-memory transport reading from a rank that just died ("[host:pid]
    // Read -1, expected 8192, errno = 3").
    if (l.rfind("[", 0) == 0 && l.find("] Read -1, expected ") != std::string::npos) return;
    // Its TCP transport reading from a rank on another host that just died
    // ("[host][[job,1],R][.../btl_tcp.c:559:mca_btl_tcp_recv_blocking] recv(20)
    // failed: Connection reset by peer (104)").
    if (l.rfind("[", 0) == 0 && l.find("btl_tcp") != std::string::npos) return;
    // Its rsh launcher when the agent (scripts/netns_cluster.sh rsh) runs in
    // a process group of its own: "[host:pid] plm:rsh: Warning: setpgid(...)".
    if (l.rfind("[", 0) == 0 && l.find("] plm:rsh: Warning: setpgid") != std::string::npos) return;
    if (l.rfind("hspmd: ", 0) == 0 && l.find("error: ") != std::string::npos) relayed_error_ = true;
    std::fprintf(stderr, "%s\n", l.c_str());
  }
  void parse(const std::string& l) {
    if (failure_.rank >= 0 && failure_.exit_code < 0 && failure_.signal == 0) {
      const char* code = std::strstr(l.c_str(), "Exit code:");
      if (code) std::sscanf(code, "Exit code: %d", &failure_.exit_code);
      // MPI_Abort's banner: "with errorcode C." on the line after the rank.
      if (const char* err = std::strstr(l.c_str(), "with errorcode "))
        std::sscanf(err, "with errorcode %d", &failure_.exit_code);
    }
    if (failure_.rank >= 0) return;
    // A rank that exits with a failure under the launcher calls MPI_Abort
    // with its exit status (mpi_communicator.cc): "MPI_ABORT was invoked on
    // rank R in communicator MPI_COMM_WORLD".
    if (const char* abort = std::strstr(l.c_str(), "MPI_ABORT was invoked on rank "))
      if (std::sscanf(abort, "MPI_ABORT was invoked on rank %d", &failure_.rank) == 1) return;
    char name[64] = {0}, node[256] = {0};
    const char* p = std::strstr(l.c_str(), "process rank ");
    if (p && std::sscanf(p, "process rank %d with PID %*d on node %255s exited on signal %d (%63[^)])",
                         &failure_.rank, node, &failure_.signal, name) >= 3) {
      failure_.signal_name = name;
      failure_.node = node;
      return;
    }
    p = std::strstr(l.c_str(), "Process name: [[");
    if (p && std::sscanf(p, "Process name: [[%*d,%*d],%d]", &failure_.rank) != 1) failure_.rank = -1;
  }

  int fd_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> deadline_ns_{0};
  bool in_banner_ = false;
  bool relayed_error_ = false;
  RankFailure failure_;
  std::thread thread_;
};

// "rank R", and " on host H" under a hostfile (the host its slot is on).
std::string rank_label(int64_t rank, const Hostfile& hostfile) {
  std::string name = "rank " + std::to_string(rank);
  if (!hostfile.hosts.empty() && rank >= 0 && rank < hostfile.slots()) name += " on host " + hostfile.host_of(rank);
  return name;
}

// Why the job is stuck, or "" while it makes progress: a rank whose watcher
// thread stopped ticking (stopped by SIGSTOP, frozen), or no step finished
// within the allowance (3 x timeout, at least 120 s, for setup and step 0).
std::string stalled(const JobDir& job, int64_t start_ns, double timeout_s, const Hostfile& hostfile) {
  const int64_t now = now_ns(), limit = static_cast<int64_t>(timeout_s * 1e9);
  int64_t latest = 0, fewest = INT64_MAX;
  int slowest = 0;
  for (int r = 0; r < job.nproc(); ++r) {
    const Slot& s = job.slot(r);
    const int64_t alive = s.alive_ns.load();
    if (alive != 0 && now - alive > limit)
      return rank_label(r, hostfile) + " (pid " + std::to_string(s.pid.load()) + ") stopped responding: no " +
             "heartbeat for " + std::to_string(static_cast<int>((now - alive) / 1000000000)) +
             " s (stopped, e.g. by SIGSTOP, or frozen)";
    latest = std::max(latest, s.step_ns.load());
    if (s.steps.load() < fewest) fewest = s.steps.load(), slowest = r;
  }
  const int64_t allowance = latest ? limit : std::max(3 * limit, int64_t{120} * 1000000000);
  const int64_t since = now - (latest ? latest : start_ns);
  if (since <= allowance) return "";
  const int64_t secs = since / 1000000000;
  if (job.slot(slowest).alive_ns.load() == 0)
    return rank_label(slowest, hostfile) + " did not start within " + std::to_string(secs) + " s";
  return "no step finished for " + std::to_string(secs) + " s (--timeout " + std::to_string(timeout_s) +
         "); " + rank_label(slowest, hostfile) + " is the furthest behind, in step " + std::to_string(fewest);
}

void kill_ranks(const JobDir& job, int sig) {
  for (int r = 0; r < job.nproc(); ++r)
    if (const int64_t pid = job.slot(r).pid.load(); pid > 0) kill(static_cast<pid_t>(pid), sig);
}

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}


// mpirun's options for the hosts of `hostfile` (written to `path`): slots
// filled in order, TCP between hosts and shared memory within one, and the
// launcher's HSPMD_* variables for ranks that another host's daemon starts
// (a local mpirun's children inherit them anyway).
std::vector<std::string> host_options(const Hostfile& hostfile, const std::string& path) {
  write_hostfile(hostfile, path);
  std::vector<std::string> argv = {"--hostfile", path, "--map-by", "slot", "--mca", "btl", "self,vader,tcp"};
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, "HSPMD_", 6) == 0) {
      const std::string var(*e);
      argv.insert(argv.end(), {"-x", var.substr(0, var.find('='))});
    }
  return argv;
}

pid_t spawn_mpirun(const LaunchOptions& o, const std::vector<std::string>& args, const std::string& job_dir,
                   int err_fd) {
  // When a rank dies, mpirun SIGTERMs the others and by default waits 1 s
  // before SIGKILL; the ranks have no SIGTERM handler, so that second only
  // delays the job's end (and a restart).
  std::vector<std::string> argv = {"mpirun", "--allow-run-as-root", "--mca", "odls_base_sigkill_timeout", "0",
                                   "-np", std::to_string(o.nproc)};
  if (o.hostfile.hosts.empty()) {
    argv.push_back("--oversubscribe");
  } else {
    const std::vector<std::string> hosts = host_options(o.hostfile, job_file(job_dir, "hostfile"));
    argv.insert(argv.end(), hosts.begin(), hosts.end());
  }
  if (o.command.empty()) {
    argv.insert(argv.end(), {self_executable(), "train"});
  } else {
    if (std::getenv("PYTHONPATH")) argv.insert(argv.end(), {"-x", "PYTHONPATH"});
    argv.insert(argv.end(), o.command.begin(), o.command.end());
  }
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const std::string path = find_in_path("mpirun");
  if (path.empty()) fail("[launch] cannot start mpirun (is Open MPI installed?)");
  // Its own process group (a terminal's ^C reaches the launcher only, which
  // forwards it), stdin from /dev/null (a background group reading the
  // terminal would stop), stderr into the relay. And SIGTERM when the
  // launcher dies, however (PR_SET_PDEATHSIG; even SIGKILL): mpirun then
  // ends every rank, whatever the rank is doing -- a Python rank that has not
  // reached hspmd.world() has no watcher thread of its own (issue 39 item 10).
  // fork, not posix_spawn, for the prctl; the child calls only
  // async-signal-safe functions before execve.
  const pid_t launcher = getpid();
  const int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) fail("[launch] cannot open /dev/null: ", std::strerror(errno));
  sigset_t none;
  sigemptyset(&none);
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != launcher) _exit(127);  // already gone
    dup2(devnull, 0);
    dup2(err_fd, 2);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(path.c_str(), cargv.data(), environ);
    _exit(127);
  }
  close(devnull);
  if (pid < 0) fail("[launch] cannot start mpirun: ", std::strerror(errno));
  setpgid(pid, pid);  // also here: no signal to the group may race the child's own call
  return pid;
}

// "rank R", and " on host H" when the job runs on hosts of a hostfile (the
// host Open MPI named, else the one the slots give).
std::string rank_name(const RankFailure& f, const Hostfile& hostfile) {
  if (!hostfile.hosts.empty() && !f.node.empty()) return "rank " + std::to_string(f.rank) + " on host " + f.node;
  return rank_label(f.rank, hostfile);
}

std::string describe(const RankFailure& f, int status, const Hostfile& hostfile) {
  if (f.rank >= 0 && f.signal > 0)
    return rank_name(f, hostfile) + " was killed by signal " + std::to_string(f.signal) + " (" + f.signal_name + ")";
  if (f.rank >= 0)
    return rank_name(f, hostfile) + " exited with code " +
           (f.exit_code >= 0 ? std::to_string(f.exit_code) : std::string("?")) + " without a message";
  if (WIFSIGNALED(status)) return "mpirun was killed by signal " + std::to_string(WTERMSIG(status));
  const int code = WEXITSTATUS(status);
  if (code > 128) return "a rank was killed by signal " + std::to_string(code - 128);
  return "mpirun exited with code " + std::to_string(code);
}

// The state letter and parent of process `pid` from /proc/PID/stat; false
// when it is gone.
bool process_state(int64_t pid, char& state, int64_t& ppid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[512];
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the command name may hold anything
  long long parent = 0;
  if (paren == nullptr || std::sscanf(paren + 1, " %c %lld", &state, &parent) != 2) return false;
  ppid = parent;
  return true;
}

// Whether the process `pid` has ended (gone, or a zombie not yet reaped).
bool process_gone(int64_t pid) {
  char state = 0;
  int64_t ppid = 0;
  return !process_state(pid, state, ppid) || state == 'Z' || state == 'X';
}

// Whether a child of `parent` is a zombie: a rank that died and that mpirun
// has not reaped, which it does within milliseconds unless it hangs (ranks
// killed before they write their heartbeat slot are only seen this way).
bool zombie_child(pid_t parent) {
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return false;
  bool found = false;
  for (const dirent* e; !found && (e = readdir(proc)) != nullptr;) {
    char state = 0;
    int64_t ppid = 0;
    if (std::isdigit(static_cast<unsigned char>(e->d_name[0])) &&
        process_state(std::atoll(e->d_name), state, ppid) && ppid == parent)
      found = state == 'Z';
  }
  closedir(proc);
  return found;
}

// How one run of mpirun (an attempt) ended.
struct AttemptEnd {
  int status = 0;          // mpirun's wait status
  RankFailure failure;     // what mpirun said about the first rank that failed
  bool watchdog = false;   // the watchdog ended it
  int stopped_by = 0;      // SIGINT or SIGTERM to the launcher
  bool reported = false;   // a rank printed its own error
  std::string lost_report; // ... whose line mpirun did not relay (it was lost)
  std::string report;      // the job's report (claim_report), relayed or not
  int64_t death_ns = 0;    // when a rank was first seen gone (0: none was)
  int dead_rank = -1;      // which (-1: unknown, a zombie child of mpirun)
  bool wedged = false;     // mpirun outlived that death by kWedgedS: the launcher ended it
  int64_t end_ns = 0;      // when mpirun and its ranks were gone

  bool succeeded() const { return stopped_by == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
  // A crash, which --max-restarts restarts: a rank (or mpirun) died of a
  // signal. A rank's own error exits with a code (MPI_Abort or return 1).
  bool crashed() const {
    if (succeeded() || watchdog || stopped_by != 0) return false;
    if (wedged) return !reported;
    if (failure.signal > 0 || WIFSIGNALED(status)) return true;
    return failure.rank < 0 && WIFEXITED(status) && WEXITSTATUS(status) > 128;  // mpirun's 128 + signal
  }
  // What failed, for the one-line message and the restart record.
  std::string why(const Hostfile& hostfile) const {
    if (!wedged) return describe(failure, status, hostfile);
    RankFailure dead;
    dead.rank = dead_rank;
    return (dead_rank >= 0 ? rank_name(dead, hostfile) : std::string("a rank")) +
           " ended but mpirun had not ended the job " + std::to_string(static_cast<int>(kWedgedS)) + " s later";
  }
};

// Notes the first rank seen gone: the time a restart's recovery counts
// from. mpirun normally ends the job a few tens of milliseconds later.
void note_death(const JobDir& job, int64_t now, AttemptEnd& end) {
  for (int r = 0; r < job.nproc() && end.death_ns == 0; ++r)
    if (const int64_t p = job.slot(r).pid.load(); p > 0 && process_gone(p)) end.death_ns = now, end.dead_rank = r;
}

// What a restarted attempt waits for: its first finished step.
struct FirstStepWatch {
  bool armed = false;
  std::function<void(int64_t)> seen;  // gets the step's end (monotonic ns)
};

void watch_first_step(const JobDir& job, FirstStepWatch& watch) {
  if (!watch.armed) return;
  const Slot& s = job.slot(0);  // rank 0 writes the step's log record before it reports the step
  if (s.steps.load() == 0) return;
  watch.armed = false;
  const int64_t done = s.step_ns.load();
  watch.seen(done > 0 ? done : now_ns());
}

// Runs mpirun with `args` under the watchdog until it and its ranks end.
AttemptEnd run_attempt(const LaunchOptions& o, const std::vector<std::string>& args, FirstStepWatch& watch) {
  JobDir job(static_cast<int>(o.nproc));
  setenv("HSPMD_JOB_DIR", job.dir().c_str(), 1);
  setenv("HSPMD_LAUNCHER_PID", std::to_string(getpid()).c_str(), 1);
  setenv("HSPMD_LAUNCHER_HOST", host_name().c_str(), 1);
  int err[2];
  if (pipe2(err, O_CLOEXEC) != 0) fail("[launch] cannot create a pipe: ", std::strerror(errno));
  const pid_t pid = spawn_mpirun(o, args, job.dir(), err[1]);
  close(err[1]);
  StderrRelay relay(err[0]);
  const int64_t start = now_ns();
  int64_t kill_at = 0, next_check = start, next_scan = start;
  AttemptEnd end;
  while (waitpid(pid, &end.status, WNOHANG) == 0) {
    const int64_t now = now_ns();
    note_death(job, now, end);
    if (end.death_ns == 0 && now >= next_scan) {
      next_scan = now + 1000000000;
      if (zombie_child(pid)) end.death_ns = now;
    }
    watch_first_step(job, watch);
    if (end.death_ns != 0 && kill_at == 0 && now - end.death_ns > static_cast<int64_t>(kWedgedS * 1e9)) {
      end.wedged = true;  // seen with Open MPI 4.1 when a rank dies during MPI_Init
      kill_at = now;
    }
    if (g_signal != 0 && end.stopped_by == 0 && !end.watchdog) {
      end.stopped_by = g_signal;
      kill(pid, SIGTERM);  // mpirun ends its ranks (SIGCONT, SIGTERM, SIGKILL)
      kill_at = now + static_cast<int64_t>(kKillAfterS * 1e9);
    }
    if (o.timeout_s > 0 && kill_at == 0 && now >= next_check) {
      next_check = now + 250000000;
      if (const std::string why = stalled(job, start, o.timeout_s, o.hostfile); !why.empty()) {
        std::fprintf(stderr, "hspmd: error: [watchdog] %s; ending the job\n", why.c_str());
        end.watchdog = true;
        kill(pid, SIGTERM);
        kill_at = now + static_cast<int64_t>(3e9);
      }
    }
    if (kill_at != 0 && now >= kill_at) {
      kill_ranks(job, SIGKILL);
      kill(pid, SIGKILL);
      kill_at = INT64_MAX;
    }
    usleep(20000);
  }
  note_death(job, now_ns(), end);  // mpirun may end within one poll of the death
  watch_first_step(job, watch);
  // Ranks mpirun left behind (it was killed, or it failed to end them) get
  // SIGKILL, so that none of this attempt outlives it (a restart needs the
  // outputs' locks free).
  if (!end.succeeded()) kill_ranks(job, SIGKILL);
  for (int r = 0; r < job.nproc(); ++r) {
    const int64_t p = job.slot(r).pid.load();
    for (int k = 0; p > 0 && k < 250 && !process_gone(p); ++k) usleep(20000);
  }
  end.failure = relay.finish(2);
  // A rank's own record of its failing exit names it even when mpirun's
  // banner was not relayed (seen: "mpirun exited with code 3").
  if (int rank = -1, code = -1; end.failure.signal == 0 && job.failed_exit(rank, code)) {
    end.failure.rank = rank;
    end.failure.exit_code = code;
  }
  end.reported = job.reported();
  if (end.reported) end.report = job.report();
  if (end.reported && !relay.relayed_error()) end.lost_report = end.report;
  end.end_ns = now_ns();
  return end;
}

// The job's last words when it is not restarted; returns its exit code.
int give_up(const AttemptEnd& end, int64_t restarts, const LaunchOptions& o) {
  if (!end.lost_report.empty()) std::fprintf(stderr, "%s\n", end.lost_report.c_str());
  if (end.watchdog || end.reported) return 1;  // already said
  std::string after;
  if (restarts > 0)
    after = " (after " + std::to_string(restarts) + (restarts == 1 ? " restart" : " restarts") +
            ", --max-restarts " + std::to_string(o.max_restarts) + ")";
  std::fprintf(stderr, "hspmd: error: [launch] %s; the job was ended%s\n", end.why(o.hostfile).c_str(),
               after.c_str());
  return 1;
}

}  // namespace

// The executable `name` as execvp would find it on PATH; "" when none is.
std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  for (size_t start = 0; start <= dirs.size();) {
    size_t colon = dirs.find(':', start);
    if (colon == std::string::npos) colon = dirs.size();
    const std::string dir = colon > start ? dirs.substr(start, colon - start) : ".";
    const std::string candidate = dir + "/" + name;
    struct stat st {};
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(candidate.c_str(), X_OK) == 0)
      return candidate;
    start = colon + 1;
  }
  return "";
}

std::string self_executable() {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) fail("[launch] cannot find the hspmd executable");
  self[n] = '\0';
  return self;
}

void check_max_restarts(int64_t k) {
  if (k < 0) fail("[flags] --max-restarts must be >= 0, got ", k);
}

int64_t max_local_ranks() { return 32 * static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency())); }

void check_local_ranks(const std::string& what, int64_t n, int64_t least) {
  const int64_t most = max_local_ranks();
  if (n < least || n > most)
    fail(what, " ", n, " must lie in [", least, ", ", most,
         "] on this machine (32 per core: each rank is a process here)");
}

// The number of ranks that `hostfile` maps onto `host` among `nproc`.
int64_t ranks_on(const Hostfile& hostfile, int64_t nproc, const std::string& host) {
  int64_t n = 0;
  for (int64_t r = 0; r < nproc; ++r) n += hostfile.host_of(r) == host;
  return n;
}

// After the heartbeat ended the job naming host `gone`: the restart on the
// other hosts under a strategy re-planned for them, from the last
// checkpoint (`o` and `args` changed for it). -1: go on with it; else the
// job's exit code.
int restart_without_host(LaunchOptions& o, std::vector<std::string>& args, const AttemptEnd& end,
                         const std::string& gone, int64_t restarts, const std::string& run_id, RestartLog& log,
                         FirstStepWatch& watch) {
  if (!end.lost_report.empty()) std::fprintf(stderr, "%s\n", end.lost_report.c_str());
  const Hostfile left = without_host(o.hostfile, gone);
  const int64_t nproc = std::min(o.nproc - ranks_on(o.hostfile, o.nproc, gone), left.slots());
  const std::string strategy = o.checkpoint_dir + "/strategy-restart-" + std::to_string(restarts + 1) + ".json";
  RestartPoint point;
  try {
    if (nproc < 1) fail("[launch] no rank left without host ", gone);
    point = find_restart_point(o.checkpoint_dir, o.resume_dir, run_id);
    replan_for_hosts(o.replan, left, nproc, strategy);
  } catch (const Error& e) {
    std::fprintf(stderr, "hspmd: error: [launch] host %s was lost; cannot restart without it: %s\n", gone.c_str(),
                 e.what());
    return 1;
  }
  std::fprintf(stderr,
               "hspmd: warning: [launch] host %s was lost; restarting without it on the %lld ranks of hosts %s "
               "under the re-planned strategy %s, from %s (restart %lld of --max-restarts %lld)\n",
               gone.c_str(), static_cast<long long>(nproc), left.summary().c_str(), strategy.c_str(),
               point.resume_dir.empty() ? "the start"
                                        : ("the checkpoint of step " + std::to_string(point.step)).c_str(),
               static_cast<long long>(restarts + 1), static_cast<long long>(o.max_restarts));
  const int64_t died = end.death_ns != 0 ? end.death_ns : end.end_ns;
  log.begin(restarts + 1, point.step, "host " + gone + " lost (heartbeat)",
            end.death_ns != 0 ? (end.end_ns - died) * 1e-9 : -1);
  o.hostfile = left;
  o.nproc = nproc;
  o.replan.strategy_path = strategy;
  args = with_resume(with_strategy(args, strategy), point.resume_dir);
  o.rank_args = with_strategy(o.rank_args, strategy);
  watch.armed = true;
  watch.seen = [&log, died](int64_t done) { log.set_recovery((done - died) * 1e-9); };
  if (g_signal != 0) {
    std::fprintf(stderr, "hspmd: error: [launch] %s: the job was not restarted\n",
                 g_signal == SIGINT ? "SIGINT" : "SIGTERM");
    return 128 + g_signal;
  }
  return -1;
}

int launch_ranks(const LaunchOptions& options) {
  LaunchOptions o = options;  // a restart without a lost host changes the hosts, the ranks, the strategy
  if (o.hostfile.hosts.empty()) check_local_ranks("[flags] --nproc", o.nproc, 1);
  else check_hostfile_ranks(o.hostfile, o.nproc);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  RestartLog log(o.max_restarts > 0 ? o.log_path : "");
  // One id for the job's every attempt: its ranks stamp it into the
  // checkpoints they commit, and a restart resumes only those.
  const std::string run_id = new_run_id();
  setenv("HSPMD_RUN_ID", run_id.c_str(), 1);
  std::vector<std::string> args = o.rank_args;
  FirstStepWatch watch;
  for (int64_t restarts = 0;; ++restarts) {
    const AttemptEnd end = run_attempt(o, args, watch);
    log.end();
    if (end.stopped_by != 0) {
      std::fprintf(stderr, "hspmd: error: [launch] %s: ended the job's %lld ranks\n",
                   end.stopped_by == SIGINT ? "SIGINT" : "SIGTERM", static_cast<long long>(o.nproc));
      return 128 + end.stopped_by;
    }
    if (end.succeeded()) return 0;
    const std::string gone = lost_host(end.report);
    if (!gone.empty() && restarts < o.max_restarts && !o.replan.strategy_path.empty() && o.command.empty() &&
        o.hostfile.hosts.size() > 1) {
      if (const int code = restart_without_host(o, args, end, gone, restarts, run_id, log, watch); code >= 0)
        return code;
      continue;
    }
    if (!end.crashed() || restarts == o.max_restarts) return give_up(end, restarts, o);
    const std::string why = end.why(o.hostfile);
    const int64_t died = end.death_ns != 0 ? end.death_ns : end.end_ns;
    RestartPoint point;
    try {
      point = find_restart_point(o.checkpoint_dir, o.resume_dir, run_id);
    } catch (const Error& e) {
      std::fprintf(stderr, "hspmd: error: [launch] %s; cannot restart: %s\n", why.c_str(), e.what());
      return 1;
    }
    std::fprintf(stderr, "hspmd: warning: [launch] %s; restarting from %s (restart %lld of --max-restarts %lld)\n",
                 why.c_str(), point.resume_dir.empty() ? "the start"
                              : ("the checkpoint of step " + std::to_string(point.step)).c_str(),
                 static_cast<long long>(restarts + 1), static_cast<long long>(o.max_restarts));
    args = with_resume(o.rank_args, point.resume_dir);
    log.begin(restarts + 1, point.step, why, end.death_ns != 0 ? (end.end_ns - died) * 1e-9 : -1);
    watch.armed = true;
    watch.seen = [&log, died](int64_t done) { log.set_recovery((done - died) * 1e-9); };
    if (g_signal != 0) {
      std::fprintf(stderr, "hspmd: error: [launch] %s: the job was not restarted\n",
                   g_signal == SIGINT ? "SIGINT" : "SIGTERM");
      return 128 + g_signal;
    }
  }
}

bool claim_report(const std::string& message) {
  const char* dir = std::getenv("HSPMD_JOB_DIR");
  if (dir == nullptr) return true;
  const int fd = open(job_file(dir, "report").c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  for (size_t done = 0; done < message.size();) {
    const ssize_t n = write(fd, message.data() + done, message.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
  return true;
}

RankSupervision::RankSupervision(int rank) : rank_(rank) {
  const char* dir = std::getenv("HSPMD_JOB_DIR");
  const char* launcher = std::getenv("HSPMD_LAUNCHER_PID");
  if (dir == nullptr || launcher == nullptr) return;
  // A host that does not see the launcher's job directory (another machine)
  // runs its ranks unsupervised; the test hosts share this machine's /tmp.
  const char* host = std::getenv("HSPMD_LAUNCHER_HOST");
  if (host != nullptr && host_name() != host && access(dir, F_OK) != 0) return;
  dir_ = dir;
  launcher_pid_ = std::atoi(launcher);
  const int fd = open(job_file(dir_, "heartbeat").c_str(), O_RDWR | O_CLOEXEC);
  struct stat st {};
  if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(Slot) * (rank + 1)) {
    map_bytes_ = static_cast<size_t>(st.st_size);
    map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map_ == MAP_FAILED) map_ = nullptr;
    if (map_) slot_ = static_cast<Slot*>(map_) + rank;
  }
  if (fd >= 0) close(fd);
  // The FIFO reports a hang-up only for a writer that leaves after we open
  // it, so the launcher must still be alive once it is open.
  fifo_ = open(job_file(dir_, "alive").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fifo_ < 0 || kill(launcher_pid_, 0) != 0) launcher_gone();
  if (slot_) {
    slot_->pid = getpid();
    slot_->alive_ns = now_ns();
  }
  thread_ = std::thread([this] { watch(); });
}

RankSupervision::~RankSupervision() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fifo_ >= 0) close(fifo_);
  if (map_) munmap(map_, map_bytes_);
}

void RankSupervision::step_done(int64_t step) {
  if (!slot_) return;
  slot_->step_ns = now_ns();
  slot_->steps = step + 1;
}

void RankSupervision::watch() {
  for (int tick = 0; !stop_; ++tick) {
    pollfd p{fifo_, POLLIN, 0};
    if (poll(&p, 1, 200) > 0 && (p.revents & (POLLHUP | POLLERR))) launcher_gone();
    if (tick % 5 == 0 && kill(launcher_pid_, 0) != 0 && errno == ESRCH) launcher_gone();
    if (slot_) slot_->alive_ns = now_ns();
  }
}

void RankSupervision::launcher_gone() {
  if (claim_report()) {
    std::fprintf(stderr, "hspmd: error: rank %d: the launcher (pid %d) is gone; ending this rank\n", rank_,
                 launcher_pid_);
    std::fflush(stderr);
  }
  remove_job_dir(dir_);
  _exit(1);
}

}  // namespace hspmd::cli
