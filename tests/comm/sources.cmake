# Communicator tests. test_comm (single process) runs in every build; the
# multi-rank programs run under mpirun when hspmd_lib has the MPI backend.
hspmd_test(test_comm test_comm_stub.cc)
hspmd_mpi_test(test_comm_collectives NPROCS 4 SOURCES test_collectives.cc)
hspmd_mpi_test(test_comm_execute NPROCS 8 SOURCES test_execute_property.cc)
