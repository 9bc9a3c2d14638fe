target_sources(hspmd_lib PRIVATE mul.cc scale.cc matmul.cc reshape.cc transpose.cc slice.cc concat.cc
                                 reduce_sum.cc embedding.cc rms_norm.cc rope.cc swiglu.cc
                                 cross_entropy.cc reshard.cc)
