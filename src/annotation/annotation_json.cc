// JSON form of an Annotation (format in docs/annotation.md).
#include <charconv>
#include <climits>
#include <initializer_list>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

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

  Subgroup subgroup(const json& sub, const std::string& path) const {
    only_fields(sub, path, {"ranks", "states", "order"});
    Subgroup g;
    if (!sub.contains("ranks")) fail_field(path + ".ranks", "missing");
    const json& ranks = sub["ranks"];
    if (!ranks.is_array()) fail_field(path + ".ranks", "must be an array of integers");
    for (size_t i = 0; i < ranks.size(); ++i)
      g.devices.ranks.push_back(integer(ranks[i], path + ".ranks[" + std::to_string(i) + "]"));
    g.states = states(sub, path);
    return g;
  }
};

std::string key_json(int key) {
  if (key == kDup) return "dup";
  if (key == kPartial) return "partial";
  return "split" + std::to_string(key);
}

}  // namespace

json to_json(const Annotation& a) {
  json subgroups = json::array();
  for (const Subgroup& g : a.subgroups) {
    json states = json::object();
    for (auto [key, n] : g.states.degrees) states[key_json(key)] = n;
    json order = json::array();
    for (int key : g.states.order) order.push_back(key_json(key));
    subgroups.push_back({{"ranks", g.devices.ranks}, {"states", states}, {"order", order}});
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
  for (size_t i = 0; i < subs.size(); ++i)
    a.subgroups.push_back(r.subgroup(subs[i], "subgroups[" + std::to_string(i) + "]"));
  return a;
}

}  // namespace hspmd
