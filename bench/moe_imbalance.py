"""Expert imbalance on 8 emulated ranks (docs/moe.md, "Replicated experts"):
a Mixtral-shaped model whose router sends each token class to its own
expert, trained on token ids drawn from a Zipf law, so that the class of the
most frequent ids (expert 0) takes several times its share.

Runs, each on the same emulated cluster (8 single-rank pipelines on one
node, expert_parallel 8: one group, one expert per member by default), with
`--clock model` (a profile this script makes with `hspmd profile`) and the
CPU wall time beside it:
  symmetric   the default placement on the skewed data;
  replicated  the placement `hspmd plan experts` chooses from the symmetric
              run's routing, on the same data;
  balanced    the default placement on data whose classes are equally
              frequent (perfectly balanced routing);
  drift       the replicated placement with --replace-experts on data whose
              hot class moves to the last expert at step --drift-step: the
              step times before, right after and well after the drift, and
              the step the run re-placed its experts at.
Reported: median step times (model clock, and wall) over the steps after
the first, their ratios, and the routing skew (hottest expert / mean).

usage: python3 bench/moe_imbalance.py --hspmd build/src/cli/hspmd [--steps N] [--drift-step K] [--json OUT]
"""
import argparse
import json
import math
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from safetensors_util import write_safetensors  # noqa: E402

VOCAB, EXPERTS, WORLD = 64, 8, 8
MODEL = {"model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 384,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 64, "eos_token_id": 0, "num_local_experts": EXPERTS,
         "num_experts_per_tok": 1, "initializer_range": 0.02, "tie_word_embeddings": False}


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r


def token_class(t):
    return t * EXPERTS // VOCAB


def write_tokens(path, n, weights, rng):
    ids = rng.choices(range(VOCAB), weights=weights, k=n)
    with open(path, "wb") as f:
        f.write(b"".join(struct.pack("<I", t) for t in ids))


def routed_init(hspmd, d, model):
    """The model's initial weights, with each token class's embedding along
    its own axis and every router sending that axis to the class's expert."""
    path = os.path.join(d, "init.safetensors")
    data = os.path.join(d, "init_data.bin")
    write_tokens(data, 4096, [1] * VOCAB, random.Random(1))
    run([hspmd, "train", "--model", model, "--data", data, "--steps", "1", "--lr", "1e-30", "--seq-len", "16",
         "--global-batch", "1", "--threads", "1", "--quiet", "--save", path])
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        blob = f.read()
    t = {name: numpy.frombuffer(blob[m["data_offsets"][0]:m["data_offsets"][1]], dtype=numpy.float32)
         .reshape(m["shape"]).copy() for name, m in header.items() if name != "__metadata__"}
    emb = t["model.embed_tokens.weight"]
    emb *= 0.1
    for tok in range(VOCAB):
        emb[tok, token_class(tok)] += 1.0
    for l in range(MODEL["num_hidden_layers"]):
        gate = t[f"model.layers.{l}.block_sparse_moe.gate.weight"]
        gate[:] = 0.0
        for e in range(EXPERTS):
            gate[e, e] = 4.0
    write_safetensors(path, t)
    return path


def records(log):
    with open(log) as f:
        return [json.loads(x) for x in f if x.strip()]


def skew(rec):
    worst = 0.0
    for layer in rec["expert_tokens"]:
        worst = max(worst, max(layer) * len(layer) / max(1, sum(layer)))
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--drift-step", type=int, default=4, help="the drift run's data changes its hot class here")
    ap.add_argument("--zipf", type=float, default=1.2, help="exponent of the Zipf law over token ids")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless (model clock) symmetric >= 1.3x replicated, replicated <= 1.25x balanced, "
                         "the drift re-placed within 3 steps moving the predicted bytes, and its step came back "
                         "within 1.15x the one before")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="hspmd_moe_imb_")
    model = os.path.join(d, "model.json")
    json.dump(MODEL, open(model, "w"))
    rng = random.Random(7)
    seq, mbs = 64, 8  # 512 tokens a rank per step: the tokens' work, not the experts' weights, dominates
    per_step = WORLD * mbs * seq
    zipf = [1.0 / (t + 1) ** a.zipf for t in range(VOCAB)]
    write_tokens(os.path.join(d, "skewed.bin"), per_step * (a.steps + 2) + 1, zipf, rng)
    write_tokens(os.path.join(d, "balanced.bin"), per_step * (a.steps + 2) + 1, [1] * VOCAB, rng)
    drift = os.path.join(d, "drift.bin")
    with open(drift, "wb") as f:  # the hot class moves to the last expert at --drift-step
        before = rng.choices(range(VOCAB), weights=zipf, k=per_step * a.drift_step)
        after = [VOCAB - 1 - t for t in rng.choices(range(VOCAB), weights=zipf,
                                                     k=per_step * (a.steps - a.drift_step + 2) + 1)]
        f.write(b"".join(struct.pack("<I", t) for t in before + after))
    init = routed_init(a.hspmd, d, model)
    cluster = os.path.join(d, "cluster.json")
    json.dump({"catalog": {"cpu": {"tflops": 1, "memory_gib": 64, "intra_node_gbps": 10, "inter_node_gbps": 10}},
               "nodes": [{"type": "cpu", "ranks": [0, WORLD - 1]}]}, open(cluster, "w"))
    profile = os.path.join(d, "profile.json")
    run([a.hspmd, "profile", "--model", model, "--seq-lens", "32,64", "--micro-batch-sizes", "1,2",
         "--repetitions", "3", "-o", profile])
    sym = {"expert_parallel": WORLD, "schedule": "gpipe",
           "pipelines": [{"micro_batch_size": mbs, "micro_batches": 1, "stages": [{"ranks": [r], "layers": [0, 1]}]}
                         for r in range(WORLD)]}
    sym_path = os.path.join(d, "symmetric.json")
    json.dump(sym, open(sym_path, "w"))
    base = [a.hspmd, "train", "--model", model, "--init", init, "--seq-len", str(seq), "--steps", str(a.steps),
            "--lr", "1e-4", "--threads", "1", "--quiet", "--nproc", str(WORLD), "--cluster", cluster,
            "--clock", "model", "--profile", profile]

    def train(name, strategy, data, extra=()):
        log = os.path.join(d, name + ".jsonl")
        run(base + ["--strategy", strategy, "--data", data, "--log", log, *extra], timeout=900)
        recs = records(log)
        steps = [r for r in recs if "loss" in r]
        return steps, [r for r in recs if r.get("event") in ("switch", "expert_placement")]

    def med(steps, key, lo=1, hi=None):
        return statistics.median(r[key] for r in steps[lo:hi])

    out = {}
    sym_steps, _ = train("symmetric", sym_path, os.path.join(d, "skewed.bin"))
    placed = os.path.join(d, "replicated.json")
    plan = run([a.hspmd, "plan", "experts", "--model", model, "--strategy", sym_path,
                "--log", os.path.join(d, "symmetric.jsonl"), "-o", placed])
    print(plan.stdout.strip())
    rep_steps, _ = train("replicated", placed, os.path.join(d, "skewed.bin"))
    bal_steps, _ = train("balanced", sym_path, os.path.join(d, "balanced.bin"))
    for name, steps in (("symmetric", sym_steps), ("replicated", rep_steps), ("balanced", bal_steps)):
        out[name] = {"model_clock_s": med(steps, "emulated_step_time_s"), "wall_s": med(steps, "step_time_s"),
                     "skew": statistics.median(skew(r) for r in steps)}
        print(f"{name:11s} step {out[name]['model_clock_s'] * 1e3:8.2f} ms model clock, "
              f"{out[name]['wall_s'] * 1e3:8.2f} ms wall; hottest expert {out[name]['skew']:.2f}x the mean")
    for clock in ("model_clock_s", "wall_s"):
        out[f"symmetric_over_replicated_{clock}"] = out["symmetric"][clock] / out["replicated"][clock]
        out[f"replicated_over_balanced_{clock}"] = out["replicated"][clock] / out["balanced"][clock]
    print(f"symmetric / replicated: {out['symmetric_over_replicated_model_clock_s']:.2f}x model clock, "
          f"{out['symmetric_over_replicated_wall_s']:.2f}x wall")
    print(f"replicated / balanced:  {out['replicated_over_balanced_model_clock_s']:.2f}x model clock, "
          f"{out['replicated_over_balanced_wall_s']:.2f}x wall")

    drift_steps, events = train("drift", placed, drift, ["--replace-experts"])
    switched = [e["step"] for e in events if e.get("event") == "switch"]
    moved_ok = all(e["bytes_sent"] == e["predicted_bytes"] for e in events if e.get("event") == "switch")
    k = a.drift_step
    out["drift"] = {
        "switch_steps": switched,
        "switch_bytes_as_predicted": moved_ok,
        "before_s": med(drift_steps, "emulated_step_time_s", 1, k),
        "after_drift_s": drift_steps[k]["emulated_step_time_s"],
        "recovered_s": med(drift_steps, "emulated_step_time_s", min(len(drift_steps) - 1, k + 3)),
    }
    print(f"drift at step {k}: re-placed before step(s) {switched}; step {out['drift']['before_s'] * 1e3:.2f} ms "
          f"before, {out['drift']['after_drift_s'] * 1e3:.2f} ms at the drift, "
          f"{out['drift']['recovered_s'] * 1e3:.2f} ms from step {k + 3} (model clock)")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    if a.check:
        dr = out["drift"]
        problems = [msg for ok, msg in (
            (out["symmetric_over_replicated_model_clock_s"] >= 1.3, "symmetric under 1.3x the replicated step"),
            (out["replicated_over_balanced_model_clock_s"] <= 1.25, "replicated over 1.25x the balanced step"),
            (out["symmetric"]["skew"] >= 3, "the hottest expert under 3x the mean: not skewed enough"),
            (any(k < s_ <= k + 3 for s_ in dr["switch_steps"]), "no re-placement within 3 steps of the drift"),
            (dr["switch_bytes_as_predicted"], "a re-placement moved other bytes than predicted"),
            (dr["recovered_s"] <= 1.15 * dr["before_s"], "the step did not come back after the drift"))
            if not ok]
        if problems:
            sys.exit("FAILED: " + "; ".join(problems))
        print("checks ok")
    if not a.keep:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
