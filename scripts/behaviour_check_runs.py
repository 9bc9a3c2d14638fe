#!/usr/bin/env python3
"""The runs of the behaviour-unchanged check (scripts/behaviour_check.sh):
a fixed set of CPU training runs made with two hspmd binaries, one built
from the commit before a refactor and one from the tree after it, and
compared bit for bit.

Each run is made with each binary into its own folder (OUT/base/NAME,
OUT/new/NAME) from the same inputs (OUT/inputs: a small Llama config,
random and heavy-tailed token files, strategies, events, a cluster), with
one thread per rank. Compared per run:
  losses   every step's "loss" in the --log JSONL, as the text the binary
           printed (string-equal, so a last-digit change shows), and the
           number of steps;
  events   the (event, step) pairs of the log's switch / reconfigure /
           slowdown records (their timing fields are not compared);
  weights  the --save safetensors file, byte for byte.
Nothing else in the log is compared: its times (step_time_s, unix_time,
grad_sync_s, planning_s, ...) differ from run to run of one binary.

Then the timing: one 1-rank run of the tiny example Llama, alternating base
and new REPEATS times each; the median over runs of each run's median step
time (step_time_s, the first step left out as warm-up), and new / base.

usage: behaviour_check_runs.py --base BIN --new BIN --out DIR [--runs A,B,...] [--repeats 5] [--list]
Exit 0 when every run is identical, 1 on any difference or failed run.
"""
import argparse
import json
import os
import random
import re
import statistics
import struct
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The equivalence tests' model (tests/exec/equivalence_test.py): 4 layers,
# 8 heads over 4 KV heads, so TP 1/2/4 and CP 2 all divide it.
MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64,
         "eos_token_id": 0}
STEPS = 5


def pipeline(mbs, micro, stages, recompute=False):
    return {"micro_batch_size": mbs, "micro_batches": micro,
            "stages": [{"ranks": r, "layers": l, **({"cp": c} if c > 1 else {}),
                        **({"recompute": True} if recompute else {})} for r, l, c in stages]}


def token_pipe(stages, max_seq_len=None, tokens=None):
    p = {"stages": [{"ranks": r, "layers": l, **({"cp": c} if c > 1 else {})} for r, l, c in stages]}
    if max_seq_len:
        p["max_seq_len"] = max_seq_len
    if tokens:
        p["micro_batch_tokens"] = tokens
    return p


# Strategies of 4 ranks, global batch 8 (tests/exec/equivalence_test.py's cases).
STRATEGIES = {
    # TP2 then TP1 stages beside a one-rank pipeline: heterogeneous pipelines.
    "hetero_pp_tp": {"pipelines": [pipeline(2, 2, [([0, 1], [0, 1], 1), ([2], [2, 3], 1)]),
                                   pipeline(2, 2, [([3], [0, 3], 1)])]},
    # Two pipelines of different micro-batch sizes and layer cuts, ZeRO-1, 1F1B.
    "asym_pp_dp_zero": {"zero": True, "schedule": "1f1b", "pipelines": [
        pipeline(3, 2, [([0], [0, 1], 1), ([1], [2, 3], 1)]),
        pipeline(1, 2, [([2], [0, 2], 1), ([3], [3, 3], 1)])]},
    "tp4": {"pipelines": [pipeline(2, 4, [([0, 1, 2, 3], [0, 3], 1)])]},
    "dp2_tp2": {"pipelines": [pipeline(2, 2, [([0, 1], [0, 3], 1)]), pipeline(2, 2, [([2, 3], [0, 3], 1)])]},
    "dp2_tp2_zero": {"zero": True, "pipelines": [pipeline(2, 2, [([0, 1], [0, 3], 1)]),
                                                 pipeline(2, 2, [([2, 3], [0, 3], 1)])]},
    "cp2_tp2": {"pipelines": [pipeline(2, 4, [([0, 1, 2, 3], [0, 3], 2)])]},
    "pp2_recompute": {"schedule": "gpipe", "pipelines": [
        pipeline(1, 4, [([0], [0, 1], 1), ([1], [2, 3], 1)], recompute=True),
        pipeline(1, 4, [([2], [0, 2], 1), ([3], [3, 3], 1)], recompute=True)]},
    # Token-budget strategies (tests/exec/mixed_length_test.py): short pieces
    # on four one-rank pipelines; the longest on a CP2 pair beside two
    # one-rank pipelines of short ones.
    "short4": {"max_seq_len": 16, "pipelines": [token_pipe([([r], [0, 3], 1)]) for r in range(4)]},
    "cp_long_short": {"pipelines": [token_pipe([([0, 1], [0, 3], 2)], max_seq_len=32),
                                    token_pipe([([2], [0, 3], 1)], max_seq_len=12, tokens=24),
                                    token_pipe([([3], [0, 3], 1)], max_seq_len=12, tokens=24)]},
}

# Two speeds: ranks 2-3 take twice as long (tests/exec/elastic_test.py's cluster, 4 ranks).
CLUSTER = {"catalog": {t: {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100, "inter_node_gbps": 25}
                       for t in ("fast", "slow")},
           "nodes": [{"type": "fast", "ranks": [0, 1]}, {"type": "slow", "ranks": [2, 3], "slowdown": 2.0}]}
EVENTS = {
    # A failure, a join and a slowdown: the run re-plans and switches online.
    "fail_join_slow": [{"step": 2, "fail": [3]}, {"step": 3, "join": [3]}, {"step": 4, "slowdown": {"1": 3.0}}],
    "fail_join": [{"step": 2, "fail": [1]}, {"step": 4, "join": [1]}],
}

FIXED = ["--data", "{in}/data.bin", "--seq-len", "16", "--global-batch", "8"]
TOKENS = ["--data", "{in}/docs.bin", "--batch-tokens", "96", "--max-seq-len", "32"]
# Straggler re-planning reads CPU-clock step times: kept out, it would make a
# run depend on the machine's load.
ELASTIC = ["--straggler-window", "0", "--checkpoint", "{run}/ckpt", "--save-every", "2"]

# name -> (ranks, flags after the common ones). {in}: the inputs folder, {run}: the run's folder.
RUNS = {
    "single": (1, FIXED + ["--micro-batches", "4"]),
    "single_packed": (1, ["--data", "{in}/docs.bin", "--seq-len", "16", "--global-batch", "8",
                          "--micro-batches", "2", "--pack-documents"]),
    "equiv_hetero_pp_tp": (4, FIXED + ["--strategy", "{in}/hetero_pp_tp.json"]),
    "equiv_asym_pp_dp_zero_overlap": (4, FIXED + ["--strategy", "{in}/asym_pp_dp_zero.json", "--overlap"]),
    "equiv_packed_cp2_tp2": (4, ["--data", "{in}/docs.bin", "--seq-len", "16", "--global-batch", "8",
                                 "--pack-documents", "--strategy", "{in}/cp2_tp2.json"]),
    "equiv_pp_recompute_gpipe": (4, FIXED + ["--strategy", "{in}/pp2_recompute.json"]),
    "switch_tp4_to_dp2_tp2_zero": (4, FIXED + ["--strategy", "{in}/tp4.json",
                                               "--switch", "2:{in}/dp2_tp2_zero.json", "--switch", "4:{in}/tp4.json"]),
    "elastic_fail_join_slowdown": (4, FIXED + ["--strategy", "{in}/dp2_tp2.json", "--cluster", "{in}/cluster.json",
                                               "--events", "{in}/fail_join_slow.events.json"] + ELASTIC),
    "tokens_strategies": (4, TOKENS + ["--strategies", "{in}/short4.json,{in}/cp_long_short.json"]),
    "tokens_elastic_strategies": (4, TOKENS + ["--strategies", "{in}/short4.json,{in}/cp_long_short.json",
                                               "--cluster", "{in}/cluster.json",
                                               "--events", "{in}/fail_join.events.json"] + ELASTIC),
    "bf16_single": (1, FIXED + ["--micro-batches", "4", "--precision", "bf16", "--save-dtype", "bf16"]),
    "bf16_dp2_tp2_zero_bf16_grads": (4, FIXED + ["--strategy", "{in}/dp2_tp2_zero.json", "--precision", "bf16",
                                                 "--grad-reduce-dtype", "bf16"]),
}

TIMING = ["--model", "{repo}/examples/tiny-llama/config.json", "--data", "{in}/tiny_data.bin", "--seq-len", "128",
          "--global-batch", "8", "--steps", "8", "--lr", "3e-3", "--seed", "0", "--threads", "1", "--quiet"]


def write_inputs(d):
    os.makedirs(d, exist_ok=True)
    json.dump(MODEL, open(os.path.join(d, "model.json"), "w"))
    rng = random.Random(7)
    with open(os.path.join(d, "data.bin"), "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(64)) for _ in range(8192)))
    # Heavy-tailed documents ending in eos 0 (tests/exec/mixed_length_test.py's make_docs).
    rng, toks = random.Random(11), []
    while len(toks) < 12000:
        k = min(200, int(rng.paretovariate(1.1) * 3))
        toks += [rng.randrange(1, 64) for _ in range(k)] + [0]
    with open(os.path.join(d, "docs.bin"), "wb") as f:
        f.write(b"".join(struct.pack("<I", t) for t in toks))
    rng = random.Random(3)
    with open(os.path.join(d, "tiny_data.bin"), "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(320)) for _ in range(65536)))
    for name, s in STRATEGIES.items():
        json.dump(s, open(os.path.join(d, name + ".json"), "w"))
    for name, e in EVENTS.items():
        json.dump(e, open(os.path.join(d, name + ".events.json"), "w"))
    json.dump(CLUSTER, open(os.path.join(d, "cluster.json"), "w"))


def command(hspmd, name, inputs, run_dir):
    ranks, flags = RUNS[name]
    cmd = [hspmd, "train", "--model", "{in}/model.json", "--steps", str(STEPS), "--lr", "3e-3", "--eps", "1e-5",
           "--weight-decay", "0.1", "--clip-grad", "0.5", "--seed", "0", "--threads", "1", "--quiet"] + flags
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    cmd += ["--log", "{run}/train.jsonl", "--save", "{run}/weights.safetensors"]
    return [a.replace("{in}", inputs).replace("{run}", run_dir).replace("{repo}", REPO) for a in cmd]


def run_one(hspmd, name, inputs, run_dir):
    """Runs NAME with hspmd into run_dir (emptied first); returns an error line or None."""
    if os.path.isdir(run_dir):
        subprocess.run(["rm", "-rf", run_dir], check=True)
    os.makedirs(run_dir)
    cmd = command(hspmd, name, inputs, run_dir)
    with open(os.path.join(run_dir, "command.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    with open(os.path.join(run_dir, "stderr.txt"), "w") as err:
        r = subprocess.run(cmd, stdout=err, stderr=subprocess.STDOUT, timeout=600)
    if r.returncode:
        tail = open(os.path.join(run_dir, "stderr.txt"), errors="replace").read().strip().splitlines()[-1:]
        return f"exit {r.returncode}: {tail[0] if tail else ''}"
    return None


LOSS_RE = re.compile(r'"loss"\s*:\s*([^,}\s]+)')


def read_log(path):
    """(losses as printed, [(event, step)]) of a --log file."""
    losses, events = [], []
    for line in open(path):
        rec = json.loads(line)
        if "loss" in rec and "event" not in rec:
            losses.append((rec.get("step"), LOSS_RE.search(line).group(1)))
        elif "event" in rec:
            events.append((rec["event"], rec.get("step")))
    return losses, events


def tensor_at(path, offset):
    """Names what byte offset of a safetensors file holds (cmp's first difference)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    if offset < 8 + n:
        return f"first at byte {offset} (the header)"
    at = offset - 8 - n
    for tensor, info in header.items():
        if tensor != "__metadata__" and info["data_offsets"][0] <= at < info["data_offsets"][1]:
            return f"first in {tensor} at byte {at - info['data_offsets'][0]} of its data"
    return f"first at byte {offset} (past the tensors)"


def compare(name, base_dir, new_dir):
    """(ok, one line) comparing a run made by both binaries."""
    bl, nl = os.path.join(base_dir, "train.jsonl"), os.path.join(new_dir, "train.jsonl")
    (b_loss, b_ev), (n_loss, n_ev) = read_log(bl), read_log(nl)
    if len(b_loss) != len(n_loss):
        return False, f"run {name}: base logged {len(b_loss)} steps, new {len(n_loss)}"
    for (bs, bv), (ns, nv) in zip(b_loss, n_loss):
        if (bs, bv) != (ns, nv):
            return False, f"run {name}: losses differ first at step {bs}: base {bv}, new {nv} (step {ns})"
    if b_ev != n_ev:
        return False, f"run {name}: events differ: base {b_ev}, new {n_ev}"
    bw, nw = os.path.join(base_dir, "weights.safetensors"), os.path.join(new_dir, "weights.safetensors")
    r = subprocess.run(["cmp", bw, nw], capture_output=True, text=True)
    if r.returncode:
        m = re.search(r"differ: (?:char|byte) (\d+)", r.stdout)
        where = tensor_at(nw, int(m.group(1)) - 1) if m else (r.stdout.strip() or r.stderr.strip())
        return False, f"run {name}: losses {len(b_loss)} steps identical, weights differ: {where}"
    ev = f", {len(b_ev)} event{'s' if len(b_ev) > 1 else ''} identical" if b_ev else ""
    return True, f"run {name}: losses {len(b_loss)} steps identical{ev}, weights identical"


def step_times(path):
    times = [json.loads(line).get("step_time_s") for line in open(path)]
    times = [t for t in times if t is not None]
    return times[1:]  # the first step warms caches and the allocator


def timing(base, new, inputs, out, repeats):
    cmd = [a.replace("{in}", inputs).replace("{repo}", REPO) for a in TIMING]
    meds = {"base": [], "new": []}
    for k in range(repeats):
        for label, hspmd in (("base", base), ("new", new)):
            log = os.path.join(out, f"timing_{label}_{k}.jsonl")
            r = subprocess.run([hspmd, "train"] + cmd + ["--log", log], capture_output=True, text=True, timeout=600)
            if r.returncode:
                print(f"timing: {label} run {k} failed: exit {r.returncode}: {r.stderr.strip()[-300:]}")
                return False
            meds[label].append(statistics.median(step_times(log)))
    b, n = statistics.median(meds["base"]), statistics.median(meds["new"])
    print(f"timing: tiny Llama, 1 rank, 1 thread, seq 128 x 8, {repeats} runs each, alternating: "
          f"median step base {b * 1e3:.2f} ms, new {n * 1e3:.2f} ms, new/base {n / b:.3f} "
          f"(per-run medians base {[round(x * 1e3, 2) for x in meds['base']]} ms, "
          f"new {[round(x * 1e3, 2) for x in meds['new']]} ms)")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="hspmd built from the commit before the change")
    ap.add_argument("--new", help="hspmd built from the tree after it")
    ap.add_argument("--out", default="/tmp/behaviour-check", help="where inputs and runs are written")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated names (--list shows them)")
    ap.add_argument("--repeats", type=int, default=5, help="timing runs of each binary (0: no timing)")
    ap.add_argument("--list", action="store_true", help="print each run's command and exit")
    a = ap.parse_args()
    names = [n for n in a.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"behaviour_check: unknown run {unknown[0]} (known: {', '.join(RUNS)})")
    inputs = os.path.join(a.out, "inputs")
    if a.list:
        for n in names:
            print(f"{n}: {' '.join(command('hspmd', n, inputs, os.path.join(a.out, 'new', n)))}")
        return 0
    if not a.base or not a.new:
        sys.exit("behaviour_check: --base and --new are required")
    write_inputs(inputs)
    env_ok = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    os.environ.update(env_ok)
    same, differ = [], []
    t0 = time.time()
    for n in names:
        errs = {}
        for label, hspmd in (("base", a.base), ("new", a.new)):
            errs[label] = run_one(hspmd, n, inputs, os.path.join(a.out, label, n))
        if errs["base"] or errs["new"]:
            line = "; ".join(f"{k} {v}" for k, v in errs.items() if v)
            ok, msg = False, f"run {n}: failed: {line} (see {a.out}/<base|new>/{n}/stderr.txt)"
        else:
            ok, msg = compare(n, os.path.join(a.out, "base", n), os.path.join(a.out, "new", n))
        print(msg, flush=True)
        (same if ok else differ).append(n)
    print(f"summary: {len(same)} of {len(names)} runs identical"
          + (f"; different or failed: {', '.join(differ)}" if differ else "")
          + f" ({time.time() - t0:.0f} s)", flush=True)
    timed = a.repeats <= 0 or timing(a.base, a.new, inputs, a.out, a.repeats)
    return 1 if differ or not timed else 0


if __name__ == "__main__":
    sys.exit(main())
