// The seeded mutation driver: runs one target (linked beside it) on
// mutations of a corpus of valid files, deterministically for a seed, so that
// a CTest can fuzz without libFuzzer. Usage:
//   fuzz_<target> <corpus dir> <inputs> [seed]
// Prints the inputs run and exits 0; a crash or an exception other than
// hspmd::Error ends the process (the input is first saved as
// <target>-crash.bin in the working directory).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using Bytes = std::string;

std::vector<Bytes> read_corpus(const std::string& dir) {
  std::vector<std::filesystem::path> paths;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.is_regular_file()) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());  // the order fixes what a seed means
  std::vector<Bytes> corpus;
  for (const auto& p : paths) {
    std::ifstream in(p, std::ios::binary);
    corpus.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return corpus;
}

class Mutator {
 public:
  Mutator(uint64_t seed, const std::vector<Bytes>& corpus) : rng_(seed), corpus_(corpus) {}

  Bytes next() {
    Bytes b = corpus_[pick(corpus_.size())];
    const size_t rounds = 1 + pick(4);
    for (size_t r = 0; r < rounds; ++r) mutate(b);
    return b;
  }

 private:
  size_t pick(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }

  void mutate(Bytes& b) {
    static const char* const kNumbers[] = {"0", "-1", "1e309", "-0", "2147483648", "4294967296", "1000000000",
                                           "99999999999999999999999", "9223372036854775807", "1.5", "NaN", "null"};
    static const char* const kTokens[] = {"{", "}", "[", "]", ",", ":", "\"", "\\", "true", "\"a\":1,"};
    switch (pick(10)) {
      case 0:  // bit flip
        if (!b.empty()) b[pick(b.size())] ^= static_cast<char>(1u << pick(8));
        break;
      case 1:  // truncation
        b.resize(pick(b.size() + 1));
        break;
      case 2: {  // splice: our prefix, another input's suffix
        const Bytes& o = corpus_[pick(corpus_.size())];
        b = b.substr(0, pick(b.size() + 1)) + o.substr(pick(o.size() + 1));
        break;
      }
      case 3: {  // deep nesting around a piece
        const size_t depth = pick(4) == 0 ? 100000 : 1 + pick(300);
        const size_t at = pick(b.size() + 1);
        const bool obj = pick(2);
        Bytes open, close;
        for (size_t i = 0; i < depth; ++i) open += obj ? "{\"k\":" : "[";
        close.assign(depth, obj ? '}' : ']');
        b = b.substr(0, at) + open + "1" + close + b.substr(at);
        break;
      }
      case 4: {  // a number replaced by an extreme one
        const size_t at = b.find_first_of("0123456789", pick(b.size() + 1));
        if (at == Bytes::npos) break;
        const size_t end = b.find_first_not_of("0123456789.eE+-", at);
        b.replace(at, (end == Bytes::npos ? b.size() : end) - at, kNumbers[pick(std::size(kNumbers))]);
        break;
      }
      case 5:  // a JSON token inserted
        b.insert(pick(b.size() + 1), kTokens[pick(std::size(kTokens))]);
        break;
      case 6: {  // a chunk duplicated (duplicate keys, repeated entries)
        if (b.empty()) break;
        const size_t at = pick(b.size()), len = 1 + pick(std::min<size_t>(64, b.size() - at));
        b.insert(pick(b.size() + 1), b.substr(at, len));
        break;
      }
      case 7:  // a random byte set
        if (!b.empty()) b[pick(b.size())] = static_cast<char>(pick(256));
        break;
      case 8:  // a long value
        b.insert(pick(b.size() + 1), Bytes(1 + pick(1 << 16), "ax9\"["[pick(5)]));
        break;
      default: {  // a little-endian integer overwritten (binary formats)
        if (b.size() < 8) break;
        const size_t at = pick(b.size() - 7);
        const uint64_t v = pick(3) == 0 ? ~uint64_t{0} >> pick(64) : pick(1u << 20);
        for (int i = 0; i < 8; ++i) b[at + i] = static_cast<char>(v >> (8 * i));
      }
    }
  }

  std::mt19937_64 rng_;
  const std::vector<Bytes>& corpus_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " <corpus dir> <inputs> [seed]\n";
    return 2;
  }
  const std::vector<Bytes> corpus = read_corpus(argv[1]);
  if (corpus.empty()) {
    std::cerr << argv[0] << ": no files in " << argv[1] << "\n";
    return 2;
  }
  const long inputs = std::stol(argv[2]);
  const uint64_t seed = argc > 3 ? std::stoull(argv[3]) : 1;
  const std::string name = std::filesystem::path(argv[0]).filename().string();
  for (const Bytes& b : corpus) LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(b.data()), b.size());
  Mutator m(seed, corpus);
  for (long i = 0; i < inputs; ++i) {
    const Bytes b = m.next();
    {  // saved first, so that a crash leaves its input behind
      std::ofstream(name + "-crash.bin", std::ios::binary | std::ios::trunc).write(b.data(), b.size());
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(b.data()), b.size());
  }
  std::filesystem::remove(name + "-crash.bin");
  std::cout << name << ": " << corpus.size() << " corpus files and " << inputs << " mutated inputs, seed " << seed
            << ", no crash\n";
  return 0;
}
