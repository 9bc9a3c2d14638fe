#!/usr/bin/env python3
"""`hspmd train --nproc N --mps-percent P0,...` (docs/cuda.md, "Partitions of
one GPU"): the launcher starts an MPS control daemon with private pipe and log
directories, every rank gets its share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
reported per rank as the records' sm_percent), and the daemon is stopped and
its directories removed however the job ends: success, a failing rank,
SIGTERM to the launcher, SIGKILL to its process group (the guardian). The daemon here is a stand-in script
(HSPMD_MPS_CONTROL) that records its calls, and the ranks run on the device
test double cpu:1: no GPU or MPS needed. Bad flags and a daemon that does not
start are one-line errors.

usage: mps_test.py --hspmd PATH
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

MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64, "eos_token_id": 0}
STRATEGY = {"pipelines": [
    {"micro_batch_size": 2, "micro_batches": 2, "stages": [{"ranks": [0], "layers": [0, 3]}]},
    {"micro_batch_size": 1, "micro_batches": 2, "stages": [{"ranks": [1], "layers": [0, 1]},
                                                           {"ranks": [2], "layers": [2, 3]}]}]}
FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_mps_control.sh")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    a = ap.parse_args()
    failures = []

    def check(label, ok, detail=""):
        print(f"{label:34s} {'ok' if ok else 'FAIL'} {detail}")
        if not ok:
            failures.append(label)

    with tempfile.TemporaryDirectory() as tmp:
        p = lambda n: os.path.join(tmp, n)  # noqa: E731
        json.dump(MODEL, open(p("model.json"), "w"))
        json.dump(STRATEGY, open(p("s.json"), "w"))
        rng = random.Random(3)
        with open(p("data.bin"), "wb") as f:
            f.write(b"".join(struct.pack("<I", rng.randrange(64)) for _ in range(4096)))
        env = dict(os.environ, HSPMD_MPS_CONTROL=FAKE, FAKE_MPS_LOG=p("calls"))
        base = [a.hspmd, "train", "--model", p("model.json"), "--data", p("data.bin"), "--seq-len", "16",
                "--threads", "1", "--quiet", "--strategy", p("s.json"), "--device", "cpu:1"]

        def calls():
            if not os.path.exists(p("calls")):
                return []
            lines = [l.split() for l in open(p("calls")) if l.strip()]
            os.remove(p("calls"))
            return lines

        def wait_for_steps(log, limit_s=60):
            """Until the job has logged a step (at most limit_s)."""
            deadline = time.time() + limit_s
            while time.time() < deadline and not (os.path.exists(log) and os.path.getsize(log)):
                time.sleep(0.2)

        def lifecycle_ok(c):
            """start then quit, on one private pipe directory, removed afterwards."""
            return (len(c) == 2 and c[0][0] == "start" and c[1][0] == "quit" and c[0][1] == c[1][1] and
                    c[0][1].startswith("/tmp/hspmd-mps-") and not os.path.exists(os.path.dirname(c[0][1])))

        # 1. A job that succeeds: each rank has its share.
        r = subprocess.run(base + ["--steps", "2", "--nproc", "3", "--mps-percent", "50,25,25", "--log", p("ok.jsonl")],
                           capture_output=True, text=True, env=env, timeout=120)
        c = calls()
        recs = [json.loads(l) for l in open(p("ok.jsonl"))] if os.path.exists(p("ok.jsonl")) else []
        check("success: daemon started, stopped", r.returncode == 0 and lifecycle_ok(c), f"{c} {r.stderr[-200:]}")
        check("success: ranks' shares", len(recs) == 2 and all(x.get("sm_percent") == [50, 25, 25] for x in recs),
              str([x.get("sm_percent") for x in recs]))
        # Without --mps-percent no record names a share.
        r = subprocess.run(base + ["--steps", "1", "--nproc", "3", "--log", p("plain.jsonl")],
                           capture_output=True, text=True, env=env, timeout=120)
        plain = [json.loads(l) for l in open(p("plain.jsonl"))] if r.returncode == 0 else [{"sm_percent": 1}]
        check("no shares without --mps-percent", all("sm_percent" not in x for x in plain) and calls() == [])
        # 2. A job whose ranks fail (the sequence exceeds the model's positions).
        r = subprocess.run([x if x != "16" else "100" for x in base] + ["--steps", "2", "--nproc", "3",
                                                                       "--mps-percent", "40,30,30"],
                           capture_output=True, text=True, env=env, timeout=120)
        c = calls()
        check("failing ranks: daemon stopped", r.returncode != 0 and lifecycle_ok(c), str(c))
        # 3. SIGTERM to the launcher mid-job.
        proc = subprocess.Popen(base + ["--steps", "1000000", "--nproc", "3", "--mps-percent", "20,40,40",
                                        "--log", p("long.jsonl")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=env)
        wait_for_steps(p("long.jsonl"))
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        c = calls()
        check("SIGTERM: daemon stopped", proc.returncode == 128 + signal.SIGTERM and lifecycle_ok(c),
              f"rc {proc.returncode} {c}")
        # 3b. The launcher killed outright (SIGKILL to its process group: no
        # destructor runs): the guardian, in a session of its own, stops the
        # daemon and removes its directory once the launcher is gone. A
        # bounded job, should a rank outlive its launcher.
        proc = subprocess.Popen(base + ["--steps", "300", "--nproc", "3", "--mps-percent", "30,30,40",
                                        "--log", p("killed.jsonl")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        wait_for_steps(p("killed.jsonl"))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 15
        seen = []
        while time.time() < deadline:
            seen = [l.split() for l in open(p("calls"))] if os.path.exists(p("calls")) else []
            if len(seen) >= 2 and not os.path.exists(os.path.dirname(seen[0][1])):
                break
            time.sleep(0.2)
        c = calls()
        check("SIGKILL: the guardian stopped it", lifecycle_ok(c), f"{c}")
        # 4. A daemon that does not start: one line, no ranks started.
        bad_env = dict(env, HSPMD_MPS_CONTROL="/bin/false")
        r = subprocess.run(base + ["--steps", "1", "--nproc", "3", "--mps-percent", "50,25,25", "--log",
                                   p("none.jsonl")], capture_output=True, text=True, env=bad_env, timeout=60)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        check("daemon that does not start", r.returncode != 0 and len(lines) == 1 and
              "[launch] --mps-percent: cannot start the MPS daemon '/bin/false -d' (exit code 1" in lines[0] and
              not os.path.exists(p("none.jsonl")), r.stderr.strip()[:200])
        # 5. Bad flags: one line each.
        for label, extra, want in [
                ("count", ["--nproc", "3", "--mps-percent", "50,50"], "gives 2 percentages for --nproc 3 ranks"),
                ("range", ["--nproc", "3", "--mps-percent", "50,0,50"], "'0' is not a percentage of the SMs"),
                ("without --nproc", ["--mps-percent", "50,25,25"], "--mps-percent needs --nproc"),
                ("on the host", ["--nproc", "3", "--mps-percent", "50,25,25", "--device", "cpu"],
                 "--mps-percent partitions a GPU")]:
            cmd = base + ["--steps", "1"] + extra
            if extra.count("--device"):  # this case's device replaces the test double
                i = cmd.index("--device")
                del cmd[i:i + 2]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
            lines = [l for l in r.stderr.splitlines() if l.strip()]
            check(f"bad flag: {label}", r.returncode != 0 and len(lines) == 1 and want in lines[0] and calls() == [],
                  r.stderr.strip()[:160])
    if failures:
        sys.exit(f"FAILED: {failures}")
    print("all MPS partition cases passed")


if __name__ == "__main__":
    main()
