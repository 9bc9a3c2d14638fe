// The one-process simulator of the execution model (simulate.h). Ranks run
// as a dataflow: a rank posts its phase (everything it reads from its current
// buffer: collective contributions, outgoing messages), and completes it
// once every input it waits for has been posted by its partners.
#include "resolve/simulator/simulate.h"

#include <algorithm>
#include <deque>

#include "hspmd/core/error.h"
#include "resolve/internal.h"
#include "resolve/simulator/box_arrays.h"

namespace hspmd {

using namespace resolve_internal;

namespace {

using CollKey = std::pair<int, std::vector<int>>;  // (kind, group)

struct Contribution {
  const CommOp* op = nullptr;
  NDArray data;  // all_reduce / reduce_scatter: the box; all_gather: the member's piece
};

struct Message {
  std::vector<Box> boxes;
  std::vector<NDArray> data;
};

struct RankRun {
  const RankResolution* plan = nullptr;
  size_t phase = 0;
  bool posted = false;
  std::optional<Box> box;
  NDArray buf;
  std::vector<std::pair<CollKey, size_t>> waits;  // per collective op of the posted phase
};

// The fresh buffer of a phase and which of its elements were written.
struct Fresh {
  std::optional<Box> box;
  NDArray data;
  std::vector<uint8_t> written;

  void write(int rank, const NDArray& from, const Box& from_box, const Box& region) {
    if (is_empty(region)) return;
    HSPMD_CHECK(box && contains(*box, region), "rank ", rank, " writes ", to_string(region), " outside its out_box");
    HSPMD_CHECK(contains(from_box, region), "rank ", rank, " copies ", to_string(region), " from a smaller box");
    const float* src = from.host_data<float>();
    float* dst = data.host_data<float>();
    for_rows(region, from_box, *box, [&](int64_t a, int64_t b, int64_t n) {
      std::copy(src + a, src + a + n, dst + b);
      std::fill(written.begin() + b, written.begin() + b + n, 1);
    });
  }
};

class Simulator {
 public:
  Simulator(const Resolution& res, const std::map<int, NDArray>& inputs);
  std::map<int, NDArray> run();

 private:
  void post(int rank, RankRun& run);
  bool ready(int rank, const RankRun& run) const;
  void complete(int rank, RankRun& run);
  void run_collective(int rank, const CommOp& op, const std::pair<CollKey, size_t>& wait, Fresh& fresh);
  NDArray read(int rank, const RankRun& run, const Box& region) const;

  const Resolution& res_;
  std::map<int, RankRun> runs_;
  std::map<int, NDArray> passthrough_;
  std::map<CollKey, std::vector<std::map<int, Contribution>>> instances_;
  std::map<std::pair<int, int>, std::deque<Message>> mail_;
  std::map<int, std::map<CollKey, size_t>> seen_;
};

Simulator::Simulator(const Resolution& res, const std::map<int, NDArray>& inputs) : res_(res) {
  for (const auto& [rank, rr] : res.ranks) {
    auto in = inputs.find(rank);
    if (rr.phases.empty()) {
      if (in != inputs.end()) passthrough_[rank] = in->second;
      continue;
    }
    RankRun run;
    run.plan = &rr;
    run.box = rr.phases[0].in_box;
    if (run.box) {
      HSPMD_CHECK(in != inputs.end() && in->second.valid(), "rank ", rank, " has no input");
      HSPMD_CHECK(in->second.shape() == run.box->shape(), "rank ", rank, ": input shape ",
                  shape_str(in->second.shape()), " but in_box ", to_string(*run.box));
      run.buf = in->second.contiguous();
    }
    runs_[rank] = std::move(run);
  }
}

NDArray Simulator::read(int rank, const RankRun& run, const Box& region) const {
  HSPMD_CHECK(run.box && contains(*run.box, region), "rank ", rank, " reads ", to_string(region),
              " outside its in_box");
  return extract(run.buf, *run.box, region);
}

void Simulator::post(int rank, RankRun& run) {
  const CommPhase& ph = run.plan->phases[run.phase];
  HSPMD_CHECK(ph.in_box == run.box, "rank ", rank, " phase ", run.phase, ": in_box does not match its buffer");
  for (const CommOp& op : ph.ops) {
    if (is_collective(op.kind)) {
      const int m = member_index(op, rank);
      const CollKey key{static_cast<int>(op.kind), op.group};
      const size_t idx = seen_[rank][key]++;
      auto& list = instances_[key];
      if (list.size() <= idx) list.resize(idx + 1);
      Contribution c;
      c.op = &op;
      if (is_all_gather(op.kind)) {
        HSPMD_CHECK(op.pieces.size() == op.group.size(), "all_gather with ", op.pieces.size(), " pieces");
        if (!is_empty(op.pieces[m])) c.data = read(rank, run, op.pieces[m]);
      } else {
        c.data = op.contributes ? read(rank, run, op.box) : NDArray::zeros(op.box.shape(), DType::F32);
      }
      list[idx][rank] = std::move(c);
      run.waits.emplace_back(key, idx);
    }
    for (const Transfer& t : op.sends) {
      Message msg{t.boxes, {}};
      for (const Box& b : t.boxes) msg.data.push_back(read(rank, run, b));
      mail_[{rank, t.peer}].push_back(std::move(msg));
    }
  }
  run.posted = true;
}

bool Simulator::ready(int rank, const RankRun& run) const {
  for (const auto& [key, idx] : run.waits)
    if (instances_.at(key)[idx].size() != key.second.size()) return false;
  std::map<int, size_t> wanted;
  for (const CommOp& op : run.plan->phases[run.phase].ops)
    for (const Transfer& t : op.recvs) ++wanted[t.peer];
  for (const auto& [peer, n] : wanted) {
    auto it = mail_.find({peer, rank});
    if (it == mail_.end() || it->second.size() < n) return false;
  }
  return true;
}

void Simulator::run_collective(int rank, const CommOp& op, const std::pair<CollKey, size_t>& wait,
                               Fresh& fresh) {
  const std::map<int, Contribution>& inst = instances_.at(wait.first)[wait.second];
  for (const auto& [member, c] : inst)
    HSPMD_CHECK(c.op->box == op.box && c.op->pieces == op.pieces, "rank ", rank, " and rank ", member,
                " disagree on a ", kind_name(op.kind), " over ", to_string(op.box));
  if (is_all_gather(op.kind)) {
    for (size_t j = 0; j < op.group.size(); ++j)
      fresh.write(rank, inst.at(op.group[j]).data, op.pieces[j], op.pieces[j]);
    return;
  }
  NDArray sum = NDArray::zeros(op.box.shape(), DType::F32);
  for (const auto& [member, c] : inst) add_region(c.data, op.box, sum, op.box, op.box);
  const Box& mine = is_reduce_scatter(op.kind) ? op.pieces[member_index(op, rank)] : op.box;
  fresh.write(rank, sum, op.box, mine);
}

void Simulator::complete(int rank, RankRun& run) {
  const CommPhase& ph = run.plan->phases[run.phase];
  Fresh fresh;
  fresh.box = ph.out_box;
  if (fresh.box) {
    fresh.data = NDArray::zeros(fresh.box->shape(), DType::F32);
    fresh.written.assign(fresh.box->numel(), 0);
  }
  size_t w = 0;
  for (const CommOp& op : ph.ops) {
    if (is_collective(op.kind)) run_collective(rank, op, run.waits[w++], fresh);
    if (op.kind == CommKind::kLocalSlice) fresh.write(rank, read(rank, run, op.box), op.box, op.box);
    for (const Box& b : op.keeps) fresh.write(rank, read(rank, run, b), b, b);
    for (const Transfer& t : op.recvs) {
      std::deque<Message>& queue = mail_[{t.peer, rank}];
      Message msg = std::move(queue.front());
      queue.pop_front();
      HSPMD_CHECK(msg.boxes == t.boxes, "rank ", rank, " expects other boxes from rank ", t.peer);
      for (size_t b = 0; b < msg.boxes.size(); ++b) fresh.write(rank, msg.data[b], msg.boxes[b], msg.boxes[b]);
    }
  }
  HSPMD_CHECK(ph.zero_fill ||
                  std::all_of(fresh.written.begin(), fresh.written.end(), [](uint8_t x) { return x != 0; }),
              "rank ", rank, " phase ", run.phase, ": out_box not fully written");
  run.box = fresh.box;
  run.buf = fresh.data;
  run.waits.clear();
  run.posted = false;
  ++run.phase;
}

std::map<int, NDArray> Simulator::run() {
  auto done = [](const RankRun& r) { return r.phase == r.plan->phases.size(); };
  while (true) {
    bool progress = false, all_done = true;
    for (auto& [rank, run] : runs_)
      if (!done(run) && !run.posted) post(rank, run), progress = true;
    for (auto& [rank, run] : runs_) {
      if (!done(run) && ready(rank, run)) complete(rank, run), progress = true;
      all_done = all_done && done(run);
    }
    if (all_done) break;
    HSPMD_CHECK(progress, "reshard '", res_.name, "': deadlock: some rank waits for a partner that never comes");
  }
  for (const auto& [pair, queue] : mail_)
    HSPMD_CHECK(queue.empty(), "reshard '", res_.name, "': rank ", pair.first, " sent a message rank ", pair.second,
                " never received");
  for (const auto& [key, list] : instances_)
    for (const auto& inst : list)
      HSPMD_CHECK(inst.size() == key.second.size(), "reshard '", res_.name, "': unmatched ",
                  kind_name(static_cast<CommKind>(key.first)));
  std::map<int, NDArray> out = passthrough_;
  for (auto& [rank, run] : runs_)
    if (run.box) out[rank] = run.buf;
  return out;
}

}  // namespace

std::map<int, NDArray> simulate(const Resolution& resolution, const std::map<int, NDArray>& inputs) {
  for (const auto& [rank, a] : inputs)
    if (a.valid() && a.dtype() != DType::F32) fail("[simulate] rank ", rank, ": inputs must be f32");
  return Simulator(resolution, inputs).run();
}

}  // namespace hspmd
