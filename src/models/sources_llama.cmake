target_sources(hspmd_lib PRIVATE llama.cc)
