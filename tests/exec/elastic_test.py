"""Elastic training (`hspmd train --events E.json`, docs/elastic.md) trains
the same model as one process: through a trace of two failures, a join and
a slowdown on 8 emulated ranks of two device speeds, with and without ZeRO-1,
every step's loss (1e-5 relative) and the final weights (1e-4) equal the
single-process run's; the failed ranks send nothing in their own failure's
reconfiguration; under ZeRO the slices only they held come from the
checkpoint of that step, or the run rolls back to an earlier checkpoint and
trains its steps again, and without any the run stops in one line. Also: an
event naming its strategy, a straggler found by the sliding window and
switched away from, a resumed run that continues under the re-planned
strategy, and bad events refused before training starts.

`--part gpu`: the trace's failures and join without the emulated cluster
(`--cluster` emulates on the CPU and is refused with `--device cuda`): the
re-plans see a uniform cluster; losses and weights against one process as
above, the failed ranks silent, the checkpoint serving ZeRO's lost slices.
scripts/gpu_check.sh runs it with `--device cuda:0` (ranks sharing the GPU)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from equivalence_test import c2_like, records  # noqa: E402
from switch_test import Harness  # noqa: E402

# Two device speeds: ranks 4-7 take twice as long. One catalog entry per
# type with the same peak, so the planner's roofline sees the slowdown only.
CLUSTER = {"catalog": {t: {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100, "inter_node_gbps": 25}
                       for t in ("fast", "slow")},
           "nodes": [{"type": "fast", "ranks": [0, 3]}, {"type": "slow", "ranks": [4, 7], "slowdown": 2.0}]}
TRACE = [{"step": 2, "fail": [5]}, {"step": 4, "fail": [1]}, {"step": 6, "join": [5]},
         {"step": 7, "slowdown": {"2": 3.0}}]
TRACE_NO_CLUSTER = TRACE[:3]  # a slowdown is the emulated clock's


class Elastic:
    def __init__(self, h, cluster=True):
        self.h = h
        self.cluster = h.path("cluster.json") if cluster else None
        if cluster:
            json.dump(CLUSTER, open(self.cluster, "w"))

    def train(self, name, strategy, events, extra=(), env=None):
        """(rc, stderr, step records, event records, weights)."""
        h = self.h
        log, weights, ev = h.path(name + ".jsonl"), h.path(name + ".safetensors"), h.path(name + ".events.json")
        json.dump(events, open(ev, "w"))
        extra = list(extra)
        if "--straggler-window" not in extra:  # only the straggler case watches: CPU-clock noise stays out
            extra += ["--straggler-window", "0"]
        cmd = h.base + ["--strategy", h.strategy_file(name, strategy), "--nproc", "8"] + \
            (["--cluster", self.cluster] if self.cluster else []) + \
            ["--events", ev, "--log", log, "--save", weights] + extra
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        recs = records(log) if os.path.exists(log) else []
        steps = [x for x in recs if "loss" in x]
        events_out = [x for x in recs if "event" in x]
        if r.returncode:
            return r.returncode, r.stderr, steps, events_out, {}
        from equivalence_test import read_safetensors
        return 0, r.stderr, steps, events_out, read_safetensors(weights)


def trace_case(e, zero):
    h = e.h
    label = "trace" + (" zero" if zero else "") + ("" if e.cluster else " no-cluster")
    trace = TRACE if e.cluster else TRACE_NO_CLUSTER
    extra = ["--checkpoint", h.path(label.replace(" ", "_") + "_ckpt"), "--save-every", "2"]
    if zero:
        extra.append("--checkpoint-sync")  # the other runs write on the background thread
    rc, err, steps, evs, weights = e.train(label.replace(" ", "_"), c2_like(zero)[1], trace, extra)
    if rc:
        return h.check(label, False, f"exit {rc}: {err.strip()[-400:]}")
    reconf = [x for x in evs if x["event"] == "reconfigure"]
    h.compare(label, steps, reconf, weights, want_switches=3)
    failed = set()
    for ev in trace:
        if "fail" not in ev and "join" not in ev:
            continue
        failed |= set(ev.get("fail", []))
        failed -= set(ev.get("join", []))
        rec = next((x for x in reconf if x["step"] == ev["step"]), None)
        if rec is None:
            h.check(f"{label} @{ev['step']}", False, "no reconfigure record")
            continue
        used = {r for p in rec["strategy"]["pipelines"] for s in p["stages"] for r in s["ranks"]}
        silent = all(rec["bytes_sent"][r] == 0 for r in ev.get("fail", []))
        # Two pipelines hold every weight and moment twice unless ZeRO splits
        # the moments, and re-plans keep two pipelines: without ZeRO the
        # survivors serve every failure, with it the checkpoint does.
        ckpt = sum(rec["from_checkpoint_bytes"])
        want_ckpt = (ckpt > 0) == (zero and "fail" in ev)
        fields = all(k in rec for k in ("cause", "planning_s", "specialize_s", "switch_s", "bytes_sent",
                                        "from_checkpoint_bytes", "strategy"))
        h.check(f"{label} @{ev['step']} {rec['cause']}",
                silent and not (used & failed) and sorted(rec["failed"]) == sorted(failed) and want_ckpt and fields,
                f"failed ranks sent {[rec['bytes_sent'][r] for r in ev.get('fail', [])]}, plan uses {sorted(used)}, "
                f"checkpoint bytes {ckpt}")
    if e.cluster:
        slow = [x for x in evs if x["event"] == "slowdown"]
        h.check(f"{label} slowdown record", len(slow) == 1 and slow[0]["step"] == 7, json.dumps(slow)[:200])


def no_checkpoint_case(e):
    """ZeRO: rank 5's optimizer shards exist nowhere else and no checkpoint is
    written at step 2: the run stops there with one line."""
    h = e.h
    rc, err, steps, evs, _ = e.train("zero_no_ckpt", c2_like(True)[1], TRACE,
                                     ["--checkpoint", h.path("zero3_ckpt"), "--save-every", "3"])
    lines = [l for l in err.splitlines() if l.strip()]
    h.check("zero, no checkpoint at the failure", rc != 0 and len(lines) == 1 and "[elastic] step 2" in err and
            "no checkpoint" in err and len(steps) == 2, repr(err.strip()[-300:]))


def rollback_case(e):
    """ZeRO with a checkpoint every 3 steps: the failures before steps 4 and
    8 find no checkpoint of their step, so the state is loaded under the
    re-planned strategy from the last one (steps 3 and 6) and those steps
    are trained again; the log keeps one record per step."""
    h = e.h
    events = [{"step": 4, "fail": [5]}, {"step": 8, "fail": [1]}]
    rc, err, steps, evs, weights = e.train("rollback", c2_like(True)[1], events,
                                           ["--checkpoint", h.path("rollback_ckpt"), "--save-every", "3"])
    if rc:
        return h.check("rollback", False, f"exit {rc}: {err.strip()[-400:]}")
    reconf = [x for x in evs if x["event"] == "reconfigure"]
    h.compare("rollback", steps, [], weights)
    back = [(x["step"], x.get("rollback_to")) for x in reconf]
    h.check("rollback targets", back == [(4, 3), (8, 6)] and [s["step"] for s in steps] == list(range(9)) and
            all(sum(x["from_checkpoint_bytes"]) > 0 and not any(x["bytes_sent"]) for x in reconf),
            f"reconfigurations (step, rollback_to) {back}")


def named_strategy_case(e):
    h = e.h
    seven = c2_like(False, seven=True)[1]
    p = h.strategy_file("named_next", seven)
    events = [{"step": 3, "fail": [7], "strategy": p}]
    rc, err, steps, evs, weights = e.train("named", c2_like(False)[1], events)
    if rc:
        return h.check("named strategy", False, f"exit {rc}: {err.strip()[-400:]}")
    reconf = [x for x in evs if x["event"] == "reconfigure"]
    h.compare("named strategy", steps, reconf, weights, want_switches=1)
    h.check("named strategy taken", bool(reconf) and reconf[0]["strategy"]["pipelines"] == json.load(open(p))[
        "pipelines"] and reconf[0]["planning_s"] == 0, json.dumps(reconf[0]["strategy"])[:200] if reconf else "")
    # A strategy that uses a rank failed by then is refused before step 0.
    rc, err, steps, evs, _ = e.train("named_bad", c2_like(False)[1], [{"step": 3, "fail": [6], "strategy": p}])
    h.check("named strategy on a failed rank", rc != 0 and "uses rank 6" in err and not steps, err.strip()[-200:])


def straggler_case(hs, tmp):
    """Rank 1 (in the TP2 pair of the longer pipeline) becomes 8x slower: the
    window finds it, the planner moves work off it, step times recover."""
    h = Harness(hs, tmp, 40)
    e = Elastic(h)
    # The model clock: deterministic emulated times from a profile, which
    # the planner reads too.
    prof = h.path("profile.json")
    r = subprocess.run([hs, "profile", "--model", h.model, "--tp", "1,2,4", "--seq-lens", "8,16",
                        "--micro-batch-sizes", "1,2", "--repetitions", "3", "-o", prof], capture_output=True, text=True)
    if r.returncode:
        h.check("straggler profile", False, r.stderr.strip()[-300:])
        return h.failures
    # Devices 20x slower than this machine: the emulated steps then weigh
    # far more than the switch's wall-clock cost (planning, specialization)
    # however loaded the machine is, so the decision does not flip.
    pj = json.load(open(prof))
    for entry in pj["entries"]:
        for part in entry["parts"].values():
            for k in ("a", "c", "d"):
                part[k] *= 20
    for fit in pj["ops"].values():
        for k in ("overhead_s", "s_per_flop", "s_per_element"):
            fit[k] *= 20
    for k in ("per_param_s", "fixed_s"):
        pj["optimizer"][k] *= 20
    json.dump(pj, open(prof, "w"))
    rc, err, steps, evs, weights = e.train("straggler", c2_like(False)[1], [{"step": 2, "slowdown": {"1": 8.0}}],
                                           ["--straggler-window", "2", "--clock", "model", "--profile", prof])
    if rc:
        h.check("straggler", False, f"exit {rc}: {err.strip()[-400:]}")
        return h.failures
    reconf = [x for x in evs if x["event"] == "reconfigure"]
    found = [x for x in evs if x["event"] == "straggler" and x["switch"]]
    h.compare("straggler (losses)", steps, reconf, weights)
    if not found or not reconf:
        h.check("straggler found and left", False, json.dumps(evs)[:400])
        return h.failures
    est = found[0]["estimated_slowdown"]["1"]
    at = reconf[0]["step"]
    slow = statistics.median(s["emulated_step_time_s"] for s in steps if 2 <= s["step"] < at)
    after = statistics.median(s["emulated_step_time_s"] for s in steps if s["step"] > at)
    h.check("straggler found and left", reconf[0]["cause"].startswith("straggler") and 7 < est < 9 and
            after < 0.8 * slow and found[0]["gain_s"] > found[0]["cost_s"],
            f"rank 1 estimated x{est:.2f}, switched before step {at}: emulated step {slow * 1e3:.2f} ms -> "
            f"{after * 1e3:.2f} ms")
    return h.failures


def resume_case(e):
    """A run killed while writing the checkpoint of step 6 resumes from step 5
    under the strategy re-planned at step 4, with ranks 1 and 5 failed, and
    goes on through the remaining events."""
    h = e.h
    ckpt = h.path("resume_ckpt")
    env = dict(os.environ, HSPMD_FAULT_KILL_CHECKPOINT="2:6")
    extra = ["--checkpoint", ckpt, "--save-every", "1"]
    rc, err, *_ = e.train("resume_a", c2_like(True)[1], TRACE, extra, env=env)
    index = json.load(open(os.path.join(ckpt, "index.json")))
    rc, err, steps, evs, weights = e.train("resume_b", c2_like(True)[1], TRACE, ["--resume", ckpt] + extra)
    if rc:
        return h.check("resume under events", False, f"exit {rc}: {err.strip()[-400:]}")
    steps = [s for s in steps if s["step"] >= index["step"]]
    reconf = [x for x in evs if x["event"] == "reconfigure" and x["step"] >= index["step"]]
    uses = {r for p in index["meta"]["strategy"]["pipelines"] for s in p["stages"] for r in s["ranks"]}
    h.compare(f"resume under events @{index['step']}", steps, reconf, weights, first_step=index["step"],
              want_switches=1)
    h.check("resumed plan avoids failed ranks", index["step"] == 5 and not uses & {1, 5}, f"plan uses {sorted(uses)}")


def resume_foreign_plan_case(e):
    """A checkpoint written by a run without events (step 5, every rank busy)
    resumed under an events file that fails ranks 5 and 1 before step 5: the
    resumed run re-plans before it trains (a reconfigure record at step 5),
    no step gives 1 or 5 work, and it trains the same model. Before the fix
    the checkpoint's plan gave the failed ranks work."""
    h = e.h
    ckpt = h.path("foreign_ckpt")
    events = [{"step": 2, "fail": [5]}, {"step": 4, "fail": [1]}]
    # run A: the same strategy, no failures (a slowdown of 1 after the
    # checkpoint step keeps --events legal); killed after writing step 5.
    env = dict(os.environ, HSPMD_FAULT_KILL_CHECKPOINT="2:6")
    extra = ["--checkpoint", ckpt, "--save-every", "1"]
    e.train("foreign_a", c2_like(False)[1], [{"step": 8, "slowdown": {"2": 1.0}}], extra, env=env)
    index = json.load(open(os.path.join(ckpt, "index.json")))
    used = {r for p in index["meta"]["strategy"]["pipelines"] for s in p["stages"] for r in s["ranks"]} \
        if "strategy" in index["meta"] else set(range(8))
    rc, err, steps, evs, weights = e.train("foreign_b", c2_like(False)[1], events, ["--resume", ckpt] + extra)
    if rc:
        return h.check("resume: failed ranks in the checkpoint's plan", False, f"exit {rc}: {err.strip()[-400:]}")
    steps = [s for s in steps if s["step"] >= index["step"]]
    reconf = [x for x in evs if x["event"] == "reconfigure" and x["step"] >= index["step"]]
    uses = {r for x in reconf[:1] for p in x["strategy"]["pipelines"] for s in p["stages"] for r in s["ranks"]}
    h.compare(f"resume: failed ranks in the checkpoint's plan @{index['step']}", steps, reconf, weights,
              first_step=index["step"], want_switches=1)
    h.check("resume re-plans away from failed ranks",
            index["step"] == 5 and used & {1, 5} and reconf and reconf[0]["step"] == 5 and
            reconf[0]["cause"].startswith("resume") and not uses & {1, 5},
            f"checkpoint plan uses {sorted(used)}, resumed plan uses {sorted(uses)}")


def bad_events_case(e):
    h = e.h
    bad = {"rank outside the world": ([{"step": 2, "fail": [8]}], "outside the world"),
           "join of a rank that never failed": ([{"step": 2, "join": [1]}], "never failed"),
           "every rank failed": ([{"step": 2, "fail": [0, 1, 2, 3]}, {"step": 3, "fail": [4, 5, 6, 7]}],
                                 "every rank"),
           "unknown key": ([{"step": 2, "fial": [1]}], "unknown key 'fial'"),
           "step beyond the run": ([{"step": 9, "fail": [1]}], "must lie in"),
           "not a list": ({"step": 2}, "expected a JSON list"),
           # Factors the emulated clocks cannot carry (1e30 ran to 9.2e9 s, then 0).
           "slowdown 1e30": ([{"step": 2, "slowdown": {"1": 1e30}}], "must lie in [0.001, 1000]"),
           "slowdown 1e308": ([{"step": 2, "slowdown": {"1": 1e308}}], "must lie in [0.001, 1000]"),
           "slowdown 1e-300": ([{"step": 2, "slowdown": {"1": 1e-300}}], "must lie in [0.001, 1000]")}
    for what, (events, want) in bad.items():
        rc, err, steps, evs, _ = e.train("bad", c2_like(False)[1], events)
        lines = [l for l in err.splitlines() if l.strip()]
        h.check(f"bad events: {what}", rc != 0 and len(lines) == 1 and want in err and "[events]" in err and
                not os.path.exists(h.path("bad.jsonl")), lines[0][:160] if lines else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--part", default="all", choices=["all", "trace", "more", "gpu"])
    ap.add_argument("--device", default="cpu",
                    help="hspmd train --device for every run (cpu:1: the device test double, docs/cuda.md)")
    a = ap.parse_args()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(a.hspmd, tmp, 9, extra=("--device", a.device))
        e = Elastic(h, cluster=a.part != "gpu")
        if a.part == "gpu":
            trace_case(e, False)
            trace_case(e, True)
        if a.part in ("all", "trace"):
            trace_case(e, False)
            trace_case(e, True)
            no_checkpoint_case(e)
            rollback_case(e)
        if a.part in ("all", "more"):
            named_strategy_case(e)
            resume_case(e)
            resume_foreign_plan_case(e)
            bad_events_case(e)
        failures += h.failures
        if a.part in ("all", "more"):
            sub = os.path.join(tmp, "straggler")
            os.makedirs(sub)
            failures += straggler_case(a.hspmd, sub)
    if failures:
        sys.exit(f"{len(failures)} failure(s): {failures}")
    print("all elastic cases passed")


if __name__ == "__main__":
    main()
