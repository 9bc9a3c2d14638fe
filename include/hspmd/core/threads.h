// Thread count of the CPU backend: our own kernels (OpenMP) and OpenBLAS.
#pragma once

namespace hspmd {

// Sets the number of threads used by CPU kernels and BLAS. n >= 1.
void set_num_threads(int n);
int num_threads();

}  // namespace hspmd
