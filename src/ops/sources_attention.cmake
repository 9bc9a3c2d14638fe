target_sources(hspmd_lib PRIVATE attention.cc)
