hspmd_test(test_plan test_plan.cc)
hspmd_test(test_plan_examples test_examples.cc)
target_compile_definitions(test_plan_examples PRIVATE HSPMD_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
