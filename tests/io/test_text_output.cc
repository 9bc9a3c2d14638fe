// write_output_file (hspmd/io/text_output.h): the writer of every command's
// text output makes the shared output check and never blocks on a FIFO
// (docs/reliability.md "Outputs, integer ranges and hspmd launch").
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "hspmd/core/error.h"
#include "hspmd/io/text_output.h"

namespace hspmd {
namespace {

namespace fs = std::filesystem;

class TextOutput : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("hspmd-text-out-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::string error_of(const std::string& path) {
  try {
    write_output_file("[plan] --output", path, "{}\n");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST_F(TextOutput, WritesAndReplacesARegularFile) {
  const std::string p = at("plan.json");
  write_output_file("[plan] --output", p, "first, longer text\n");
  write_output_file("[plan] --output", p, "{}\n");
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  EXPECT_EQ(s.str(), "{}\n");
}

TEST_F(TextOutput, RefusesAFifoAndALinkToOneWithoutBlocking) {
  const std::string f = at("fifo");
  ASSERT_EQ(::mkfifo(f.c_str(), 0600), 0);
  fs::create_symlink(f, at("link"));
  EXPECT_NE(error_of(f).find("is a FIFO"), std::string::npos) << error_of(f);
  EXPECT_NE(error_of(at("link")).find("is a FIFO"), std::string::npos);
  EXPECT_TRUE(fs::is_fifo(f));
}

TEST_F(TextOutput, RefusesADirectoryAndAMissingDirectory) {
  EXPECT_NE(error_of(dir_.string()).find("is a directory"), std::string::npos);
  EXPECT_NE(error_of(at("no/such/plan.json")).find("does not exist"), std::string::npos);
}

TEST_F(TextOutput, DevicesAreTargetsAndAFullDiskIsReported) {
  EXPECT_EQ(error_of("/dev/null"), "");
  if (fs::exists("/dev/full")) {
    const std::string e = error_of("/dev/full");
    EXPECT_NE(e.find("[plan] --output /dev/full: write failed"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace hspmd
