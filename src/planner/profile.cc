#include "hspmd/planner/profile.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

namespace hspmd {

namespace {

using nlohmann::json;

// Solves the n x n system m * x = r (n <= 3) by Gaussian elimination with
// partial pivoting; false when it is singular.
bool solve(std::vector<std::vector<double>> m, std::vector<double> r, std::vector<double>& x) {
  const size_t n = r.size();
  for (size_t col = 0; col < n; ++col) {
    size_t piv = col;
    for (size_t i = col + 1; i < n; ++i)
      if (std::abs(m[i][col]) > std::abs(m[piv][col])) piv = i;
    if (std::abs(m[piv][col]) < 1e-300) return false;
    std::swap(m[piv], m[col]);
    std::swap(r[piv], r[col]);
    for (size_t i = 0; i < n; ++i) {
      if (i == col) continue;
      const double f = m[i][col] / m[col][col];
      for (size_t k = col; k < n; ++k) m[i][k] -= f * m[col][k];
      r[i] -= f * r[col];
    }
  }
  x.resize(n);
  for (size_t i = 0; i < n; ++i) x[i] = r[i] / m[i][i];
  return true;
}

// Weighted least squares of `y` on the feature columns, minimising the sum
// of squared RELATIVE errors (each row weighted by 1/y^2): a profile spans
// orders of magnitude and every point should be fitted equally well.
std::vector<double> least_squares(const std::vector<std::vector<double>>& rows,
                                  const std::vector<double>& y) {
  const size_t n = rows.empty() ? 0 : rows[0].size();
  std::vector<std::vector<double>> ata(n, std::vector<double>(n, 0));
  std::vector<double> aty(n, 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    const double w = y[i] > 0 ? 1.0 / (y[i] * y[i]) : 1.0;
    for (size_t p = 0; p < n; ++p) {
      aty[p] += w * rows[i][p] * y[i];
      for (size_t q = 0; q < n; ++q) ata[p][q] += w * rows[i][p] * rows[i][q];
    }
  }
  // Scale columns to unit diagonal so that b*s^2 and 1 are comparable.
  std::vector<double> scale(n, 1);
  for (size_t p = 0; p < n; ++p) scale[p] = ata[p][p] > 0 ? 1.0 / std::sqrt(ata[p][p]) : 1.0;
  for (size_t p = 0; p < n; ++p) {
    aty[p] *= scale[p];
    for (size_t q = 0; q < n; ++q) ata[p][q] *= scale[p] * scale[q];
  }
  std::vector<double> x;
  if (!solve(ata, aty, x)) return {};
  for (size_t p = 0; p < n; ++p) x[p] *= scale[p];
  return x;
}

// The least-squares fit with every coefficient >= 0 (a time is a sum of
// non-negative costs): for these few columns, the best fit over every subset
// of the columns whose solution is non-negative (the others at 0). Empty
// when no subset solves.
std::vector<double> nonnegative_least_squares(const std::vector<std::vector<double>>& rows,
                                              const std::vector<double>& y) {
  const size_t n = rows.empty() ? 0 : rows[0].size();
  std::vector<double> best;
  double best_err = std::numeric_limits<double>::infinity();
  for (unsigned mask = 1; mask < (1u << n); ++mask) {
    std::vector<size_t> cols;
    for (size_t c = 0; c < n; ++c)
      if (mask & (1u << c)) cols.push_back(c);
    std::vector<std::vector<double>> sub(rows.size());
    for (size_t i = 0; i < rows.size(); ++i)
      for (size_t c : cols) sub[i].push_back(rows[i][c]);
    const std::vector<double> x = least_squares(sub, y);
    if (x.empty() || std::any_of(x.begin(), x.end(), [](double v) { return v < 0; })) continue;
    double err = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      double fit = 0;
      for (size_t k = 0; k < cols.size(); ++k) fit += x[k] * sub[i][k];
      const double w = y[i] > 0 ? 1.0 / (y[i] * y[i]) : 1.0;
      err += w * (fit - y[i]) * (fit - y[i]);
    }
    if (err < best_err) {
      best_err = err;
      best.assign(n, 0.0);
      for (size_t k = 0; k < cols.size(); ++k) best[cols[k]] = x[k];
    }
  }
  return best;
}

json fit_json(const PartFit& f) {
  json samples = json::array();
  for (const FitSample& s : f.samples) samples.push_back({{"s", s.s}, {"b", s.b}, {"seconds", s.seconds}});
  return {{"a", f.a}, {"c", f.c}, {"d", f.d}, {"max_rel_error", f.max_rel_error},
          {"mean_rel_error", f.mean_rel_error}, {"samples", samples}};
}

template <typename T>
T get(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) fail("[profile] ", where, ": missing field '", key, "'");
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    fail("[profile] ", where, ".", key, ": wrong JSON type");
  }
}

// An optional field: `fallback` when absent; a value of the wrong JSON type
// (null, a string for a number, ...) is refused like a required one's.
template <typename T>
T optional_field(const json& j, const char* key, T fallback, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) return fallback;
  return get<T>(j, key, where);
}

// A field that must be a JSON array / object.
const json& array_field(const json& j, const char* key, const std::string& where) {
  const json& v = j.at(key);
  if (!v.is_array()) fail("[profile] ", where, ".", key, ": must be an array");
  return v;
}
const json& object_field(const json& j, const char* key, const std::string& where) {
  const json& v = j.at(key);
  if (!v.is_object()) fail("[profile] ", where, ".", key, ": must be an object");
  return v;
}

// A fitted coefficient is a time (per unit of work): finite and >= 0, or
// the cost model would predict negative step times.
double coefficient(const json& j, const char* key, const std::string& where) {
  const double v = get<double>(j, key, where);
  if (!std::isfinite(v) || v < 0)
    fail("[profile] ", where, ".", key, ": ", v, " is not a finite number >= 0 (a fitted time; profile again)");
  return v;
}

PartFit fit_from_json(const json& j, const std::string& where) {
  PartFit f;
  f.a = coefficient(j, "a", where);
  f.c = coefficient(j, "c", where);
  f.d = coefficient(j, "d", where);
  f.max_rel_error = optional_field(j, "max_rel_error", 0.0, where);
  f.mean_rel_error = optional_field(j, "mean_rel_error", 0.0, where);
  if (j.contains("samples"))
    for (const json& s : array_field(j, "samples", where))
      f.samples.push_back({get<int64_t>(s, "s", where), get<int64_t>(s, "b", where),
                           get<double>(s, "seconds", where)});
  return f;
}

}  // namespace

void PartFit::fit() {
  a = c = d = 0;
  max_rel_error = mean_rel_error = 0;
  if (samples.empty()) return;
  std::set<int64_t> lengths;
  std::set<std::pair<int64_t, int64_t>> points;
  for (const FitSample& s : samples) lengths.insert(s.s), points.insert({s.s, s.b});
  // Terms used: all three when two lengths or more and three points, else
  // fewer (a constant from a single point).
  const int terms = points.size() >= 3 && lengths.size() >= 2 ? 3 : points.size() >= 2 ? 2 : 1;
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const FitSample& s : samples) {
    const double bs = static_cast<double>(s.b) * static_cast<double>(s.s);
    std::vector<double> row;
    if (terms == 3) row.push_back(bs * static_cast<double>(s.s));
    if (terms >= 2) row.push_back(bs);
    row.push_back(1.0);
    rows.push_back(row);
    y.push_back(s.seconds);
  }
  std::vector<double> x = nonnegative_least_squares(rows, y);
  if (x.empty()) {  // degenerate: a constant at the mean
    double sum = 0;
    for (double v : y) sum += v;
    d = sum / static_cast<double>(y.size());
  } else {
    size_t k = 0;
    if (terms == 3) a = x[k++];
    if (terms >= 2) c = x[k++];
    d = x[k];
  }
  double total = 0;
  for (const FitSample& s : samples) {
    const double e = s.seconds > 0 ? std::abs(at(s.s, s.b) - s.seconds) / s.seconds : 0.0;
    max_rel_error = std::max(max_rel_error, e);
    total += e;
  }
  mean_rel_error = total / static_cast<double>(samples.size());
}

const ProfileEntry* Profile::find(int tp, int cp) const {
  for (const ProfileEntry& e : entries)
    if (e.tp == tp && e.cp == cp) return &e;
  return nullptr;
}

nlohmann::json Profile::to_json() const {
  json entries_j = json::array();
  for (const ProfileEntry& e : entries) {
    json parts = json::object();
    for (const auto& [name, f] : e.parts) parts[name] = fit_json(f);
    entries_j.push_back({{"tp", e.tp}, {"cp", e.cp}, {"parts", parts}, {"emulation_factor", e.emulation_factor}});
  }
  json opt_samples = json::array();
  for (const auto& [n, t] : optimizer.samples) opt_samples.push_back({{"n", n}, {"seconds", t}});
  json ops_j = json::object();
  for (const auto& [type, f] : ops)
    ops_j[type] = {{"overhead_s", f.overhead_s}, {"s_per_flop", f.s_per_flop},
                   {"s_per_element", f.s_per_element}, {"max_rel_error", f.max_rel_error},
                   {"samples", f.samples}};
  json mem = json::array();
  for (const LayerMemory& m : memory)
    mem.push_back({{"tp", m.tp}, {"cp", m.cp}, {"param_bytes", m.param_bytes}, {"grad_bytes", m.grad_bytes},
                   {"optimizer_bytes", m.optimizer_bytes},
                   {"activation_bytes_per_token", m.activation_bytes_per_token},
                   {"activation_bytes_per_token_recompute", m.activation_bytes_per_token_recompute},
                   {"stage_activation_bytes_per_token", m.stage_activation_bytes_per_token},
                   {"stage_activation_bytes_per_token_recompute", m.stage_activation_bytes_per_token_recompute}});
  return {{"model", model},
          {"config", config.to_json()},
          {"device", device},
          {"threads", threads},
          {"precision", precision},
          {"repetitions", repetitions},
          {"fit", "t = a*b*s^2 + c*b*s + d"},
          {"entries", entries_j},
          {"optimizer", {{"per_param_s", optimizer.per_param_s}, {"fixed_s", optimizer.fixed_s},
                         {"max_rel_error", optimizer.max_rel_error}, {"samples", opt_samples}}},
          {"ops", ops_j},
          {"memory", mem},
          {"emulation_ranks", emulation_ranks},
          {"measurement", {{"cpu_share", cpu_share}, {"load_before", load_before}, {"load_after", load_after},
                           {"cores", cores}, {"under_load", measured_under_load()}}}};
}

Profile Profile::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) fail("[profile] ", source, ": not a JSON object");
  Profile p;
  p.model = optional_field(j, "model", std::string(), source);
  p.config = ModelConfig::from_json(get<json>(j, "config", source), source + ": config");
  p.device = optional_field(j, "device", std::string(), source);
  p.threads = optional_field(j, "threads", 1, source);
  p.precision = optional_field(j, "precision", std::string("fp32"), source);
  if (p.precision != "fp32" && p.precision != "bf16")
    fail("[profile] ", source, ": precision: '", p.precision, "' (expected fp32 or bf16)");
  p.repetitions = optional_field(j, "repetitions", 0, source);
  const json entries = get<json>(j, "entries", source);
  if (!entries.is_array() || entries.empty()) fail("[profile] ", source, ": entries: must be a non-empty array");
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string where = source + ": entries[" + std::to_string(i) + "]";
    ProfileEntry e;
    e.tp = get<int>(entries[i], "tp", where);
    e.cp = get<int>(entries[i], "cp", where);
    if (e.tp < 1 || e.cp < 1) fail("[profile] ", where, ": tp and cp must be >= 1");
    const json parts = get<json>(entries[i], "parts", where);
    for (const char* part : kProfileParts) {
      if (!parts.contains(part)) fail("[profile] ", where, ": missing part '", part, "'");
      e.parts[part] = fit_from_json(parts.at(part), where + "." + part);
    }
    e.emulation_factor = optional_field(entries[i], "emulation_factor", 1.0, where);
    if (!(e.emulation_factor > 0)) fail("[profile] ", where, ": emulation_factor must be positive");
    if (p.find(e.tp, e.cp)) fail("[profile] ", where, ": tp ", e.tp, " cp ", e.cp, " appears twice");
    p.entries.push_back(std::move(e));
  }
  if (j.contains("optimizer")) {
    const json& o = j.at("optimizer");
    p.optimizer.per_param_s = coefficient(o, "per_param_s", source + ": optimizer");
    p.optimizer.fixed_s = coefficient(o, "fixed_s", source + ": optimizer");
    p.optimizer.max_rel_error = optional_field(o, "max_rel_error", 0.0, source + ": optimizer");
    if (o.contains("samples"))
      for (const json& s : array_field(o, "samples", source + ": optimizer"))
        p.optimizer.samples.emplace_back(get<int64_t>(s, "n", source + ": optimizer"),
                                         get<double>(s, "seconds", source + ": optimizer"));
  }
  if (j.contains("ops"))
    for (const auto& [type, f] : object_field(j, "ops", source).items()) {
      const std::string where = source + ": ops." + type;
      OpFit o;
      o.overhead_s = coefficient(f, "overhead_s", where);
      o.s_per_flop = coefficient(f, "s_per_flop", where);
      o.s_per_element = coefficient(f, "s_per_element", where);
      o.max_rel_error = optional_field(f, "max_rel_error", 0.0, where);
      o.samples = optional_field(f, "samples", 0, where);
      p.ops[type] = o;
    }
  if (j.contains("memory"))
    for (const json& m : array_field(j, "memory", source)) {
      const std::string where = source + ": memory";
      LayerMemory l;
      l.tp = get<int>(m, "tp", where);
      l.cp = get<int>(m, "cp", where);
      l.param_bytes = get<int64_t>(m, "param_bytes", where);
      l.grad_bytes = get<int64_t>(m, "grad_bytes", where);
      l.optimizer_bytes = get<int64_t>(m, "optimizer_bytes", where);
      l.activation_bytes_per_token = get<double>(m, "activation_bytes_per_token", where);
      l.activation_bytes_per_token_recompute = get<double>(m, "activation_bytes_per_token_recompute", where);
      l.stage_activation_bytes_per_token = optional_field(m, "stage_activation_bytes_per_token", 0.0, where);
      l.stage_activation_bytes_per_token_recompute =
          optional_field(m, "stage_activation_bytes_per_token_recompute", 0.0, where);
      p.memory.push_back(l);
    }
  p.emulation_ranks = optional_field(j, "emulation_ranks", 0, source);
  if (j.contains("measurement")) {
    const json& m = object_field(j, "measurement", source);
    const std::string where = source + ": measurement";
    p.cpu_share = optional_field(m, "cpu_share", 0.0, where);
    p.load_before = optional_field(m, "load_before", 0.0, where);
    p.load_after = optional_field(m, "load_after", 0.0, where);
    p.cores = optional_field(m, "cores", 0, where);
  }
  return p;
}

bool Profile::measured_under_load() const {
  // The share of its cores the measurement got is immediate; the load
  // average trails by a minute (after a busy minute a quiet machine still
  // shows it), so it is recorded but does not decide.
  return cores > 0 && cpu_share > 0 && cpu_share < 0.75;
}

std::string Profile::load_summary() const {
  char text[160];
  std::snprintf(text, sizeof text, "it got %.0f%% of its %d core%s, load %.1f then %.1f on %d cores",
                100 * cpu_share, threads, threads == 1 ? "" : "s", load_before, load_after, cores);
  return text;
}

Profile Profile::load(const std::string& path) { return from_json(read_json_file(path, "profile"), path); }

}  // namespace hspmd
