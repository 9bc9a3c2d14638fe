// histogram_svg: the powers-of-two histogram of length_stats as hand-written SVG.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/data/length_stats.h"

namespace hspmd {
namespace {

constexpr double kWidth = 760, kHeight = 380;
constexpr double kLeft = 64, kRight = 16, kTop = 44, kBottom = 64;
constexpr const char* kDocumentColor = "#4c72b0";
constexpr const char* kTokenColor = "#dd8452";

template <typename... Args>
std::string format(const char* pattern, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, pattern, args...);
  return buf;
}

std::string escape_xml(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

// 1, 2, ..., 512, 1K, ..., 512K, 1M, ...: a bin's upper bound, short enough for its slot.
std::string short_length(int64_t n) {
  if (n >= (int64_t{1} << 30)) return std::to_string(n >> 30) + "G";
  if (n >= (int64_t{1} << 20)) return std::to_string(n >> 20) + "M";
  if (n >= 1024) return std::to_string(n >> 10) + "K";
  return std::to_string(n);
}

// The y axis top and tick step, in percent: at most 6 ticks over the largest share.
std::pair<double, double> y_axis(double largest_percent) {
  for (double step : {1.0, 2.0, 5.0, 10.0, 20.0, 25.0})
    if (largest_percent <= 6 * step) return {std::max(step, std::ceil(largest_percent / step) * step), step};
  return {100.0, 25.0};
}

// Index of the powers-of-two bin (2^(k-1), 2^k] holding `length`; 0 for (0, 1].
int bin_index(int64_t length) { return static_cast<int>(std::bit_width(static_cast<uint64_t>(length - 1))); }

// Bins first .. first + bins - 1 side by side; bin k spans x(k) to x(k + 1).
struct Frame {
  int first, bins;
  double top_percent;
  double bin_width() const { return (kWidth - kLeft - kRight) / bins; }
  double x(double bin_edge) const { return kLeft + (bin_edge - first) * bin_width(); }
  double y(double percent) const { return kTop + (kHeight - kTop - kBottom) * (1 - percent / top_percent); }
};

std::string axes(const Frame& f, double step) {
  std::string s;
  for (double p = 0; p <= f.top_percent + 1e-9; p += step) {
    s += format("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", kLeft, f.y(p),
                kWidth - kRight, f.y(p));
    s += format("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g%%</text>\n", kLeft - 6, f.y(p) + 4, p);
  }
  s += format("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>\n", kLeft, f.y(0),
              kWidth - kRight, f.y(0));
  for (int k = f.first; k < f.first + f.bins; ++k)
    s += format("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", f.x(k + 0.5), f.y(0) + 14,
                short_length(int64_t{1} << k).c_str());
  s += format("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">document length in tokens "
              "(bin (n/2, n] labelled n)</text>\n",
              (kLeft + kWidth - kRight) / 2, kHeight - 24);
  s += format("<text transform=\"translate(16 %.1f) rotate(-90)\" text-anchor=\"middle\">share</text>\n",
              (kTop + kHeight - kBottom) / 2);
  return s;
}

std::string bar(const Frame& f, double x, double width, double percent, const char* color) {
  if (percent <= 0) return "";
  return format("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"/>\n", x, f.y(percent),
                width, f.y(0) - f.y(percent), color);
}

std::string bars(const Frame& f, const LengthStats& s) {
  std::string out;
  const double w = f.bin_width() * 0.38;
  for (const LengthBin& b : s.histogram) {
    const double mid = f.x(bin_index(b.hi) + 0.5);
    out += bar(f, mid - w, w, 100.0 * static_cast<double>(b.count) / static_cast<double>(s.documents),
               kDocumentColor);
    out += bar(f, mid, w, 100.0 * static_cast<double>(b.tokens) / static_cast<double>(s.tokens), kTokenColor);
  }
  return out;
}

// A dashed line where a length of max_seq_len falls (bin k's right edge is 2^k).
std::string seq_len_lines(const Frame& f, const LengthStats& s) {
  std::string out;
  for (const PieceStats& p : s.pieces) {
    const double x = f.x(std::log2(static_cast<double>(p.max_seq_len)) + 1);
    out += format("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#555\" "
                  "stroke-dasharray=\"4 3\"/>\n",
                  x, kTop, x, f.y(0));
    out += format("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">L=%lld</text>\n", x - 3, kTop + 10,
                  static_cast<long long>(p.max_seq_len));
  }
  return out;
}

std::string legend() {
  std::string s;
  const double x = kWidth - kRight - 250, y = 14;
  s += format("<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>\n", x, y, kDocumentColor);
  s += format("<text x=\"%.1f\" y=\"%.1f\">documents</text>\n", x + 14, y + 9);
  s += format("<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>\n", x + 100, y,
              kTokenColor);
  s += format("<text x=\"%.1f\" y=\"%.1f\">tokens (by document)</text>\n", x + 114, y + 9);
  return s;
}

}  // namespace

std::string histogram_svg(const LengthStats& s, const std::string& title) {
  HSPMD_CHECK(!s.histogram.empty() && s.documents > 0 && s.tokens > 0, "no document to draw");
  int first = bin_index(s.histogram.front().hi), last = bin_index(s.histogram.back().hi);
  for (const PieceStats& p : s.pieces) {
    first = std::min(first, bin_index(p.max_seq_len));
    last = std::max(last, bin_index(p.max_seq_len));
  }
  double largest = 0;
  for (const LengthBin& b : s.histogram)
    largest = std::max({largest, 100.0 * static_cast<double>(b.count) / static_cast<double>(s.documents),
                        100.0 * static_cast<double>(b.tokens) / static_cast<double>(s.tokens)});
  const auto [top, step] = y_axis(largest);
  const Frame frame{first, last - first + 1, top};
  std::string svg = format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                           "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n",
                           kWidth, kHeight, kWidth, kHeight);
  svg += format("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", kWidth, kHeight);
  svg += "<text x=\"" + format("%.1f", kLeft) + "\" y=\"24\" font-size=\"13\">" + escape_xml(title) + "</text>\n";
  svg += axes(frame, step) + bars(frame, s) + seq_len_lines(frame, s) + legend();
  return svg + "</svg>\n";
}

}  // namespace hspmd
