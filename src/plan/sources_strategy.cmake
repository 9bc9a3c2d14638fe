target_sources(hspmd_lib PRIVATE strategy.cc)
