#include "hspmd/core/threads.h"

#include <omp.h>

#include "hspmd/core/error.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace hspmd {

namespace {
int g_threads = 1;
}

void set_num_threads(int n) {
  if (n < 1) fail("[threads] thread count must be >= 1, got ", n);
  g_threads = n;
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

int num_threads() { return g_threads; }

}  // namespace hspmd

#include <cstdlib>
#include <unistd.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace hspmd {

void ensure_passive_omp_wait(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  execv("/proc/self/exe", argv);
}

void tune_host_malloc() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

}  // namespace hspmd
