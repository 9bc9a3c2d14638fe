#!/usr/bin/env python3
"""`hspmd plan search --time-limit T` on clusters larger than the limit allows
(docs/reliability.md, "More rules"): the search answers with a strategy (the
symmetric fallback at least) and ends within the limit, +10% and the fixed
startup cost measured on a tiny cluster in the same run (plus 1 s of slack
for a loaded 2-core machine).

usage: search_limit_test.py --hspmd PATH --repo PATH
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def cluster(path, nodes):
    json.dump({"catalog": {"gpu": {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100,
                                   "inter_node_gbps": 25}},
               "nodes": [{"type": "gpu", "ranks": [8 * i, 8 * i + 7]} for i in range(nodes)]}, open(path, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    a = ap.parse_args()
    model = os.path.join(a.repo, "examples", "tiny-llama", "config.json")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        def search(nodes, limit):
            path = os.path.join(tmp, f"c{nodes}.json")
            cluster(path, nodes)
            t0 = time.monotonic()
            r = subprocess.run([a.hspmd, "plan", "search", "--model", model, "--cluster", path, "--global-batch", "8",
                                "--seq-len", "64", "--time-limit", str(limit), "-o", os.path.join(tmp, "best.json")],
                               capture_output=True, text=True, timeout=600)
            return r, time.monotonic() - t0

        r, startup = search(1, 30)  # 8 devices: the search ends long before its limit
        if r.returncode:
            sys.exit("FAIL: the 8-device search failed: " + r.stderr.strip()[-400:])
        print(f"8 devices: {startup:.2f} s")
        for nodes, limit in ((125, 2), (1250, 4)):
            r, took = search(nodes, limit)
            allowed = 1.1 * limit + startup + 1.0
            best = json.load(open(os.path.join(tmp, "best.json"))) if r.returncode == 0 else {}
            ok = r.returncode == 0 and best.get("pipelines") and took <= allowed
            print(f"{nodes * 8} devices, --time-limit {limit}: exit {r.returncode}, {took:.2f} s (allowed "
                  f"{allowed:.2f}), {len(best.get('pipelines', []))} pipelines {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(f"{nodes * 8} devices: {r.stderr.strip()[-300:]}")
            os.remove(os.path.join(tmp, "best.json")) if os.path.exists(os.path.join(tmp, "best.json")) else None
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
