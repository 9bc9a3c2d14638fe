// No kernel left behind: every public function of the kernel headers that
// touches arrays takes a stream and has a CUDA path (docs/cuda.md, "Host
// helpers"). The headers are read as text (src/kernels/{kernels,basic,
// attention,memory}.h) and compared with the dispatch's listing
// (dispatch_table.h); each listed CUDA path must be declared by the CUDA
// backend (src/kernels/cuda/cuda.h) and called by the dispatch's switch
// (dispatch.cc), and a composed entry may not end in no_kernel. In a build
// with CUDA the listing also holds cuda::<name>'s address (taking it is a
// link-time check). Adding a kernel without a CUDA path fails here, on any
// machine; the last test checks that the check catches each kind.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/dispatch_table.h"

namespace hspmd {
namespace {

using kernels::DispatchEntry;

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

// The definition of `name` in dispatch.cc's text, from its line to the
// closing brace at column 0 ("" when there is none).
std::string definition_in(const std::string& source, const std::string& name) {
  const std::string head = " " + name + "(Stream&";
  for (size_t at = source.find(head); at != std::string::npos; at = source.find(head, at + 1)) {
    const size_t line = source.rfind('\n', at) + 1;
    if (std::isspace(static_cast<unsigned char>(source[line])) || source.compare(line, 2, "//") == 0) continue;
    const size_t end = source.find("\n}\n", at);
    if (end == std::string::npos) return "";
    const size_t brace = source.find('{', at);
    if (brace == std::string::npos || brace > end || source.find(';', at) < brace) continue;  // a declaration
    return source.substr(line, end + 2 - line);
  }
  return "";
}

// What breaks the rule, one line each (empty: nothing).
std::vector<std::string> problems(const std::vector<std::string>& headers, const std::string& dispatch,
                                  const std::string& cuda_header, std::span<const DispatchEntry> entries) {
  std::vector<std::string> out;
  const auto fns = array_functions(headers);
  // A function that reads arrays without a stream is a host helper that
  // cannot reach a device's arrays (positions on cuda:0 ended in no_kernel),
  // and the device double's host memory would hide it.
  for (const auto& [name, params] : fns)
    if (params.rfind("Stream&", 0) != 0)
      out.push_back(name + "(" + params + "): takes arrays but no stream first (a host helper takes the stream, "
                    "brings the arrays to the host with kernels::to_host and is listed in the dispatch)");
  std::set<std::string> listed;
  for (const DispatchEntry& e : entries)
    if (!listed.insert(e.name).second) out.push_back(std::string(e.name) + ": listed twice");
  for (const auto& [name, params] : fns)
    if (!listed.count(name))
      out.push_back(name + ": declared in a kernel header but not in the dispatch's listing (dispatch.cc, "
                    "kEntries): give it a CUDA path and list it");
  const std::string cuda_h = code_of(cuda_header);
  for (const DispatchEntry& e : entries) {
    const std::string name = e.name;
    if (!fns.count(name)) out.push_back(name + ": listed but not declared in the kernel headers");
    const std::string body = definition_in(dispatch, name);
    if (body.empty()) {
      out.push_back(name + ": no definition in dispatch.cc");
    } else if (e.path == DispatchEntry::Path::kCuda) {
      if (cuda_h.find(" " + name + "(Stream&") == std::string::npos)
        out.push_back(name + ": the CUDA backend (src/kernels/cuda/cuda.h) does not declare cuda::" + name);
      if (body.find("HSPMD_CUDA_CASE(" + name + "(") == std::string::npos)
        out.push_back(name + ": the dispatch's switch has no CUDA case");
    } else if (body.find("no_kernel(") != std::string::npos) {
      out.push_back(name + ": listed as composed of other kernels, but ends in no_kernel for some device");
    }
  }
  return out;
}

std::vector<std::string> headers() {
  return {read_source("src/kernels/kernels.h"), read_source("src/kernels/basic.h"),
          read_source("src/kernels/attention.h"), read_source("src/kernels/memory.h")};
}

TEST(CudaPaths, TheHeaderParserFindsTheKernels) {
  const auto fns = array_functions(headers());
  ASSERT_TRUE(fns.count("add"));
  EXPECT_EQ(fns.at("add"), "Stream& s, const NDArray& a, const NDArray& b, NDArray& out");
  for (const char* name : {"matmul", "attention_backward", "copy_block", "zeros", "adam_step",
                           "document_starts_from_positions"})
    EXPECT_TRUE(fns.count(name)) << name;
  EXPECT_FALSE(fns.count("no_kernel"));               // no arrays, no stream
  EXPECT_FALSE(fns.count("attention_block_hidden"));  // host spans only
  EXPECT_EQ(fns.size(), kernels::dispatch_entries().size());
}

TEST(CudaPaths, EveryKernelAndHostHelperHasACudaPath) {
  for (const std::string& p : problems(headers(), read_source("src/kernels/dispatch.cc"),
                                       read_source("src/kernels/cuda/cuda.h"), kernels::dispatch_entries()))
    ADD_FAILURE() << p;
}

// With CUDA built, the listing holds cuda::<name> itself (the build fails
// when the backend lacks it); without, no address.
TEST(CudaPaths, TheListingHoldsTheCudaFunctionsInACudaBuild) {
#ifdef HSPMD_HAVE_CUDA
  const bool cuda_build = true;
#else
  const bool cuda_build = false;
#endif
  for (const DispatchEntry& e : kernels::dispatch_entries())
    EXPECT_EQ(e.cuda != nullptr, cuda_build && e.path == DispatchEntry::Path::kCuda) << e.name;
}

// The check's own self-test: each way of leaving a kernel behind is caught.
TEST(CudaPaths, TheCheckCatchesEachWayToLeaveAKernelBehind) {
  const std::vector<std::string> real = headers();
  const std::string dispatch = read_source("src/kernels/dispatch.cc");
  const std::string cuda_h = read_source("src/kernels/cuda/cuda.h");
  const std::span<const DispatchEntry> entries = kernels::dispatch_entries();
  const auto caught = [](const std::vector<std::string>& found, const std::string& what) {
    for (const std::string& p : found)
      if (p.find(what) != std::string::npos) return true;
    return false;
  };
  // A new kernel in a header, not listed.
  std::vector<std::string> h = real;
  h[1] += "\nnamespace hspmd::kernels {\nvoid new_op(Stream& s, const NDArray& a,\n            NDArray& out);\n}\n";
  EXPECT_TRUE(caught(problems(h, dispatch, cuda_h, entries), "new_op: declared in a kernel header but not in"));
  // A host helper without a stream (the document_starts_from_positions bug).
  h = real;
  h[2] += "\nstd::vector<int32_t> starts_of(const NDArray& positions, int64_t first);\n";
  EXPECT_TRUE(caught(problems(h, dispatch, cuda_h, entries), "starts_of(const NDArray& positions, int64_t "
                                                            "first): takes arrays but no stream first"));
  // Listed, declared and dispatched, but the CUDA backend lacks it.
  std::string no_cuda = cuda_h;
  const size_t at = no_cuda.find("void rope(Stream&");
  ASSERT_NE(at, std::string::npos);
  no_cuda.replace(at, 10, "void rope_(");
  EXPECT_TRUE(caught(problems(real, dispatch, no_cuda, entries), "rope: the CUDA backend"));
  // The dispatch's switch without its CUDA case.
  std::string no_case = dispatch;
  const size_t c = no_case.find("HSPMD_CUDA_CASE(swiglu(");
  ASSERT_NE(c, std::string::npos);
  no_case.replace(c, 23, "HSPMD_CUDA_CASE(other(");
  EXPECT_TRUE(caught(problems(real, no_case, cuda_h, entries), "swiglu: the dispatch's switch has no CUDA case"));
  // A composed entry that ends in no_kernel.
  std::vector<DispatchEntry> listing(entries.begin(), entries.end());
  for (DispatchEntry& e : listing)
    if (std::string(e.name) == "fill") e.path = DispatchEntry::Path::kComposed;
  EXPECT_TRUE(caught(problems(real, dispatch, cuda_h, listing), "fill: listed as composed"));
  // Nothing of it on the real sources.
  EXPECT_EQ(problems(real, dispatch, cuda_h, entries), std::vector<std::string>{});
}

}  // namespace
}  // namespace hspmd
