#include "hspmd/resolve/links.h"

#include <cmath>
#include <initializer_list>
#include <set>
#include <utility>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

namespace hspmd {
namespace {

using nlohmann::json;

template <typename... Args>
[[noreturn]] void fail_at(const std::string& where, const Args&... args) {
  fail("[links] ", where, ": ", args...);
}

void only_fields(const json& j, const std::string& where, std::initializer_list<const char*> allowed) {
  if (!j.is_object()) fail_at(where, "must be an object, got ", json_excerpt(j));
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* f : allowed) known = known || it.key() == f;
    if (!known) fail_at(where + "." + shorten(it.key()), "unknown field");
  }
}

const json& required(const json& j, const char* field, const std::string& where) {
  if (!j.contains(field)) fail_at(where + "." + field, "missing");
  return j.at(field);
}

double number(const json& j, const std::string& where, bool positive) {
  if (!j.is_number()) fail_at(where, "must be a number, got ", json_excerpt(j));
  const double v = j.get<double>();
  if (!std::isfinite(v) || (positive ? !(v > 0) : v < 0))
    fail_at(where, positive ? "must be positive, got " : "must be >= 0, got ", json_excerpt(j));
  return v;
}

HostLink read_link(const json& j, const std::string& where, int num_hosts) {
  only_fields(j, where, {"hosts", "gbps", "latency_us", "samples"});
  const json& pair = required(j, "hosts", where);
  if (!pair.is_array() || pair.size() != 2 || !pair[0].is_number_integer() || !pair[1].is_number_integer())
    fail_at(where + ".hosts", "must be [a, b], got ", json_excerpt(pair));
  HostLink l;
  l.a = pair[0].get<int>(), l.b = pair[1].get<int>();
  for (int h : {l.a, l.b})
    if (h < 0 || h >= num_hosts) fail_at(where + ".hosts", "host ", h, " is not in hosts (", num_hosts, " of them)");
  l.gbps = number(required(j, "gbps", where), where + ".gbps", true);
  l.latency_us = number(required(j, "latency_us", where), where + ".latency_us", false);
  if (j.contains("samples")) {
    if (!j.at("samples").is_array()) fail_at(where + ".samples", "must be an array");
    for (size_t i = 0; i < j.at("samples").size(); ++i) {
      const json& s = j.at("samples")[i];
      const std::string at = where + ".samples[" + std::to_string(i) + "]";
      only_fields(s, at, {"bytes", "seconds"});
      l.samples.push_back({static_cast<int64_t>(number(required(s, "bytes", at), at + ".bytes", true)),
                           number(required(s, "seconds", at), at + ".seconds", false)});
    }
  }
  return l;
}

}  // namespace

const HostLink* LinkTable::find(int a, int b) const {
  for (const HostLink& l : links)
    if ((l.a == a && l.b == b) || (l.a == b && l.b == a)) return &l;
  return nullptr;
}

json LinkTable::to_json() const {
  json out = json::array();
  for (const HostLink& l : links) {
    json samples = json::array();
    for (const LinkSample& s : l.samples) samples.push_back({{"bytes", s.bytes}, {"seconds", s.seconds}});
    out.push_back({{"hosts", {l.a, l.b}}, {"gbps", l.gbps}, {"latency_us", l.latency_us}, {"samples", samples}});
  }
  return {{"hosts", hosts}, {"repeats", repeats}, {"links", out}};
}

LinkTable LinkTable::from_json(const json& j) {
  only_fields(j, "links file", {"hosts", "repeats", "links"});
  LinkTable t;
  const json& hosts = required(j, "hosts", "links file");
  if (!hosts.is_array() || hosts.empty()) fail_at("hosts", "must be a non-empty array of host names");
  for (const json& h : hosts) {
    if (!h.is_string()) fail_at("hosts", "must hold names, got ", json_excerpt(h));
    t.hosts.push_back(h.get<std::string>());
  }
  if (j.contains("repeats")) t.repeats = static_cast<int>(number(j.at("repeats"), "repeats", false));
  const json& links = required(j, "links", "links file");
  if (!links.is_array()) fail_at("links", "must be an array");
  std::set<std::pair<int, int>> seen;
  for (size_t i = 0; i < links.size(); ++i) {
    const std::string where = "links[" + std::to_string(i) + "]";
    HostLink l = read_link(links[i], where, static_cast<int>(t.hosts.size()));
    if (!seen.insert({std::min(l.a, l.b), std::max(l.a, l.b)}).second)
      fail_at(where + ".hosts", "hosts ", l.a, " and ", l.b, " are measured twice");
    t.links.push_back(std::move(l));
  }
  return t;
}

LinkTable LinkTable::load(const std::string& path) {
  const json j = read_json_file(path, "links");
  try {
    return from_json(j);
  } catch (const Error& e) {
    const std::string what = e.what(), prefix = "[links] ";
    fail("[links] ", path, ": ", what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what);
  }
}

}  // namespace hspmd
