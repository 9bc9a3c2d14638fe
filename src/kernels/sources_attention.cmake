target_sources(hspmd_lib PRIVATE cpu/attention.cc)
target_sources(hspmd_lib PRIVATE cpu/attention_block.cc)
