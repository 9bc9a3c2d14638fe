// Output paths checked before the work (hspmd/io/output_file.h) and writers
// that refuse to rename over a device, FIFO or directory (docs/reliability.md).
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "hspmd/core/error.h"
#include "hspmd/data/token_data.h"
#include "hspmd/io/output_file.h"
#include "hspmd/io/safetensors.h"

namespace hspmd {
namespace {

namespace fs = std::filesystem;

class OutputFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("hspmd-out-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  std::string fifo() const {
    const std::string p = at("fifo");
    EXPECT_EQ(::mkfifo(p.c_str(), 0600), 0);
    return p;
  }
  // A symbolic link to /dev/null: writers must leave /dev/null alone.
  std::string link_to_null() const {
    const std::string p = at("null-link");
    fs::create_symlink("/dev/null", p);
    return p;
  }
  // Only the files the test made itself: no probe or temporary left behind.
  size_t entries() const { return static_cast<size_t>(std::distance(fs::directory_iterator(dir_), {})); }
  fs::path dir_;
};

// Whether `f` throws hspmd::Error whose message holds `part`.
template <typename F>
::testing::AssertionResult throws_with(F f, const std::string& part) {
  try {
    f();
  } catch (const Error& e) {
    if (std::string(e.what()).find(part) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message '" << e.what() << "' lacks '" << part << "'";
  }
  return ::testing::AssertionFailure() << "no hspmd::Error";
}

bool null_is_device() { return fs::is_character_file(fs::symlink_status("/dev/null")); }

TEST_F(OutputFiles, AcceptsNewAndRegularFiles) {
  check_output_file("--save", at("new.safetensors"), OutputWrite::kRename);
  std::ofstream(at("old")) << "x";
  check_output_file("--save", at("old"), OutputWrite::kRename);
  check_output_file("--log", at("old"), OutputWrite::kStream);
  check_output_file("--log", "", OutputWrite::kStream);
  check_output_directory("--checkpoint", at("a/b/c"));
  check_output_directory("--checkpoint", dir_.string());
  EXPECT_FALSE(fs::exists(at("new.safetensors")));
  EXPECT_FALSE(fs::exists(at("a")));
  EXPECT_EQ(entries(), 1u);  // "old": the probes were removed
}

TEST_F(OutputFiles, RefusesDirectoriesMissingDirectoriesAndProc) {
  EXPECT_TRUE(throws_with([&] { check_output_file("--save", dir_.string(), OutputWrite::kRename); },
                          "--save " + dir_.string() + ": is a directory"));
  EXPECT_TRUE(throws_with([&] { check_output_file("--log", dir_.string(), OutputWrite::kStream); }, "is a directory"));
  EXPECT_TRUE(throws_with([&] { check_output_file("--log", at("no/such.jsonl"), OutputWrite::kStream); },
                          "does not exist"));
  EXPECT_TRUE(throws_with([&] { check_output_file("--save", "/proc/hspmd.safetensors", OutputWrite::kRename); },
                          "--save /proc/hspmd.safetensors: cannot create a file in /proc"));
  std::ofstream(at("file")) << "x";
  EXPECT_TRUE(throws_with([&] { check_output_directory("--checkpoint", at("file")); }, "not a directory"));
  EXPECT_TRUE(throws_with([&] { check_output_directory("--checkpoint", at("file/sub")); }, "not a directory"));
  EXPECT_TRUE(throws_with([&] { check_output_directory("--checkpoint", "/proc/hspmd-ckpt"); }, "cannot create"));
}

TEST_F(OutputFiles, RenameTargetsMustBeRegularFiles) {
  const std::string f = fifo(), l = link_to_null();
  EXPECT_TRUE(throws_with([&] { check_output_file("--save", f, OutputWrite::kRename); }, "is a FIFO"));
  EXPECT_TRUE(throws_with([&] { check_output_file("--dump-grads", l, OutputWrite::kRename); },
                          "--dump-grads " + l + ": is a character device, not a regular file"));
  check_output_file("--log", "/dev/full", OutputWrite::kStream);  // a streamed log may be a device
  EXPECT_TRUE(null_is_device());
}

TEST_F(OutputFiles, SafetensorsWritersRefuseDevicesAndFifos) {
  NDArray t = NDArray::zeros({2}, DType::F32);
  const std::string f = fifo(), l = link_to_null();
  for (const std::string& p : {f, l, dir_.string()}) {
    EXPECT_TRUE(throws_with([&] { save_safetensors(p, {{"w", t}}); }, "[safetensors] " + p + ": is a"));
    EXPECT_TRUE(throws_with([&] { SafetensorsWriter(p, {{"w", {DType::F32, {2}}}}); }, "not a regular file"));
  }
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(f)));
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(l)));
  EXPECT_TRUE(null_is_device());
  EXPECT_EQ(entries(), 2u);  // no temporary file left
}

TEST_F(OutputFiles, TokenFilesRefuseDevicesAndFifos) {
  const std::string f = fifo(), l = link_to_null();
  for (const std::string& p : {f, l})
    EXPECT_TRUE(throws_with([&] { TokenData::save(p, {1, 2, 3}); }, "[data] " + p + ": is a"));
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(f)));
  EXPECT_TRUE(null_is_device());
  TokenData::save(at("ok.bin"), {1, 2, 3});
  EXPECT_EQ(fs::file_size(at("ok.bin")), 12u);
}

}  // namespace
}  // namespace hspmd
