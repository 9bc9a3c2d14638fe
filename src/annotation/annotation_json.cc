// JSON form of an Annotation (format in docs/annotation.md).
#include <charconv>
#include <climits>
#include <initializer_list>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/core/limits.h"

namespace hspmd {
namespace {

using nlohmann::json;

// Parsing context: the tensor's name, for one-line errors naming the field.
struct Reader {
  const std::string& tensor;

  template <typename... Args>
  [[noreturn]] void fail_field(const std::string& path, const Args&... args) const {
    fail("[annotation] tensor '", tensor, "': field '", path, "': ", args...);
  }

  void only_fields(const json& j, const std::string& path, std::initializer_list<const char*> allowed) const {
    if (!j.is_object()) fail_field(path, "must be an object");
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool known = false;
      for (const char* f : allowed) known = known || it.key() == f;
      if (!known) fail_field(path.empty() ? shorten(it.key()) : path + "." + shorten(it.key()), "unknown field");
    }
  }

  int integer(const json& j, const std::string& path) const {
    if (!j.is_number_integer()) fail_field(path, "must be an integer, got ", json_excerpt(j));
    if (j.is_number_unsigned() ? j.get<uint64_t>() > INT_MAX
                               : (j.get<int64_t>() > INT_MAX || j.get<int64_t>() < INT_MIN))
      fail_field(path, "integer ", json_excerpt(j), " is out of range");
    return j.get<int>();
  }

  int key(const std::string& s, const std::string& path) const {
    if (s == "dup") return kDup;
    if (s == "partial") return kPartial;
    int d = -1;
    if (s.size() > 5 && s.compare(0, 5, "split") == 0) {
      const char* end = s.data() + s.size();
      auto [ptr, ec] = std::from_chars(s.data() + 5, end, d);
      if (ec == std::errc() && ptr == end && d >= 0) return split_key(d);
    }
    fail_field(path, "key '", s, "' is not splitN (N >= 0), dup or partial");
  }

  DistStates states(const json& sub, const std::string& path) const {
    DistStates s;
    if (!sub.contains("states")) fail_field(path + ".states", "missing");
    const json& st = sub["states"];
    if (!st.is_object()) fail_field(path + ".states", "must be an object of key: degree");
    for (auto it = st.begin(); it != st.end(); ++it) {
      const std::string p = path + ".states." + it.key();
      s.degrees[key(it.key(), p)] = integer(it.value(), p);
    }
    if (!sub.contains("order")) {  // default: ascending key, i.e. partial, dup, split0, split1, ...
      for (auto [k, n] : s.degrees)
        if (n > 1) s.order.push_back(k);
      return s;
    }
    const json& order = sub["order"];
    if (!order.is_array()) fail_field(path + ".order", "must be an array of keys");
    for (size_t i = 0; i < order.size(); ++i) {
      const std::string p = path + ".order[" + std::to_string(i) + "]";
      if (!order[i].is_string()) fail_field(p, "must be a string key, got ", json_excerpt(order[i]));
      s.order.push_back(key(order[i].get<std::string>(), p));
    }
    return s;
  }

  // Appends the subgroup at `sub` to `out`: `repeat` [count, stride] times
  // (default once), the k-th copy with every rank + k * stride.
  void subgroups(const json& sub, const std::string& path, std::vector<Subgroup>& out) const {
    only_fields(sub, path, {"ranks", "states", "order", "repeat"});
    Subgroup g;
    if (!sub.contains("ranks")) fail_field(path + ".ranks", "missing");
    const json& ranks = sub["ranks"];
    if (!ranks.is_array()) fail_field(path + ".ranks", "must be an array of integers");
    for (size_t i = 0; i < ranks.size(); ++i)
      g.devices.ranks.push_back(integer(ranks[i], path + ".ranks[" + std::to_string(i) + "]"));
    g.states = states(sub, path);
    int count = 1, stride = 0;
    if (sub.contains("repeat")) {
      const json& r = sub["repeat"];
      if (!r.is_array() || r.size() != 2) fail_field(path + ".repeat", "must be [count, stride]");
      count = integer(r[0], path + ".repeat[0]");
      stride = integer(r[1], path + ".repeat[1]");
      if (count < 1 || count > kMaxRepeat) fail_field(path + ".repeat[0]", "count ", count, " is outside [1, ", kMaxRepeat, "]");
      if (stride < 1) fail_field(path + ".repeat[1]", "stride must be >= 1, got ", stride);
      // Subgroups are disjoint sets of ranks below the world size: more
      // ranks than the largest world cannot be valid (and are not allocated).
      if (static_cast<int64_t>(count) * g.devices.size() > kMaxWorldSize)
        fail_field(path + ".repeat", count, " copies of ", g.devices.size(), " ranks exceed the largest world (",
                   kMaxWorldSize, " ranks)");
      for (int rank : g.devices.ranks)
        if (static_cast<int64_t>(rank) + static_cast<int64_t>(count - 1) * stride > INT_MAX)
          fail_field(path + ".repeat", "rank ", rank, " + ", count - 1, " x ", stride, " is out of range");
    }
    for (int k = 0; k < count; ++k) {
      Subgroup copy = g;
      for (int& rank : copy.devices.ranks) rank += k * stride;
      out.push_back(std::move(copy));
    }
  }

  // A bound on one entry's copies (ranks are bounded by the world anyway,
  // which validate() checks; this keeps a typo from allocating billions).
  static constexpr int kMaxRepeat = 1 << 20;
};

// Whether b is a shifted by `stride` (same states and order, every rank + stride).
bool shifted(const Subgroup& a, const Subgroup& b, int64_t stride) {
  if (!(a.states == b.states) || a.devices.size() != b.devices.size()) return false;
  for (int i = 0; i < a.devices.size(); ++i)
    if (static_cast<int64_t>(b.devices.ranks[i]) - a.devices.ranks[i] != stride) return false;
  return true;
}

std::string key_json(int key) {
  if (key == kDup) return "dup";
  if (key == kPartial) return "partial";
  return "split" + std::to_string(key);
}

}  // namespace

json to_json(const Annotation& a) {
  json subgroups = json::array();
  // A run of subgroups that repeat one at a constant rank stride (a
  // pipeline's TP group in every data-parallel replica) is one entry with
  // "repeat": [count, stride] (a 4096-rank plan: 36 MB -> well under 1 MB).
  for (size_t i = 0; i < a.subgroups.size();) {
    const Subgroup& g = a.subgroups[i];
    size_t count = 1;
    int64_t stride = 0;
    if (i + 1 < a.subgroups.size() && g.devices.size() > 0) {
      stride = static_cast<int64_t>(a.subgroups[i + 1].devices.ranks[0]) - g.devices.ranks[0];
      while (stride >= 1 && i + count < a.subgroups.size() &&
             shifted(a.subgroups[i + count - 1], a.subgroups[i + count], stride))
        ++count;
    }
    json states = json::object();
    for (auto [key, n] : g.states.degrees) states[key_json(key)] = n;
    json order = json::array();
    for (int key : g.states.order) order.push_back(key_json(key));
    json entry = {{"ranks", g.devices.ranks}, {"states", states}, {"order", order}};
    if (count > 1) entry["repeat"] = {count, stride};
    subgroups.push_back(std::move(entry));
    i += count;
  }
  json out = {{"hdim", a.hdim}, {"subgroups", subgroups}};
  if (!a.part_weights.empty()) out["part_weights"] = a.part_weights;
  return out;
}

Annotation annotation_from_json(const json& j, const std::string& tensor_name) {
  Reader r{tensor_name};
  if (!j.is_object()) fail("[annotation] tensor '", tensor_name, "': must be a JSON object, got ", json_excerpt(j));
  r.only_fields(j, "", {"hdim", "subgroups", "part_weights"});
  Annotation a;
  if (j.contains("hdim")) a.hdim = r.integer(j["hdim"], "hdim");
  if (j.contains("part_weights")) {
    const json& w = j["part_weights"];
    if (!w.is_array()) r.fail_field("part_weights", "must be an array of integers");
    for (size_t i = 0; i < w.size(); ++i)
      a.part_weights.push_back(r.integer(w[i], "part_weights[" + std::to_string(i) + "]"));
  }
  if (!j.contains("subgroups")) r.fail_field("subgroups", "missing");
  const json& subs = j["subgroups"];
  if (!subs.is_array()) r.fail_field("subgroups", "must be an array");
  for (size_t i = 0; i < subs.size(); ++i) r.subgroups(subs[i], "subgroups[" + std::to_string(i) + "]", a.subgroups);
  return a;
}

}  // namespace hspmd
