// Reading and checking elastic training's events file.
#include "hspmd/train/events.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <set>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/core/json_file.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {

std::string ElasticEvent::cause() const {
  std::string out;
  auto list = [&](const char* what, const std::vector<int>& ranks) {
    if (ranks.empty()) return;
    if (!out.empty()) out += "; ";
    out += what;
    for (size_t i = 0; i < ranks.size(); ++i) out += (i ? "," : " ") + std::to_string(ranks[i]);
  };
  list("fail", fail);
  list("join", join);
  if (!slowdown.empty()) {
    if (!out.empty()) out += "; ";
    out += "slowdown";
    bool first = true;
    for (const auto& [r, f] : slowdown) {
      out += (first ? " " : ",") + std::to_string(r) + "x" + detail::concat(f);
      first = false;
    }
  }
  if (!strategy_path.empty()) out += (out.empty() ? "" : "; ") + std::string("strategy ") + strategy_path;
  return out;
}

namespace {

int parse_rank(const nlohmann::json& v, int world_size, const std::string& where) {
  if (!v.is_number_integer()) fail(where, ": a rank must be an integer, got ", json_excerpt(v));
  const int64_t r = v.get<int64_t>();
  if (r < 0 || r >= world_size) fail(where, ": rank ", r, " is outside the world of ", world_size, " ranks");
  return static_cast<int>(r);
}

std::vector<int> parse_ranks(const nlohmann::json& v, int world_size, const std::string& where) {
  if (!v.is_array() || v.empty()) fail(where, ": expected a non-empty list of ranks, got ", json_excerpt(v));
  std::vector<int> out;
  std::set<int> seen;
  for (const nlohmann::json& r : v) {
    const int rank = parse_rank(r, world_size, where);
    if (!seen.insert(rank).second) fail(where, ": rank ", rank, " is listed twice");
    out.push_back(rank);
  }
  return out;
}

}  // namespace

std::vector<ElasticEvent> load_events(const std::string& path, int world_size, int64_t steps) {
  const nlohmann::json j = read_json_file(path, "events");
  if (!j.is_array()) fail("[events] ", path, ": expected a JSON list of events, got ", json_excerpt(j));
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::vector<ElasticEvent> out;
  std::set<int> failed;
  for (size_t i = 0; i < j.size(); ++i) {
    const nlohmann::json& e = j[i];
    std::string where = "[events] " + path + ": event " + std::to_string(i);
    if (!e.is_object()) fail(where, ": expected an object, got ", json_excerpt(e));
    for (const auto& [key, value] : e.items())
      if (key != "step" && key != "fail" && key != "join" && key != "slowdown" && key != "strategy")
        fail(where, ": unknown key '", shorten(key), "' (expected step, fail, join, slowdown, strategy)");
    if (!e.contains("step") || !e["step"].is_number_integer())
      fail(where, ": \"step\" must be an integer");
    ElasticEvent ev;
    ev.step = e["step"].get<int64_t>();
    where += " (step " + std::to_string(ev.step) + ")";
    if (ev.step < 1 || ev.step >= steps)
      fail(where, ": the step must lie in [1, ", option_name("steps"), " ", steps, "): an event takes effect before a step of the run");
    if (!out.empty() && ev.step <= out.back().step)
      fail(where, ": steps must ascend strictly (the previous event is at step ", out.back().step,
           "); put one step's changes into one event");
    if (e.contains("fail")) ev.fail = parse_ranks(e["fail"], world_size, where + ": \"fail\"");
    if (e.contains("join")) ev.join = parse_ranks(e["join"], world_size, where + ": \"join\"");
    if (e.contains("slowdown")) {
      const nlohmann::json& s = e["slowdown"];
      if (!s.is_object() || s.empty())
        fail(where, ": \"slowdown\" must be a non-empty object {\"rank\": factor}, got ", json_excerpt(s));
      for (const auto& [key, value] : s.items()) {
        int64_t r = -1;
        try {
          size_t used = 0;
          r = std::stoll(key, &used);
          if (used != key.size()) r = -1;
        } catch (const std::exception&) {
          r = -1;
        }
        if (r < 0 || key.empty() || !std::isdigit(static_cast<unsigned char>(key[0])))
          fail(where, ": \"slowdown\": key '", shorten(key), "' is not a rank");
        const int rank = parse_rank(nlohmann::json(r), world_size, where + ": \"slowdown\"");
        if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() <= 0)
          fail(where, ": \"slowdown\": rank ", rank, ": the factor must be a finite number > 0, got ",
               json_excerpt(value));
        if (!slowdown_in_range(value.get<double>()))
          fail(where, ": \"slowdown\": rank ", rank, ": the factor must lie in [", kMinSlowdown, ", ", kMaxSlowdown,
               "] (a compute-time multiplier), got ", json_excerpt(value));
        ev.slowdown[rank] = value.get<double>();
      }
    }
    if (e.contains("strategy")) {
      if (!e["strategy"].is_string() || e["strategy"].get<std::string>().empty())
        fail(where, ": \"strategy\" must be a file name");
      std::filesystem::path p = e["strategy"].get<std::string>();
      if (p.is_relative() && !dir.empty()) p = dir / p;
      ev.strategy_path = p.string();
      require_regular_file(ev.strategy_path, "events");
    }
    if (ev.fail.empty() && ev.join.empty() && ev.slowdown.empty() && ev.strategy_path.empty())
      fail(where, ": nothing happens: give \"fail\", \"join\", \"slowdown\" or \"strategy\"");
    for (int r : ev.fail) {
      if (failed.count(r)) fail(where, ": \"fail\": rank ", r, " has already failed (at an earlier event)");
      if (std::count(ev.join.begin(), ev.join.end(), r)) fail(where, ": rank ", r, " both fails and joins");
    }
    for (int r : ev.join)
      if (!failed.count(r)) fail(where, ": \"join\": rank ", r, " never failed (only a failed rank can join)");
    for (int r : ev.fail) failed.insert(r);
    for (int r : ev.join) failed.erase(r);
    if (static_cast<int>(failed.size()) == world_size)
      fail(where, ": every rank of the world has failed: nothing is left to train on");
    out.push_back(std::move(ev));
  }
  return out;
}

std::set<int> failed_after(const std::vector<ElasticEvent>& events, int64_t step) {
  std::set<int> failed;
  for (const ElasticEvent& e : events) {
    if (e.step > step) break;
    for (int r : e.fail) failed.insert(r);
    for (int r : e.join) failed.erase(r);
  }
  return failed;
}

}  // namespace hspmd
