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

// glibc malloc settings for training processes, also called first thing in
// main(). NDArray blocks are cached by the CPU allocator, but kernels' scratch
// (std::vector work arrays) is allocated and freed every step, and glibc
// serves large blocks with fresh mappings and trims the heap's free top: both
// page-fault and zero the same memory again at every step. This serves blocks
// up to 32 MiB from the heap and keeps up to 256 MiB of free heap mapped.
// A no-op without glibc.
void tune_host_malloc();

}  // namespace hspmd
