// One list of kernels (src/kernels/kernel_list.inc, backend.h): every
// public function of the kernel headers that touches arrays takes a stream
// and is either a kernel of the list (each registered backend implements
// it: its table is filled from the list, a missing function fails that
// backend's compilation) or composed of listed kernels in dispatch.cc. The
// headers are read as text; the last test checks that the check catches
// each way to leave a kernel out.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace hspmd {
namespace {

// Written once from listed kernels or the device runtime (dispatch.cc, host_copies.cc): no backend entry.
const std::set<std::string> kComposed = {"clone", "as_f32", "document_starts_from_positions", "copy_from_host"};

std::string read_source(const std::string& rel) {
  const std::string path = std::string(HSPMD_SOURCE_DIR) + "/" + rel;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The text without comments, whitespace runs collapsed to one space.
std::string code_of(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, 2, "//") == 0) {
      i = text.find('\n', i);
      if (i == std::string::npos) break;
    } else if (text.compare(i, 2, "/*") == 0) {
      i = text.find("*/", i);
      if (i == std::string::npos) break;
      ++i;
      continue;
    }
    const char c = std::isspace(static_cast<unsigned char>(text[i])) ? ' ' : text[i];
    if (c != ' ' || (!out.empty() && out.back() != ' ')) out += c;
  }
  return out;
}

bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Every declaration `name(params);` (params without parentheses) of a
// header's text: name -> params.
std::map<std::string, std::string> declarations(const std::string& text) {
  const std::string code = code_of(text);
  std::map<std::string, std::string> found;
  for (size_t open = code.find('('); open != std::string::npos; open = code.find('(', open + 1)) {
    const size_t close = code.find_first_of("()", open + 1);
    if (close == std::string::npos || code[close] != ')') continue;
    const size_t after = code.find_first_not_of(' ', close + 1);
    if (after == std::string::npos || code[after] != ';') continue;
    size_t end = open;
    while (end > 0 && code[end - 1] == ' ') --end;
    size_t begin = end;
    while (begin > 0 && ident_char(code[begin - 1])) --begin;
    if (begin == end) continue;
    std::string params = code.substr(open + 1, close - open - 1);
    if (!params.empty() && params.front() == ' ') params.erase(0, 1);
    found[code.substr(begin, end - begin)] = params;
  }
  return found;
}

// The functions of the headers that touch arrays or run on a stream.
std::map<std::string, std::string> array_functions(const std::vector<std::string>& headers) {
  std::map<std::string, std::string> out;
  for (const std::string& h : headers)
    for (const auto& [name, params] : declarations(h))
      if (params.find("NDArray") != std::string::npos || params.rfind("Stream&", 0) == 0) out[name] = params;
  return out;
}

// What breaks the rule, one line each (empty: nothing).
std::vector<std::string> problems(const std::vector<std::string>& headers, const std::vector<std::string>& listed) {
  std::vector<std::string> out;
  const auto fns = array_functions(headers);
  // A function that reads arrays without a stream is a host helper that
  // cannot reach a device's arrays, and the device double's host memory
  // would hide it.
  for (const auto& [name, params] : fns)
    if (params.rfind("Stream&", 0) != 0)
      out.push_back(name + "(" + params + "): takes arrays but no stream first (a host helper takes the stream, "
                    "brings the arrays to the host with kernels::to_host and is composed in dispatch.cc)");
  std::set<std::string> known(kComposed);
  for (const std::string& n : listed)
    if (!known.insert(n).second) out.push_back(n + ": listed twice");
  for (const auto& [name, params] : fns)
    if (!known.count(name))
      out.push_back(name + ": declared in a kernel header but not in src/kernels/kernel_list.inc");
  for (const std::string& n : known)
    if (!fns.count(n)) out.push_back(n + ": listed but not declared in the kernel headers");
  return out;
}

std::vector<std::string> headers() {
  return {read_source("src/kernels/kernels.h"), read_source("src/kernels/basic.h"),
          read_source("src/kernels/attention.h"), read_source("src/kernels/memory.h")};
}

std::vector<std::string> listed() {
  std::vector<std::string> out;
  for (const char* n : kernels::kernel_names()) out.emplace_back(n);
  return out;
}

TEST(KernelList, TheHeaderParserFindsTheKernels) {
  const auto fns = array_functions(headers());
  ASSERT_TRUE(fns.count("add"));
  EXPECT_EQ(fns.at("add"), "Stream& s, const NDArray& a, const NDArray& b, NDArray& out");
  for (const char* name : {"matmul", "attention_backward", "copy_block", "zeros", "adam_step",
                           "document_starts_from_positions"})
    EXPECT_TRUE(fns.count(name)) << name;
  EXPECT_FALSE(fns.count("no_kernel"));               // no arrays, no stream
  EXPECT_FALSE(fns.count("attention_block_hidden"));  // host spans only
  EXPECT_EQ(fns.size(), listed().size() + kComposed.size());
}

TEST(KernelList, EveryKernelOfTheHeadersIsListedOrComposed) {
  for (const std::string& p : problems(headers(), listed())) ADD_FAILURE() << p;
}

// Every registered backend fills every entry, except that only the CPU's
// has those of CPU-only kernels; a build with CUDA registers it.
TEST(KernelList, EveryRegisteredBackendIsComplete) {
  const auto backends = kernels::registered_backends();
  ASSERT_FALSE(backends.empty());
  EXPECT_EQ(backends.front(), kernels::backend_for(DeviceType::CPU));
  for (const kernels::Backend* b : backends) {
    const std::string label = b->name;  // `name` is the macro's parameter below
#define HSPMD_KERNEL(name, ret, params, args, cpu) EXPECT_NE(b->kernels.name, nullptr) << label << ": " #name;
#define HSPMD_CPU_ONLY_KERNEL(name, ret, params, args, cpu)         \
  if (b->device_type == DeviceType::CPU) {                          \
    EXPECT_NE(b->kernels.name, nullptr) << label << ": " #name;     \
  } else {                                                          \
    EXPECT_EQ(b->kernels.name, nullptr) << label << ": " #name " is CPU-only"; \
  }
#include "kernels/kernel_list.inc"
#undef HSPMD_CPU_ONLY_KERNEL
#undef HSPMD_KERNEL
  }
  EXPECT_EQ(kernels::backend_for(DeviceType::CUDA) != nullptr, built_with_cuda());
}

// The check's own self-test: each way of leaving a kernel out is caught.
TEST(KernelList, TheCheckCatchesEachWayToLeaveAKernelOut) {
  const std::vector<std::string> real = headers();
  const auto caught = [](const std::vector<std::string>& found, const std::string& what) {
    for (const std::string& p : found)
      if (p.find(what) != std::string::npos) return true;
    return false;
  };
  // A new kernel in a header, not listed.
  std::vector<std::string> h = real;
  h[1] += "\nnamespace hspmd::kernels {\nvoid new_op(Stream& s, const NDArray& a,\n            NDArray& out);\n}\n";
  EXPECT_TRUE(caught(problems(h, listed()), "new_op: declared in a kernel header but not in"));
  // A host helper without a stream (the document_starts_from_positions bug).
  h = real;
  h[2] += "\nstd::vector<int32_t> starts_of(const NDArray& positions, int64_t first);\n";
  EXPECT_TRUE(caught(problems(h, listed()), "starts_of(const NDArray& positions, int64_t first): takes arrays"));
  // Listed but gone from the headers.
  std::vector<std::string> more = listed();
  more.push_back("old_op");
  EXPECT_TRUE(caught(problems(real, more), "old_op: listed but not declared"));
  // Nothing of it on the real sources.
  EXPECT_EQ(problems(real, listed()), std::vector<std::string>{});
}

}  // namespace
}  // namespace hspmd
