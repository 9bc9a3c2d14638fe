hspmd_test(test_strategy test_strategy.cc)
# The example strategies and models are checked in place.
target_compile_definitions(test_strategy PRIVATE HSPMD_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
