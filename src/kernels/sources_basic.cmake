target_sources(hspmd_lib PRIVATE cpu/gemm.cc cpu/layout.cc cpu/reduce.cc cpu/embedding.cc cpu/norm.cc
                                 cpu/rope.cc cpu/swiglu.cc cpu/cross_entropy.cc)
