# Communicator tests. test_comm (single process) runs in every build; the
# multi-rank programs run under mpirun when hspmd_lib has the MPI backend.
hspmd_test(test_comm test_comm_stub.cc)

# hspmd_mpi_test(NAME NPROC SOURCES...): a GoogleTest program with the MPI
# main (mpi_test_main.cc), registered in CTest as one mpirun of NPROC ranks.
function(hspmd_mpi_test name nproc)
  add_executable(${name} mpi_test_main.cc ${ARGN})
  target_link_libraries(${name} PRIVATE hspmd_lib GTest::gtest)
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/tests)
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${nproc} $<TARGET_FILE:${name}>)
  set_tests_properties(${name} PROPERTIES TIMEOUT 300 PROCESSORS ${nproc})
endfunction()

if(HSPMD_MPI_ENABLED)
  hspmd_mpi_test(test_comm_collectives_np4 4 test_collectives.cc)
  hspmd_mpi_test(test_comm_execute_np8 8 test_execute_property.cc)
endif()
