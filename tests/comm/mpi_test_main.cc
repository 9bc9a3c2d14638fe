// The main of the multi-rank GoogleTest programs (mpi_test_main.h).
#include "comm/mpi_test_main.h"

#include <gtest/gtest.h>

#include <iostream>
#include <memory>

namespace hspmd::testing {
namespace {

std::unique_ptr<Communicator> g_world;

// What a rank other than 0 prints: its failed assertions only.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::cerr << "[rank " << rank_ << "] " << (r.file_name() ? r.file_name() : "?") << ":" << r.line_number()
                << ": " << r.summary() << std::endl;
  }

 private:
  int rank_;
};

}  // namespace

Communicator& test_world() { return *g_world; }

}  // namespace hspmd::testing

int main(int argc, char** argv) {
  using hspmd::testing::g_world;
  ::testing::InitGoogleTest(&argc, argv);
  g_world = hspmd::make_world_communicator();
  const int rank = g_world->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new hspmd::testing::FailurePrinter(rank));
  }
  int32_t failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  g_world->all_reduce(&failed, 1);  // an i32 sum: the number of failed ranks
  if (rank == 0 && failed > 0) std::cerr << failed << " rank(s) failed" << std::endl;
  g_world.reset();
  return failed > 0 ? 1 : 0;
}
