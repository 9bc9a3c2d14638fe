#!/usr/bin/env python3
"""`hspmd profile` says when the machine was busy (docs/profiling.md,
"A busy machine"): pinned to one core beside a CPU-bound process it gets
about half the core, warns in one line and records "under_load" in the
profile; `plan cost` with that profile says so in its notes. Pinned to the
other core, alone, it records a quiet measurement. Needs taskset and two
cores (exit 77 otherwise)."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    a = ap.parse_args()
    if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        print("needs taskset and two cores")
        return 77
    model = os.path.join(a.repo, "examples", "tiny-llama", "config.json")
    failures = []

    def check(label, ok, detail):
        print(f"{label:40s} {'ok' if ok else 'FAIL'}: {detail}")
        if not ok:
            failures.append(label)

    with tempfile.TemporaryDirectory() as tmp:
        def profile(core, out):
            return subprocess.run(["taskset", "-c", str(core), a.hspmd, "profile", "--model", model, "--tp", "1",
                                   "--seq-lens", "16,32", "--micro-batch-sizes", "1", "--repetitions", "3", "-o", out],
                                  capture_output=True, text=True, timeout=300)

        quiet = os.path.join(tmp, "quiet.json")
        r = profile(1, quiet)
        m = json.load(open(quiet))["measurement"] if r.returncode == 0 else {}
        # Alone on its core it gets the core; the flag follows the documented
        # rule either way (a suite run under an outside load may load core 1
        # too), and the warning comes exactly with the flag.
        expected = m.get("cpu_share", 0) < 0.75
        check("alone: recorded, flagged by the rule", r.returncode == 0 and m.get("cores", 0) >= 2 and
              m.get("under_load") == expected and ("busy" in r.stderr) == expected, json.dumps(m))
        alone_share = m.get("cpu_share", 0)

        loaded = os.path.join(tmp, "loaded.json")
        hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
        try:
            r = profile(0, loaded)
        finally:
            hog.kill()
            hog.wait()
        m = json.load(open(loaded))["measurement"] if r.returncode == 0 else {}
        warnings = [l for l in r.stderr.splitlines() if "warning: the machine was busy" in l]
        check("loaded: warns and records under_load", r.returncode == 0 and m.get("under_load") is True and
              m.get("cpu_share", 1) < 0.75 and len(warnings) == 1, json.dumps(m) + " " + repr(warnings[:1]))
        check("sharing a core halves the share", m.get("cpu_share", 1) < 0.7 * alone_share,
              f"{m.get('cpu_share', 0):.2f} beside a busy process vs {alone_share:.2f} alone")

        strategy = os.path.join(tmp, "s.json")
        json.dump({"pipelines": [{"micro_batch_size": 1, "micro_batches": 1,
                                  "stages": [{"ranks": [0], "layers": [0, 3]}]}]}, open(strategy, "w"))
        cluster = os.path.join(tmp, "c.json")
        json.dump({"catalog": {"cpu": {"tflops": 1, "memory_gib": 16, "intra_node_gbps": 10, "inter_node_gbps": 1}},
                   "nodes": [{"type": "cpu", "ranks": [0, 0], "slowdown": 1.0}]}, open(cluster, "w"))
        r = subprocess.run([a.hspmd, "plan", "cost", "--model", model, "--strategy", strategy, "--seq-len", "32",
                            "--cluster", cluster, "--profile", loaded, "--json"], capture_output=True, text=True,
                           timeout=60)
        notes = json.loads(r.stdout).get("notes", []) if r.returncode == 0 else []
        check("plan cost notes a busy profile", any("measured on a busy machine" in n for n in notes),
              repr(notes)[:200] if r.returncode == 0 else r.stderr[-200:])
    if failures:
        sys.exit(f"{len(failures)} failure(s): {failures}")
    print("profile load checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
