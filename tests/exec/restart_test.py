#!/usr/bin/env python3
"""Restart after a crashed rank (`hspmd train --nproc N --max-restarts K`,
docs/reliability.md, "Restart after a crash"), with
examples/models/llama-tiny-8l.json on 4 ranks (two pipelines of two stages,
ZeRO-1):

* --part crash: a rank killed with SIGKILL in the middle of the run is
  restarted from the last checkpoint (--save-every 1); the job exits 0, every
  step appears once in the log with the loss of an uninterrupted run, and the
  log holds one restart record (from_step, recovery_s > 0) right before the
  re-run steps. The same for a rank killed during setup (a restart from step
  0), for an mpirun that does not end the job (stopped: the launcher ends it
  after 10 s), and under --events (the restarted run continues under the
  re-planned strategy). A second kill after one restart (--max-restarts 1)
  ends the job with the usual line and exit 1;
* --part foreign: a checkpoint directory of another run is never replaced
  or resumed unasked: a fresh run there is refused with one line (the old
  checkpoint stays byte for byte); with --overwrite-checkpoint it starts
  anew, and a rank killed before or after its first commit restarts from
  this run's own checkpoint (or the start), never from the other run's later
  step: every step once, with the uninterrupted losses;
* --part no-restart: with --max-restarts 0 (the default) a killed rank ends
  the job as before; a rank's own error (a non-finite loss) is not restarted;
  --max-restarts without --nproc, --checkpoint or --save-every, or below 0, is
  refused with one line.

usage: restart_test.py --hspmd PATH --repo PATH --part crash|foreign|no-restart
"""
import argparse
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher_test import job_pids, log_lines, roles, wait_for  # noqa: E402

STEPS = 12


def pipeline(ranks):
    return {"micro_batch_size": 1, "micro_batches": 2,
            "stages": [{"ranks": [ranks[0]], "layers": [0, 3]}, {"ranks": [ranks[1]], "layers": [4, 7]}]}


STRATEGY = {"schedule": "1f1b", "zero": True, "pipelines": [pipeline([0, 1]), pipeline([2, 3])]}


def records(path, strict=True):
    """The log's JSON objects; while the run writes it, a torn last line is left out (strict=False)."""
    out = []
    for line in log_lines(path):
        try:
            out.append(json.loads(line))
        except ValueError:
            if strict:
                raise
    return out


def steps_of(recs):
    return [r for r in recs if "event" not in r]


class Job:
    def __init__(self, a, tmp):
        self.a, self.tmp = a, tmp
        self.model = os.path.join(a.repo, "examples", "models", "llama-tiny-8l.json")
        self.data = os.path.join(tmp, "data.bin")
        rng = random.Random(5)
        with open(self.data, "wb") as f:
            f.write(b"".join(struct.pack("<I", rng.randrange(256)) for _ in range(20000)))
        self.strategy = os.path.join(tmp, "pp2x2_zero.json")
        json.dump(STRATEGY, open(self.strategy, "w"))
        self.failures = []

    def cmd(self, name, extra=(), restarts=1, lr="1e-3"):
        c = [self.a.hspmd, "train", "--model", self.model, "--data", self.data, "--seq-len", "32",
             "--steps", str(STEPS), "--lr", lr, "--weight-decay", "0.1", "--clip-grad", "1", "--quiet",
             "--threads", "1", "--strategy", self.strategy, "--nproc", "4", "--device", self.a.device,
             # --save-every last: the flag cases drop it as base[:-2]
             "--log", self.path(name + ".jsonl"), "--checkpoint", self.path(name + ".ckpt"), "--save-every", "1"]
        if restarts is not None:
            c += ["--max-restarts", str(restarts)]
        return c + list(extra)

    def path(self, name):
        return os.path.join(self.tmp, name)

    def start(self, name, extra=(), restarts=1, lr="1e-3"):
        return subprocess.Popen(self.cmd(name, extra, restarts, lr), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def check(self, label, ok, detail=""):
        print(f"{label:60s} {'ok' if ok else 'FAIL'} {detail}", flush=True)
        if not ok:
            self.failures.append(label)

    def kill_rank(self, label, p, rank, when):
        """SIGKILL `rank` once when() holds; returns the time of the kill (or None)."""
        if not wait_for(lambda: when() or p.poll() is not None, 240, 0.05) or p.poll() is not None:
            self.check(label + ": the run got there", False, "exited early: " + p.stderr.read()[-2000:])
            return None
        pids = [pid for pid, role in roles(job_pids(self.strategy)).items() if role == f"rank {rank}"]
        self.check(label + f": rank {rank} found", len(pids) == 1, str(pids))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return time.time()

    def ends(self, label, p, timeout=180):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.check(label + ": the launcher exits", False, f"still running after {timeout} s")
            pids = ",".join(str(pid) for pid in roles(job_pids(self.strategy)))
            if pids:
                subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,args", "-p", pids])
            p.kill()
            p.wait()
        return p.returncode, p.stderr.read()

    def all_gone(self, label, timeout=20):
        gone = wait_for(lambda: not roles(job_pids(self.strategy)), timeout)
        left = sorted(roles(job_pids(self.strategy)).values())
        self.check(label + ": no process of the job is left", gone, str(left))


def part_crash(j):
    p = j.start("reference")
    rc, err = j.ends("uninterrupted run", p)
    j.check("uninterrupted run: exit 0", rc == 0, err.strip()[-500:])
    want = {r["step"]: r["loss"] for r in steps_of(records(j.path("reference.jsonl")))}
    j.check("uninterrupted run: every step logged", sorted(want) == list(range(STEPS)), str(sorted(want)))

    log = j.path("crash.jsonl")
    p = j.start("crash")
    # Checkpoints are committed in the background, a step or more late.
    ckpt = j.path("crash.ckpt")
    killed = j.kill_rank("crash", p, 1, lambda: len(steps_of(records(log, False))) >= 4 and
                         os.path.exists(os.path.join(ckpt, "index.json")))
    rc, err = j.ends("crash", p)
    lines = [l for l in err.splitlines() if l.strip()]
    j.check("crash: exit 0 after one restart", rc == 0 and killed is not None, f"rc {rc}: {err.strip()[-800:]!r}")
    j.check("crash: one warning line naming the rank, signal and restart",
            len(lines) == 1 and "rank 1 was killed by signal 9" in lines[0] and "restarting from" in lines[0],
            repr(lines[:4]))
    recs = records(log)
    steps = [r["step"] for r in steps_of(recs)]
    j.check("crash: each step once, in order", steps == list(range(STEPS)), str(steps))
    got = {r["step"]: r["loss"] for r in steps_of(recs)}
    diff = [(s, want.get(s), got.get(s)) for s in range(STEPS) if want.get(s) != got.get(s)]
    j.check("crash: every loss equals the uninterrupted run's (exactly)", not diff, str(diff[:3]))
    restarts = [(k, r) for k, r in enumerate(recs) if r.get("event") == "restart"]
    j.check("crash: one restart record", len(restarts) == 1, str(restarts))
    if restarts:
        k, r = restarts[0]
        j.check("crash: restart record fields", r.get("attempt") == 1 and isinstance(r.get("from_step"), int) and
                1 <= r["from_step"] < STEPS and "signal 9" in r.get("reason", "") and
                isinstance(r.get("recovery_s"), float) and r["recovery_s"] > 0 and
                0 <= r.get("detect_s", -1) <= r["recovery_s"], json.dumps(r))
        after = recs[k + 1] if k + 1 < len(recs) else {}
        j.check("crash: the re-run starts right after the record at from_step",
                after.get("step") == r.get("from_step") and "event" not in after, json.dumps(after)[:200])
    j.all_gone("crash")

    # Killed during setup, before the first checkpoint: a restart from the
    # start, whose rank 0 truncates the log as any fresh run does; the
    # launcher puts the restart record back in front at the end.
    log = j.path("early.jsonl")
    p = j.start("early")
    j.kill_rank("early", p, 3, lambda: any(r == "rank 3" for r in roles(job_pids(j.strategy)).values()))
    rc, err = j.ends("early", p)
    j.check("early: exit 0 after one restart", rc == 0, f"rc {rc}: {err.strip()[-800:]!r}")
    recs = records(log)
    j.check("early: the restart record first, from step 0, then every step once with its loss",
            recs and recs[0].get("event") == "restart" and recs[0].get("from_step") == 0 and
            recs[0].get("recovery_s", 0) > 0 and
            [(r["step"], r["loss"]) for r in recs[1:]] == [(s, want.get(s)) for s in range(STEPS)],
            json.dumps(recs[:2])[:400])
    j.all_gone("early")

    # mpirun wedged (stopped here; Open MPI 4.1 has hung so when a rank died
    # during MPI_Init): the launcher ends the attempt 10 s after the death.
    log = j.path("wedged.jsonl")
    p = j.start("wedged")
    if wait_for(lambda: len(steps_of(records(log, False))) >= 3 or p.poll() is not None, 240, 0.05):
        for pid in [pid for pid, role in roles(job_pids(j.strategy)).items() if role == "mpirun"]:
            os.kill(pid, signal.SIGSTOP)
    j.kill_rank("wedged", p, 2, lambda: True)
    rc, err = j.ends("wedged", p)
    recs = records(log)
    restarts = [r for r in recs if r.get("event") == "restart"]
    j.check("wedged mpirun: ended after 10 s, restarted, exit 0",
            rc == 0 and len(restarts) == 1 and "mpirun had not ended the job 10 s later" in err and
            10 <= restarts[0].get("detect_s", 0) < 20, f"rc {rc}: {err.strip()[-400:]!r} {restarts}")
    j.check("wedged mpirun: each step once with its loss",
            [(r["step"], r["loss"]) for r in steps_of(recs)] == [(s, want.get(s)) for s in range(STEPS)])
    j.all_gone("wedged")

    # --events passes through a restart: the run resumes under the re-planned
    # strategy that the failure at step 3 led to.
    events = j.path("events.json")
    json.dump([{"step": 3, "fail": [3]}], open(events, "w"))
    p = j.start("events_ref", ["--events", events])
    rc, err = j.ends("events, uninterrupted", p)
    ref = records(j.path("events_ref.jsonl"))
    j.check("events, uninterrupted: exit 0 with a reconfigure record",
            rc == 0 and any(r.get("event") == "reconfigure" for r in ref), err.strip()[-400:])
    ckpt = j.path("events.ckpt")
    p = j.start("events", ["--events", events])
    j.kill_rank("events", p, 1, lambda: os.path.exists(os.path.join(ckpt, "index.json")) and
                json.load(open(os.path.join(ckpt, "index.json")))["step"] >= 5)
    rc, err = j.ends("events", p)
    recs = records(j.path("events.jsonl"))
    j.check("events: restarted after the reconfiguration, exit 0, the uninterrupted losses",
            rc == 0 and [r.get("from_step", 0) >= 5 for r in recs if r.get("event") == "restart"] == [True] and
            [(r["step"], r["loss"]) for r in steps_of(recs)] == [(r["step"], r["loss"]) for r in steps_of(ref)],
            f"rc {rc}: {err.strip()[-400:]!r}")
    j.all_gone("events")

    log = j.path("twice.jsonl")
    p = j.start("twice")
    j.kill_rank("twice, first kill", p, 2, lambda: len(steps_of(records(log, False))) >= 3)
    j.kill_rank("twice, second kill", p, 1, lambda: any(r.get("event") == "restart" and r.get("recovery_s")
                                                        for r in records(log, False)))
    rc, err = j.ends("twice", p)
    lines = [l for l in err.splitlines() if l.strip()]
    j.check("twice: exit 1 after --max-restarts 1, the last failure named",
            rc == 1 and len(lines) == 2 and "rank 2 was killed by signal 9" in lines[0] and
            "rank 1 was killed by signal 9" in lines[1] and "after 1 restart" in lines[1], repr(lines[:4]))
    j.all_gone("twice")


def part_foreign(j):
    # The other run: uninterrupted, its checkpoint at the last step.
    p = j.start("other")
    rc, err = j.ends("the other run", p)
    j.check("the other run: exit 0", rc == 0, err.strip()[-500:])
    want = {r["step"]: r["loss"] for r in steps_of(records(j.path("other.jsonl")))}
    ckpt = j.path("other.ckpt")
    index = open(os.path.join(ckpt, "index.json"), "rb").read()
    j.check("the other run: its checkpoint at step 12", json.loads(index).get("step") == STEPS, str(index[:80]))

    # A fresh run naming that directory is refused before any rank starts.
    cmd = j.cmd("fresh")
    cmd[cmd.index("--checkpoint") + 1] = ckpt
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    j.check("a fresh run in the other run's directory: exit 1, one [flags] --checkpoint line",
            r.returncode == 1 and len(lines) == 1 and "[flags] --checkpoint" in lines[0] and
            "of step 12" in lines[0] and "--resume" in lines[0] and "--overwrite-checkpoint" in lines[0],
            f"rc {r.returncode}: {r.stderr.strip()[:400]!r}")
    j.check("... the other run's checkpoint is untouched",
            open(os.path.join(ckpt, "index.json"), "rb").read() == index and
            len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) == 4)
    base = j.cmd("flags", restarts=None)
    r = subprocess.run(base[:base.index("--checkpoint")] + ["--overwrite-checkpoint"], capture_output=True,
                       text=True, timeout=120)
    j.check("--overwrite-checkpoint without --checkpoint: one [flags] line",
            r.returncode == 1 and "[flags] --overwrite-checkpoint needs --checkpoint" in r.stderr, r.stderr[:300])

    # With --overwrite-checkpoint: a kill, then a restart that resumes only
    # this run's own checkpoints (step 12 of the other run would skip the
    # whole run, or fail it).
    log = j.path("fresh.jsonl")
    p = subprocess.Popen(cmd + ["--overwrite-checkpoint"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    killed = j.kill_rank("overwrite", p, 1, lambda: len(steps_of(records(log, False))) >= 2)
    rc, err = j.ends("overwrite", p)
    recs = records(log)
    restarts = [r for r in recs if r.get("event") == "restart"]
    j.check("overwrite: exit 0 after one restart from this run's own point",
            rc == 0 and killed is not None and len(restarts) == 1 and restarts[0].get("from_step", 99) < 4,
            f"rc {rc}: {err.strip()[-600:]!r} {restarts}")
    j.check("overwrite: each step once with the uninterrupted losses",
            [(r["step"], r["loss"]) for r in steps_of(recs)] == [(s, want.get(s)) for s in range(STEPS)],
            str([(r["step"], r["loss"]) for r in steps_of(recs)][:6]))
    meta = json.load(open(os.path.join(ckpt, "index.json"))).get("meta", {})
    j.check("overwrite: the directory now holds this run's checkpoint (another run id)",
            meta.get("run_id") and meta.get("run_id") != json.loads(index)["meta"].get("run_id"), str(meta)[:200])
    j.all_gone("overwrite")


def part_no_restart(j):
    log = j.path("plain.jsonl")
    p = j.start("plain", restarts=None)
    j.kill_rank("--max-restarts 0", p, 1, lambda: len(steps_of(records(log, False))) >= 3)
    rc, err = j.ends("--max-restarts 0", p)
    lines = [l for l in err.splitlines() if l.strip()]
    j.check("--max-restarts 0: exit 1, one line naming rank 1 and signal 9",
            rc == 1 and len(lines) == 1 and "rank 1 was killed by signal 9" in lines[0] and
            "restart" not in lines[0], repr(lines[:4]))
    j.check("--max-restarts 0: no restart record",
            not any(r.get("event") == "restart" for r in records(log, False)))
    j.all_gone("--max-restarts 0")

    p = j.start("nan", lr="1e20")
    rc, err = j.ends("a rank's own error", p)
    lines = [l for l in err.splitlines() if l.strip()]
    j.check("a rank's own error: exit 1, its one line, not restarted",
            rc == 1 and len(lines) == 1 and "[train]" in lines[0] and "restart" not in err, repr(lines[:4]))
    j.check("a rank's own error: no restart record",
            not any(r.get("event") == "restart" for r in records(j.path("nan.jsonl"), False)))
    j.all_gone("a rank's own error")

    base = j.cmd("flags", restarts=None)
    no_ckpt = base[:base.index("--checkpoint")]
    single = [a for a in no_ckpt if a not in ("--nproc", "4")] + ["--global-batch", "4"]
    single.remove("--strategy")
    single.remove(j.strategy)
    for label, cmd, needle in [
            ("without --nproc", single + ["--max-restarts", "1"], "needs --nproc"),
            ("without --checkpoint", no_ckpt + ["--max-restarts", "1"], "needs --checkpoint"),
            ("without --save-every", base[:-2] + ["--max-restarts", "1"], "needs --checkpoint"),
            ("below 0", base + ["--max-restarts", "-1"], "must be >= 0")]:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        j.check(f"--max-restarts {label}: one [flags] line", r.returncode == 1 and len(lines) == 1 and
                "[flags] --max-restarts" in lines[0] and needle in lines[0],
                f"rc {r.returncode}: {r.stderr.strip()[:300]!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--part", required=True, choices=["crash", "foreign", "no-restart"])
    ap.add_argument("--device", default="cpu",
                    help="hspmd train --device for every run (cpu:1: the device test double, docs/cuda.md)")
    a = ap.parse_args()
    if a.device.startswith("cuda"):  # a GPU run on a machine without one: skipped (77), as the other tests
        # `hspmd train` checks the device before anything else.
        err = subprocess.run([a.hspmd, "train", "--model", "none.json", "--data", "none.bin", "--seq-len", "8",
                              "--steps", "1", "--device", a.device], capture_output=True, text=True).stderr
        if "no CUDA device" in err or "no CUDA backend" in err:
            print("SKIP: " + err.strip())
            sys.exit(77)
    with tempfile.TemporaryDirectory(prefix="hspmd-restart-") as tmp:
        j = Job(a, tmp)
        try:
            {"crash": part_crash, "foreign": part_foreign, "no-restart": part_no_restart}[a.part](j)
        finally:
            for pid in roles(job_pids(j.strategy)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    if j.failures:
        sys.exit("FAILED: " + ", ".join(j.failures))
    print("PASS")


if __name__ == "__main__":
    main()
