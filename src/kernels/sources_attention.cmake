target_sources(hspmd_lib PRIVATE cpu/attention.cc)
