"""Plan switching and training checkpoints train the same model as one
process: `hspmd train --strategy A --switch K:B ...` under mpirun gives the
single-process losses (1e-5 relative per step) and final weights (1e-4
normalized max error); every switch record's measured bytes equal the switch
plan's prediction on every rank. Also: a switch whose lost rank's slices come
from the checkpoint, --resume under another plan and world, and a rank
killed while writing a checkpoint (the previous one stays loadable)."""
import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from equivalence_test import (CASES, MODEL, losses, random_strategy, read_safetensors,  # noqa: E402
                              records, run, CLUSTER_CATALOG)


def pipeline(mbs, micro, stages):
    return {"micro_batch_size": mbs, "micro_batches": micro,
            "stages": [{"ranks": r, "layers": l, **({"cp": c} if c > 1 else {})} for r, l, c in stages]}


S = {name: strategy for name, (_, strategy) in CASES.items()}
# Only some ranks of a 4-rank world: two ranks idle, then the others.
S["front_tp2"] = {"pipelines": [pipeline(2, 4, [([0, 1], [0, 3], 1)])]}
S["back_pp"] = {"pipelines": [pipeline(2, 4, [([1], [0, 1], 1), ([2, 3], [2, 3], 1)])]}
S["sym_2pp2_tp2"] = {"pipelines": [pipeline(1, 4, [([0, 1], [0, 1], 1), ([2, 3], [2, 3], 1)]),
                                   pipeline(1, 4, [([4, 5], [0, 1], 1), ([6, 7], [2, 3], 1)])]}

# name -> (world, first strategy, [(step, strategy), ...])
SWITCH_CASES = {
    "dp_to_tp": (4, "dp4", [(2, "tp4")]),
    "tp_to_dp_zero": (4, "tp4", [(3, "dp4_zero")]),
    "zero_to_no_zero": (7, "asym7_tp421_zero", [(2, "asym7_tp421")]),
    "hetero_to_sym": (8, "c2_like_zero", [(2, "sym_2pp2_tp2")]),
    "sym_to_hetero": (8, "sym_2pp2_tp2", [(3, "c2_like")]),
    "world_change": (4, "front_tp2", [(2, "back_pp"), (4, "front_tp2")]),
    "cp_to_tp": (4, "cp2_tp2", [(2, "tp4")]),
    "back_and_forth": (4, "dp2_tp2", [(1, "pp4_1f1b"), (2, "dp2_tp2"), (3, "pp4_1f1b"), (4, "dp2_tp2"),
                                      (5, "pp4_1f1b")]),
}


def max_weight_error(want, got):
    worst = 0.0
    for t, ref in want.items():
        g = got.get(t, [])
        if len(g) != len(ref):
            return float("inf")
        scale = max(max(abs(x) for x in ref), 1e-12)
        worst = max(worst, max(abs(x - y) for x, y in zip(ref, g)) / scale)
    return worst


def bf16_exact_share(weights):
    """The share of the values that are bf16 numbers (their low 16 bits zero)."""
    values = [x for t in weights.values() for x in t]
    exact = sum(1 for x in values if struct.unpack("<I", struct.pack("<f", x))[0] & 0xFFFF == 0)
    return exact / max(len(values), 1)


class Harness:
    def __init__(self, hspmd, tmp, steps, extra=(), base_lr="3e-3", model=None):
        self.hspmd, self.tmp, self.steps = hspmd, tmp, steps
        self.model = os.path.join(tmp, "model.json")
        json.dump(model or MODEL, open(self.model, "w"))
        rng = random.Random(7)
        self.data = os.path.join(tmp, "data.bin")
        with open(self.data, "wb") as f:
            f.write(b"".join(struct.pack("<I", rng.randrange(64)) for _ in range(8192)))
        self.base = [hspmd, "train", "--model", self.model, "--data", self.data, "--steps", str(steps),
                     *(["--lr", base_lr] if base_lr else []), "--eps", "1e-5", "--weight-decay", "0.1", "--clip-grad", "0.5",
                     "--threads", "1", "--quiet", "--seq-len", "16", *extra]
        log, weights = self.path("single.jsonl"), self.path("single.safetensors")
        rc, err = run(self.base + ["--global-batch", "8", "--micro-batches", "4", "--log", log, "--save", weights])
        if rc and ("no CUDA device" in err or "no CUDA backend" in err):
            print("SKIP: " + err.strip())  # a GPU run on a machine without one
            sys.exit(77)
        if rc:
            sys.exit("single-process run failed: " + err)
        self.want_loss, self.want_w = losses(log), read_safetensors(weights)
        self.failures = []

    def path(self, name):
        return os.path.join(self.tmp, name)

    def strategy_file(self, name, strategy):
        p = self.path(name + ".strategy.json")
        json.dump(strategy, open(p, "w"))
        return p

    def train(self, name, world, first, switches, extra=(), env=None):
        """Runs one distributed job; returns (rc, stderr, step records, switch records, weights)."""
        log, weights = self.path(name + ".jsonl"), self.path(name + ".safetensors")
        cmd = self.base + ["--strategy", self.strategy_file(name + "_0", first), "--nproc", str(world),
                           "--log", log, "--save", weights] + list(extra)
        for k, (step, strategy) in enumerate(switches):
            cmd += ["--switch", f"{step}:{self.strategy_file(f'{name}_{k + 1}', strategy)}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if r.returncode:
            return r.returncode, r.stderr, [], [], {}
        recs = records(log)
        return (0, r.stderr, [x for x in recs if "loss" in x], [x for x in recs if x.get("event") == "switch"],
                read_safetensors(weights))

    def check(self, label, ok, detail):
        print(f"{label:28s} {detail} {'ok' if ok else 'FAIL'}")
        if not ok:
            self.failures.append(label)

    def compare(self, label, steps, switch_recs, weights, first_step=0, want_switches=None):
        want = self.want_loss[first_step:]
        got = [r["loss"] for r in steps]
        rel = max((abs(a - b) / abs(a) for a, b in zip(want, got)), default=float("inf"))
        werr = max_weight_error(self.want_w, weights)
        bytes_ok = all(s["bytes_sent"] == s["predicted_bytes"] for s in switch_recs)
        n_ok = want_switches is None or len(switch_recs) == want_switches
        ok = len(got) == len(want) and rel <= 1e-5 and werr <= 1e-4 and bytes_ok and n_ok
        moved = sum(sum(s["bytes_sent"]) for s in switch_recs)
        self.check(label, ok, f"loss rel err {rel:.2e}, weights err {werr:.2e}, {len(switch_recs)} switches, "
                              f"{moved} bytes moved {'= predicted' if bytes_ok else '!= predicted'}")


def bf16_cases(hspmd, tmp, failures):
    """--precision bf16 with ZeRO-1, where the parameters are gathered as bf16
    compute copies: a switch from or to a ZeRO plan must take the weights from
    the f32 masters, and --save writes the masters. With lr 1e-30 the
    weights never change (the updates are below f32's resolution), so the
    saved ones must equal the initial f32 weights exactly; taken from the bf16 copies they would be rounded. (With lr > 0
    bf16 training cannot tell: any f32-level difference flips some bf16
    roundings of the weights, and Adam amplifies that.) The plans run
    micro-batches of the single-process size (2) and no TP, so every GEMM
    sums as one process does; only the gradient accumulation over the data-
    parallel ranks sums in another order, and one f32 ulp there can flip a
    bf16 rounding of a compute copy, which Adam amplifies: the training run
    gets equivalence_test.py's bounds for bf16 plans with the same roundings
    (loss 1e-4, weights 2e-2; measured 1.7e-5 and 6e-4)."""
    h = Harness(hspmd, os.path.join(tmp, "bf16"), steps=5, extra=["--precision", "bf16"])
    os.makedirs(os.path.join(tmp, "bf16_lr0"))
    still = Harness(hspmd, os.path.join(tmp, "bf16_lr0"), steps=5, extra=["--precision", "bf16", "--lr", "1e-30"],
                    base_lr=None)
    dp2 = [pipeline(2, 2, [([0], [0, 3], 1)]), pipeline(2, 2, [([1], [0, 3], 1)])]
    plans = {"dp2_zero": {"zero": True, "pipelines": dp2}, "dp2": {"pipelines": dp2}, "pp2": S["pp2"]}
    for label, first, switches in (("bf16 zero_to_no_zero", "dp2_zero", [(2, "pp2"), (4, "dp2_zero")]),
                                   ("bf16 no_zero_to_zero", "dp2", [(3, "dp2_zero")])):
        name = label.replace(" ", "_")
        rc, err, steps, sw, weights = h.train(name, 2, plans[first], [(k, plans[x]) for k, x in switches])
        rc0, err0, _, _, kept = still.train(name + "_lr0", 2, plans[first], [(k, plans[x]) for k, x in switches])
        if rc or rc0:
            h.check(label, False, f"exit {rc or rc0}: {(err or err0).strip()[-400:]}")
            continue
        want, got = h.want_loss, [r["loss"] for r in steps]
        rel = max((abs(a - b) / abs(a) for a, b in zip(want, got)), default=float("inf"))
        bytes_ok = all(x["bytes_sent"] == x["predicted_bytes"] for x in sw)
        exact = kept == still.want_w and bf16_exact_share(kept) < 0.05
        werr = max_weight_error(h.want_w, weights)
        ok = (len(got) == len(want) and rel <= 1e-4 and werr <= 2e-2 and bytes_ok and len(sw) == len(switches)
              and exact)
        h.check(label, ok, f"loss rel err {rel:.2e}, weights err {werr:.2e}, bytes {'=' if bytes_ok else '!='} predicted; lr 1e-30: saved "
                           f"weights {'equal' if kept == still.want_w else 'differ from'} the initial f32 ones "
                           f"({bf16_exact_share(kept):.1%} bf16-exact)")
    failures += h.failures


def moe_cases(hspmd, tmp, extra, failures):
    """Mixture of experts (docs/moe.md): replicated experts, then expert
    parallelism over groups of 2, then over one group of 4 with a hot expert
    replicated on three members (its tokens split between them), switched
    mid-run; every step and the final weights equal one process."""
    moe = dict(MODEL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
               output_router_logits=True, router_aux_loss_coef=0.02)
    h = Harness(hspmd, tmp, steps=6, extra=extra, model=moe)
    dp4 = {"pipelines": [pipeline(1, 2, [([r], [0, 3], 1)]) for r in range(4)]}
    ep2 = dict(dp4, expert_parallel=2)
    hot = dict(dp4, expert_parallel=4, expert_placement=[{"layers": [0, 3], "experts": [[0, 1, 2], [3], [3], [3]]}])
    rc, err, steps, sw, weights = h.train("moe_placements", 4, dp4, [(2, ep2), (4, hot)])
    if rc:
        h.check("moe placements", False, f"exit {rc}: {err.strip()[-400:]}")
    else:
        h.compare("moe placements", steps, sw, weights, want_switches=2)
    failures += h.failures


def switch_cases(h, names, algorithms):
    for name in names:
        world, first, switches = SWITCH_CASES[name]
        for algorithm in algorithms:
            label = f"{name} ({algorithm})"
            rc, err, steps, sw, weights = h.train(name, world, S[first], [(k, S[s]) for k, s in switches],
                                                  ["--switch-algorithm", algorithm])
            if rc:
                h.check(label, False, f"exit {rc}: {err.strip()[-400:]}")
                continue
            h.compare(label, steps, sw, weights, want_switches=len(switches))


def random_cases(h, count, seed):
    pick = random.Random(seed)
    for k in range(count):
        (wa, a), (wb, b) = random_strategy(pick), random_strategy(pick)
        world, step = max(wa, wb), pick.randint(1, h.steps - 1)
        label = f"random{seed}_{k}"
        rc, err, steps, sw, weights = h.train(label, world, a, [(step, b)])
        if rc:
            h.check(label, False, f"exit {rc}: {err.strip()[-400:]} {json.dumps([a, step, b])}")
            continue
        h.compare(label, steps, sw, weights, want_switches=1)
        if h.failures and h.failures[-1] == label:
            print("  replay:", json.dumps([world, a, step, b]))


def fallback_case(h):
    """Rank 1's memory is gone at the switch: its unique slices come from the
    checkpoint written just before, and only those (the plan's prediction)."""
    ckpt = h.path("fallback_ckpt")
    extra = ["--checkpoint", ckpt, "--save-every", "2", "--switch-lost", "2:1"]
    rc, err, steps, sw, weights = h.train("fallback", 4, S["tp4"], [(2, S["dp2_tp2"])], extra)
    if rc:
        return h.check("fallback (lost rank 1)", False, f"exit {rc}: {err.strip()[-400:]}")
    h.compare("fallback (lost rank 1)", steps, sw, weights, want_switches=1)
    # The dry run of the same switch predicts which bytes come from the checkpoint.
    r = subprocess.run([h.hspmd, "plan", "switch", "--model", h.model, "--from", h.path("fallback_0.strategy.json"),
                        "--to", h.path("fallback_1.strategy.json"), "--world", "4", "--seq-len", "16",
                        "--algorithm", "fused", "--lost-ranks", "1", "--json"], capture_output=True, text=True)
    planned = []
    if r.returncode == 0:
        planned = [x["checkpoint_read"] for x in json.loads(r.stdout)["algorithms"]["fused"]["ranks"]]
    read = sw[0]["checkpoint_bytes"] if sw else []
    h.check("fallback reads", planned == read and sum(read) > 0,
            f"checkpoint bytes read {read}, planned {planned or r.stderr.strip()[-200:]}")
    # Without a checkpoint the same switch fails before moving anything, in one line.
    rc, err, *_ = h.train("fallback_none", 4, S["tp4"], [(2, S["dp2_tp2"])], ["--switch-lost", "2:1"])
    lines = [l for l in err.splitlines() if l.strip()]
    h.check("fallback without checkpoint", rc != 0 and len(lines) == 1 and "no checkpoint" in err,
            repr(err.strip()[-200:]))


def resume_cases(h):
    """--resume under another plan and world equals uninterrupted training."""
    ckpt = h.path("resume_ckpt")
    rc, err, *_ = h.train("resume_a", 7, S["asym7_tp421_zero"], [], ["--checkpoint", ckpt, "--save-every", "4"])
    if rc:
        return h.check("resume", False, f"exit {rc}: {err.strip()[-300:]}")
    index = json.load(open(os.path.join(ckpt, "index.json")))
    rc, err, steps, sw, weights = h.train("resume_b", 3, S["idle_rank"], [], ["--resume", ckpt])
    if rc:
        return h.check("resume 7 -> 3 ranks", False, f"exit {rc}: {err.strip()[-300:]}")
    h.compare(f"resume 7 -> 3 ranks @{index['step']}", steps, sw, weights, first_step=index["step"])

    # A rank killed while writing the checkpoint of step 4 leaves step 2's.
    ckpt = h.path("killed_ckpt")
    env = dict(os.environ, HSPMD_FAULT_KILL_CHECKPOINT="1:4")
    rc, err, *_ = h.train("killed", 4, S["dp2_tp2"], [], ["--checkpoint", ckpt, "--save-every", "2"], env=env)
    index = json.load(open(os.path.join(ckpt, "index.json"))) if os.path.exists(
        os.path.join(ckpt, "index.json")) else {}
    h.check("killed while writing", rc != 0 and index.get("step") == 2, f"exit {rc}, index step {index.get('step')}")
    rc, err, steps, sw, weights = h.train("killed_resume", 4, S["pp4_1f1b"], [], ["--resume", ckpt])
    if rc:
        return h.check("resume after kill", False, f"exit {rc}: {err.strip()[-300:]}")
    h.compare("resume after kill @2", steps, sw, weights, first_step=2)


def plan_cases(h):
    """--plan trains compiled annotation plans (and switches between them);
    a plan without its execution section is refused in one line."""
    plans = []
    for name in ("dp2_tp2", "pp4_1f1b"):
        out = h.path(name + ".plan.json")
        rc, err = run([h.hspmd, "plan", "compile", "--model", h.model, "--strategy", h.strategy_file(name, S[name]),
                       "--world", "4", "--seq-len", "16", "-o", out])
        if rc:
            return h.check("--plan", False, "plan compile: " + err.strip()[-300:])
        plans.append(out)
    log, weights = h.path("plan.jsonl"), h.path("plan.safetensors")
    rc, err = run(h.base + ["--plan", plans[0], "--switch", f"3:{plans[1]}", "--nproc", "4", "--log", log,
                            "--save", weights])
    if rc:
        return h.check("--plan with a switch", False, f"exit {rc}: {err.strip()[-300:]}")
    recs = records(log)
    h.compare("--plan with a switch", [r for r in recs if "loss" in r], [r for r in recs if "event" in r],
              read_safetensors(weights), want_switches=1)
    bare = json.load(open(plans[0]))
    del bare["strategy"]
    json.dump(bare, open(h.path("bare.plan.json"), "w"))
    rc, err = run(h.base + ["--plan", h.path("bare.plan.json"), "--nproc", "4"])
    lines = [l for l in err.splitlines() if l.strip()]
    h.check("--plan without execution", rc != 0 and len(lines) == 1 and "no \"strategy\" field" in err,
            repr(err.strip()[-200:]))


def emulated_case(h):
    cluster = h.path("cluster.json")
    json.dump({"catalog": CLUSTER_CATALOG,
               "nodes": [{"type": "gpu", "ranks": [0, 1]}, {"type": "gpu", "ranks": [2, 3]}]}, open(cluster, "w"))
    rc, err, steps, sw, weights = h.train("emulated", 4, S["tp4"], [(2, S["dp2_tp2"])], ["--cluster", cluster])
    if rc:
        return h.check("emulated switch", False, f"exit {rc}: {err.strip()[-300:]}")
    h.compare("emulated switch", steps, sw, weights, want_switches=1)
    h.check("emulated switch time", bool(sw) and sw[0].get("emulated_switch_s", 0) > 0,
            f"{sw[0].get('emulated_switch_s') if sw else None} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--cases", default=",".join(SWITCH_CASES))
    ap.add_argument("--algorithms", default="fused",
                    help="switch algorithms of the named cases (the first case runs all three)")
    ap.add_argument("--random", type=int, default=4, help="random (plan A, plan B, switch step) triples")
    ap.add_argument("--seed", type=int, default=2027)
    ap.add_argument("--only", default="", help="comma list of parts: cases,random,fallback,resume,plan,emulated,bf16,moe")
    ap.add_argument("--device", default="cpu",
                    help="hspmd train --device for every run (cuda:0: the switches on one GPU, docs/cuda.md)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hspmd_switch_")
    h = Harness(args.hspmd, tmp, steps=6, extra=("--device", args.device))
    parts = set(args.only.split(",")) if args.only else {"cases", "random", "fallback", "resume", "plan",
                                                                "emulated", "bf16", "moe"}
    names = [n for n in args.cases.split(",") if n]
    if "cases" in parts and names:
        switch_cases(h, names[:1], ["naive", "per-tensor", "fused"])
        switch_cases(h, names[1:], args.algorithms.split(","))
    if "random" in parts:
        random_cases(h, args.random, args.seed)
    if "fallback" in parts:
        fallback_case(h)
    if "resume" in parts:
        resume_cases(h)
    if "plan" in parts:
        plan_cases(h)
    if "emulated" in parts:
        emulated_case(h)
    if "bf16" in parts:
        os.makedirs(os.path.join(tmp, "bf16"))
        bf16_cases(args.hspmd, tmp, h.failures)
    if "moe" in parts:
        os.makedirs(os.path.join(tmp, "moe"))
        moe_cases(args.hspmd, os.path.join(tmp, "moe"), ("--device", args.device), h.failures)
    if h.failures:
        sys.exit("FAILED: " + "; ".join(h.failures))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
