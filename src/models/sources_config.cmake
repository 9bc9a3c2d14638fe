target_sources(hspmd_lib PRIVATE config.cc)
