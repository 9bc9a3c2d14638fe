"""hspmd plan experts (docs/moe.md, "Choosing a placement"): from a run's
step records (expert_tokens), a placement that replicates the hot expert and
brings the busiest member near an even share; with --cluster a slow member
takes less; the written strategy compiles; bad input gets one line.

usage: plan_experts_test.py --hspmd build/src/cli/hspmd"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

MODEL = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 64, "eos_token_id": 0, "num_local_experts": 4, "num_experts_per_tok": 1}
LOADS = [[700, 100, 100, 100], [250, 250, 250, 250]]  # layer 0 skewed, layer 1 even


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def member_loads(placement, loads, members=4):
    busy = [0.0] * members
    for e, holders in enumerate(placement):
        for m in holders:
            busy[m] += loads[e] / len(holders)
    return busy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    exe = ap.parse_args().hspmd
    d = tempfile.mkdtemp()
    p = lambda n: os.path.join(d, n)  # noqa: E731
    json.dump(MODEL, open(p("model.json"), "w"))
    strategy = {"expert_parallel": 4, "pipelines": [
        {"micro_batch_size": 1, "micro_batches": 2, "stages": [{"ranks": [r], "layers": [0, 1]}]} for r in range(4)]}
    json.dump(strategy, open(p("s.json"), "w"))
    with open(p("log.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "loss": 4.0, "expert_tokens": [[1, 1, 1, 1], [1, 1, 1, 1]]}) + "\n")
        f.write(json.dumps({"event": "switch", "step": 1}) + "\n")
        f.write(json.dumps({"step": 1, "loss": 3.9, "expert_tokens": LOADS}) + "\n")
    json.dump({"catalog": {"fast": {"tflops": 2, "memory_gib": 8}, "slow": {"tflops": 1, "memory_gib": 8}},
               "nodes": [{"type": "fast", "ranks": [0, 2]}, {"type": "slow", "ranks": [3, 3]}]}, open(p("c.json"), "w"))
    failures = []

    def check(label, ok, detail=""):
        print(f"{label:44s} {'ok' if ok else 'FAIL'} {detail}")
        if not ok:
            failures.append(label)

    base = [exe, "plan", "experts", "--model", p("model.json"), "--strategy", p("s.json"), "--log", p("log.jsonl")]
    r = run(base + ["-o", p("even.json")])
    check("plan experts runs", r.returncode == 0, r.stderr.strip()[-300:])
    if r.returncode == 0:
        placed = json.load(open(p("even.json")))["expert_placement"]
        first = next(x for x in placed if x["layers"][0] <= 0 <= x["layers"][1])
        busy = member_loads(first["experts"], LOADS[0])
        check("hot expert replicated", len(first["experts"][0]) >= 2, str(first["experts"]))
        check("busiest member near an even share", max(busy) <= 1.25 * sum(LOADS[0]) / 4, str(busy))
        check("reports the skew", "hottest expert 2.80x the mean" in r.stdout, r.stdout.strip())
        c = run([exe, "plan", "compile", "--model", p("model.json"), "--strategy", p("even.json"), "--world", "4",
                 "-o", p("plan.json")])
        check("the placed strategy compiles", c.returncode == 0, c.stderr.strip()[-300:])
    r = run(base + ["--cluster", p("c.json"), "-o", p("speed.json")])
    check("plan experts --cluster runs", r.returncode == 0, r.stderr.strip()[-300:])
    if r.returncode == 0:
        placed = json.load(open(p("speed.json")))["expert_placement"]
        first = next(x for x in placed if x["layers"][0] <= 0 <= x["layers"][1])
        busy = member_loads(first["experts"], LOADS[0])
        check("the slow member takes the least", busy[3] == min(busy), str(busy))
    for label, args, want in [
            ("no expert_tokens in the log", ["--log", p("model.json")], "no step record with expert_tokens"),
            ("a step the log does not have", ["--step", "7"], "no step record of step 7"),
            ("a strategy without expert parallelism", ["--strategy", p("dense.json")], "expert_parallel is 1")]:
        json.dump(dict(strategy, expert_parallel=1), open(p("dense.json"), "w"))
        args_full = list(base)
        for i in range(0, len(args), 2):
            if args[i] in args_full:
                args_full[args_full.index(args[i]) + 1] = args[i + 1]
            else:
                args_full += args[i:i + 2]
        r = run(args_full + ["-o", p("bad.json")])
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        check(label, r.returncode != 0 and len(lines) == 1 and want in r.stderr and not os.path.exists(p("bad.json")),
              r.stderr.strip()[-300:])
    if failures:
        sys.exit("FAILED: " + ", ".join(failures))


if __name__ == "__main__":
    main()
