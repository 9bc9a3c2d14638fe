target_sources(hspmd_lib PRIVATE
  topology.cc
  boxes.cc
  layout.cc
  plan.cc
  bsr.cc
  bottom_tier.cc
  top_tier.cc
  resolver.cc
  simulate.cc
  shards.cc)
