#!/usr/bin/env python3
"""Heterogeneous devices on one GPU: CUDA MPS partitions of unequal size
(`--mps-percent`, docs/cuda.md "Partitions of one GPU"), the paper's scenario
of devices of different speeds on real hardware.

1. `hspmd profile --mps-percent P` for each distinct share: the partitions'
   own part times.
2. A cluster of one device type per share, each with its profile, and
   `hspmd plan search` on it: the planner's asymmetric strategy, and
   `hspmd plan cost`'s prediction of its step.
3. The searched strategy and the symmetric ones (data parallelism with equal
   batches; a pipeline with equal layers) trained on the partitions
   (`hspmd train --nproc N --mps-percent ...`): median steps.

Reports the searched plan's step against the best symmetric one, against the
ideal ratio (every partition busy all the time: the symmetric step bound by
the slowest partition over the work spread by speed, from the profiles'
per-sample times), the prediction's error, and whether an MPS daemon is left
running afterwards.

  python3 bench/mps_hetero.py [--hspmd build/src/cli/hspmd] [--device cuda:0] [--shares 50,25,25]
  HSPMD_MPS_CONTROL=stand-in python3 bench/mps_hetero.py --device cpu:1 --smoke   # the harness, no GPU

RESULT lines as the GPU probes'; --json writes the numbers. Exits 77 when
--device is a GPU and none (or no MPS) is there.
"""
import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Big enough that a partition's SM share shows in its step (GEMMs of 2048 x
# 1024 x 2816 per micro-batch of 2 at sequence 1024), small enough for minutes.
GPU_MODEL = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
             "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 0}
SMOKE_MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64, "eos_token_id": 0}


def run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        err = r.stderr.strip()
        if "no CUDA device" in err or "no CUDA backend" in err or "cannot start the MPS daemon" in err:
            print(f"SKIP mps_hetero: {err}")
            sys.exit(77)
        print(f"RESULT probe=mps_hetero case={what} error=\"{err[-300:]}\" status=FAIL")
        sys.exit(1)
    return r.stdout


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--shares", default="50,25,25", help="one MPS share per rank")
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and sequence: checks the harness only")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shares = [int(x) for x in a.shares.split(",")]
    n = len(shares)
    model_spec, seq, batch = (SMOKE_MODEL, 16, 12) if a.smoke else (GPU_MODEL, a.seq_len, a.global_batch)
    tmp = tempfile.mkdtemp(prefix="hspmd_mps_")
    p = lambda name: os.path.join(tmp, name)  # noqa: E731
    json.dump(model_spec, open(p("model.json"), "w"))
    rng = random.Random(0)
    with open(p("data.bin"), "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(model_spec["vocab_size"]))
                         for _ in range(max(200000, 4 * batch * seq))))
    precision = "fp32" if a.smoke else "bf16"

    # 1. A profile per distinct share.
    for share in sorted(set(shares)):
        run([a.hspmd, "profile", "--model", p("model.json"), "--device", a.device, "--mps-percent", str(share),
             "--seq-lens", str(seq), "--micro-batch-sizes", "1,2", "--precision", precision, "--repetitions", "3",
             "-o", p(f"profile_{share}.json")], f"profile_{share}")

    # 2. The cluster (one node: the ranks share the machine's links) and the plan.
    catalog = {f"p{s}": {"tflops": 989.4 * s / 100, "memory_gib": 40, "intra_node_gbps": 20,
                         "inter_node_gbps": 20, "profile": f"profile_{s}.json"} for s in set(shares)}
    nodes = [{"type": f"p{s}", "ranks": [r, r]} for r, s in enumerate(shares)]
    json.dump({"catalog": catalog, "nodes": nodes}, open(p("cluster.json"), "w"))
    run([a.hspmd, "plan", "search", "--model", p("model.json"), "--cluster", p("cluster.json"), "--global-batch",
         str(batch), "--seq-len", str(seq), "--tp", "1", "--max-cp", "1", "--micro-batch-sizes", "1,2",
         "-o", p("searched.json")], "plan_search")
    cost = json.loads(run([a.hspmd, "plan", "cost", "--model", p("model.json"), "--cluster", p("cluster.json"),
                           "--strategy", p("searched.json"), "--seq-len", str(seq), "--json"], "plan_cost"))
    predicted = cost["predicted_step_s"]

    # The symmetric plans: equal batches on every partition; one pipeline of
    # equal layer ranges.
    layers = model_spec["num_hidden_layers"]
    per = batch // n
    mbs = 2 if per % 2 == 0 else 1
    dp = {"pipelines": [{"micro_batch_size": mbs, "micro_batches": per // mbs,
                         "stages": [{"ranks": [r], "layers": [0, layers - 1]}]} for r in range(n)]}
    cuts = [round(layers * k / n) for k in range(n + 1)]
    pp = {"pipelines": [{"micro_batch_size": mbs, "micro_batches": batch // mbs,
                         "stages": [{"ranks": [r], "layers": [cuts[r], cuts[r + 1] - 1]} for r in range(n)]}]}
    json.dump(dp, open(p("dp.json"), "w"))
    json.dump(pp, open(p("pp.json"), "w"))

    # 3. Train each on the partitions.
    def step_of(strategy_file, name):
        log = p(name + ".jsonl")
        run([a.hspmd, "train", "--model", p("model.json"), "--data", p("data.bin"), "--seq-len", str(seq),
             "--steps", str(a.steps), "--strategy", strategy_file, "--nproc", str(n), "--device", a.device,
             "--mps-percent", a.shares, "--precision", precision, "--threads", "1", "--quiet", "--log", log], name)
        recs = records(log)
        assert all(r.get("sm_percent") == shares for r in recs), f"{name}: shares {recs[0].get('sm_percent')}"
        return statistics.median(r["step_time_s"] for r in recs[1:])

    searched = step_of(p("searched.json"), "searched")
    symmetric = {"dp_equal": step_of(p("dp.json"), "dp_equal"), "pp_equal_layers": step_of(p("pp.json"), "pp_equal")}
    best_name = min(symmetric, key=symmetric.get)
    best = symmetric[best_name]

    # The ideal (work over total speed): each partition's time for the whole
    # batch alone (plan cost of one rank of its type, from its profile);
    # equal shares take max(T) / n, work spread by speed 1 / sum(1 / T).
    def alone(share):
        json.dump({"catalog": {"p": {**catalog[f"p{share}"]}}, "nodes": [{"type": "p", "ranks": [0, 0]}]},
                  open(p(f"alone_{share}.json"), "w"))
        json.dump({"pipelines": [{"micro_batch_size": mbs, "micro_batches": batch // mbs,
                                  "stages": [{"ranks": [0], "layers": [0, layers - 1]}]}]}, open(p("alone.json"), "w"))
        out = run([a.hspmd, "plan", "cost", "--model", p("model.json"), "--cluster", p(f"alone_{share}.json"),
                   "--strategy", p("alone.json"), "--seq-len", str(seq), "--json"], f"alone_{share}")
        return json.loads(out)["predicted_step_s"]
    t = [alone(s) for s in shares]
    ideal = max(t) / n * sum(1 / x for x in t)
    ratio = best / searched
    share_of_ideal = (ratio - 1) / (ideal - 1) if ideal > 1 else float("nan")
    error = (predicted - searched) / searched
    left = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps"], capture_output=True, text=True).stdout.split()
    print(f"shares {shares}, {precision}, seq {seq}, global batch {batch}, medians of {a.steps - 1} steps")
    print(f"{'plan':18s} {'step':>10s}")
    print(f"{'searched':18s} {searched:9.4f}s  (predicted {predicted:.4f}s, {error:+.1%})")
    for k, v in symmetric.items():
        print(f"{k:18s} {v:9.4f}s")
    print(f"searched vs best symmetric ({best_name}): {ratio:.3f}x; ideal {ideal:.3f}x; "
          f"share of the ideal gain {share_of_ideal:.0%}; MPS processes left: {len(left)}")
    print(f"RESULT probe=mps_hetero case=searched median_ms={searched * 1e3:.1f} predicted_ms={predicted * 1e3:.1f} "
          f"best_symmetric_ms={best * 1e3:.1f} ratio={ratio:.3f} ideal={ideal:.3f} "
          f"status={'PASS' if not left else 'FAIL'}")
    if a.json:
        json.dump({"shares": shares, "searched_s": searched, "predicted_s": predicted, "symmetric_s": symmetric,
                   "ideal_ratio": ideal, "ratio": ratio, "mps_left": len(left)}, open(a.json, "w"), indent=1)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
