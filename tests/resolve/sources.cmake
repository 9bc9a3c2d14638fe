hspmd_test(test_resolve
  test_topology.cc
  test_resolver.cc
  test_simulate.cc
  test_resolve_property.cc)
