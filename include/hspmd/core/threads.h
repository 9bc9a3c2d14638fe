// Thread count of the CPU backend: our own kernels (OpenMP) and OpenBLAS.
#pragma once

namespace hspmd {

// Sets the number of threads used by CPU kernels and BLAS. n >= 1.
void set_num_threads(int n);
int num_threads();

}  // namespace hspmd

namespace hspmd {

// OpenMP threads that spin after a parallel region steal the cores OpenBLAS's
// own threads need (and vice versa). The wait policy is read once when the
// OpenMP runtime loads, so executables call this first thing in main(): when
// OMP_WAIT_POLICY is unset it sets it to PASSIVE and re-executes the program
// with the same arguments. Returns normally when nothing needed changing (or
// the re-exec failed, in which case the run goes on with the default policy).
void ensure_passive_omp_wait(char** argv);

}  // namespace hspmd
