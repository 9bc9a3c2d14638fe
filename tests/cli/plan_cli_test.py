#!/usr/bin/env python3
"""`hspmd plan compile` / `hspmd plan explain` / `hspmd plan switch`: bad input
gives one stderr line and a non-zero exit (and writes nothing); the example
strategies of the tiny model compile, their dry runs show the communication
the design promises, and switching between them reports every algorithm
against the lower bounds.

usage: plan_cli_test.py --hspmd PATH --examples DIR [--part basic|kinds]

--part basic (default): help, bad input, that compile / explain succeed
on the tiny examples, and plan switch between them; --part kinds: what the tiny examples' dry runs resolve
to (collectives inside stages, point-to-point between stages, split_* kinds
for gradient sync and ZeRO). Two CTest entries, so that a resolution
regression does not hide behind the CLI checks.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

COLLECTIVES = {"all_gather", "reduce_scatter", "all_reduce"}
POINT_TO_POINT = {"send", "recv", "bsr"}


def run(exe, args):
    return subprocess.run([exe] + args, capture_output=True, text=True, timeout=300)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def hetero():
    """docs/strategy.md's example for the 8-layer tiny model."""
    return {"schedule": "1f1b", "zero": False, "pipelines": [
        {"micro_batch_size": 1, "micro_batches": 4,
         "stages": [{"ranks": [0, 1], "layers": [0, 3]}, {"ranks": [2, 3], "layers": [4, 7]}]},
        {"micro_batch_size": 1, "micro_batches": 4,
         "stages": [{"ranks": [4], "layers": [0, 2]}, {"ranks": [5], "layers": [3, 5]},
                    {"ranks": [6], "layers": [6, 7]}]}]}


def modified(edit):
    s = hetero()
    edit(s)
    return s


class Checker:
    def __init__(self):
        self.failures = []

    def check(self, name, ok, detail=""):
        print(f"{name:52s} {'ok' if ok else 'FAIL'}{': ' + detail if detail and not ok else ''}")
        if not ok:
            self.failures.append(name)

    def error_case(self, exe, name, args, needle, no_file=None):
        r = run(exe, args)
        lines = r.stderr.strip().splitlines()
        problems = []
        if r.returncode == 0:
            problems.append("exit code 0")
        if len(lines) != 1:
            problems.append(f"{len(lines)} stderr lines")
        elif not lines[0].startswith("hspmd: ") or needle not in lines[0]:
            problems.append(f"message does not name '{needle}'")
        if no_file and os.path.exists(no_file):
            problems.append(f"wrote {no_file}")
        self.check(name, not problems, ", ".join(problems) + ": " + r.stderr.strip()[:200])


def stage_of(strategy):
    """rank -> (pipeline, stage)."""
    out = {}
    for p, pl in enumerate(strategy["pipelines"]):
        for s, st in enumerate(pl["stages"]):
            for r in st["ranks"]:
                out[r] = (p, s)
    return out


def peers_of(op):
    """The peer ranks of a send/recv/bsr op, whatever the exact JSON spelling."""
    out = []
    for p in op.get("peers", []):
        out.append(p["peer"] if isinstance(p, dict) else p)
    return out


def ops(report):
    for res in report["reshards"]:
        for rank in res["ranks"]:
            for op in rank["ops"]:
                yield res, rank["rank"], op


def check_kinds(c, name, report, strategy):
    where = stage_of(strategy)
    inside = any(op["kind"] in COLLECTIVES and len(op.get("group", [])) > 1
                 and len({where.get(g) for g in op["group"]}) == 1
                 for _, _, op in ops(report))
    c.check(f"{name}: collectives inside a stage", inside)
    between = any(op["kind"] in POINT_TO_POINT and any(
        where.get(peer, (None,))[0] == where[rank][0] and where.get(peer) != where[rank]
        for peer in peers_of(op)) for _, rank, op in ops(report))
    c.check(f"{name}: send/recv or bsr between stages", between)
    phases = {res["phase"] for res in report["reshards"]}
    c.check(f"{name}: phases", {"forward", "backward", "grad_sync"} <= phases, str(sorted(phases)))


def kinds_in_phase(report, phase):
    return {res["kind"] for res in report["reshards"] if res["phase"] == phase}


BAD_STRATEGIES = {
    "rank_twice.json": (lambda s: s["pipelines"][1]["stages"][0].update(ranks=[3]),
                        "rank 3 appears twice (pipeline 0 stage 1 and pipeline 1 stage 0)"),
    "layer_gap.json": (lambda s: s["pipelines"][0]["stages"][1].update(layers=[5, 7]),
                       "leave a gap after layer 3"),
    "layer_overlap.json": (lambda s: s["pipelines"][1]["stages"][1].update(layers=[2, 5]), "overlap"),
    "tp3.json": (lambda s: s["pipelines"][0]["stages"][0].update(ranks=[0, 1, 7]),
                 "tp=3 does not divide num_attention_heads=8"),
    "rank_outside.json": (lambda s: s["pipelines"][1]["stages"][2].update(ranks=[8]),
                          "rank 8 is outside the world of 8 ranks"),
    "unknown_field.json": (lambda s: s["pipelines"][0]["stages"][0].update(tp=2), "unknown field 'tp'"),
    "layers_short.json": (lambda s: s["pipelines"][1]["stages"][2].update(layers=[6, 6]),
                          "the stages end at layer 6"),
}


class Env:
    def __init__(self, exe, examples):
        self.exe, self.examples = exe, examples
        self.tmp = tempfile.mkdtemp()
        self.model = os.path.join(examples, "models", "llama-tiny-8l.json")

    def p(self, name):
        return os.path.join(self.tmp, name)

    def compile_args(self, strategy, world="8", out=None):
        return ["plan", "compile", "--model", self.model, "--strategy", strategy, "--world", world,
                "-o", out or self.p("out_plan.json")]


def check_help(c, e):
    for args in (["plan", "--help"], ["plan", "compile", "--help"], ["plan", "explain", "--help"],
                 ["plan", "switch", "--help"]):
        r = run(e.exe, args)
        c.check(" ".join(args), r.returncode == 0 and r.stdout.startswith("usage: hspmd"), r.stderr)


def check_bad_input(c, e):
    exe, p, out = e.exe, e.p, e.p("out_plan.json")
    with open(p("bad_json.json"), "w") as f:
        f.write('{"pipelines": [{"micro_batch_size": 1,')
    write_json(p("ok.json"), hetero())
    c.error_case(exe, "strategy: bad JSON", e.compile_args(p("bad_json.json")), "bad_json.json", out)
    for fname, (edit, needle) in BAD_STRATEGIES.items():
        write_json(p(fname), modified(edit))
        c.error_case(exe, f"strategy: {fname}", e.compile_args(p(fname)), needle, out)
    c.error_case(exe, "strategy: missing file", e.compile_args(p("nope.json")), "nope.json", out)
    c.error_case(exe, "compile: world too small", e.compile_args(p("ok.json"), world="6"),
                 "outside the world of 6 ranks", out)
    c.error_case(exe, "compile: world 0", e.compile_args(p("ok.json"), world="0"), "--world", out)
    c.error_case(exe, "compile: missing --world",
                 ["plan", "compile", "--model", e.model, "--strategy", p("ok.json"), "-o", out], "--world", out)
    c.error_case(exe, "compile: unknown flag", e.compile_args(p("ok.json")) + ["--frobnicate", "1"],
                 "--frobnicate", out)
    c.error_case(exe, "compile: missing model", ["plan", "compile", "--model", p("nope_model.json"),
                                                 "--strategy", p("ok.json"), "--world", "8", "-o", out],
                 "nope_model.json", out)
    c.error_case(exe, "plan: no subcommand", ["plan"], "subcommand")
    c.error_case(exe, "plan: unknown subcommand", ["plan", "frobnicate"], "frobnicate")
    c.error_case(exe, "explain: missing plan", ["plan", "explain", p("nope_plan.json")], "nope_plan.json")
    c.error_case(exe, "explain: no plan given", ["plan", "explain"], "PLAN.json")
    c.error_case(exe, "explain: bad JSON plan", ["plan", "explain", p("bad_json.json")], "bad_json.json")


SWITCH_KEYS = {"predicted_s", "max_rank_bytes", "total_bytes", "ranks"}
ALGORITHMS = {"naive", "per-tensor", "fused"}


def check_switch_report(c, name, report, world, algorithms=ALGORITHMS):
    """The JSON of `plan switch`: bounds, then per algorithm its figures and ranks."""
    got = set(report.get("algorithms", {}))
    c.check(f"{name}: algorithms", got == algorithms, str(sorted(got)))
    for alg, a in report.get("algorithms", {}).items():
        c.check(f"{name}: {alg} fields", SWITCH_KEYS <= set(a) and len(a["ranks"]) == world, str(sorted(a)))
        # The sender bound assumes the same-node rule, which naive ignores.
        bound = max(report["lower_bound_s"], 0 if alg == "naive" else report["sender_bound_s"])
        c.check(f"{name}: {alg} bounds <= predicted", 0 <= bound <= a["predicted_s"] * (1 + 1e-9),
                f"{bound} > {a['predicted_s']}")
        sent = sum(r["intra_sent"] + r["inter_sent"] for r in a["ranks"])
        received = sum(r["intra_received"] + r["inter_received"] for r in a["ranks"])
        most = max(r["intra_sent"] + r["inter_sent"] for r in a["ranks"])
        c.check(f"{name}: {alg} sent == received",
                sent == received == a["total_bytes"] and most == a["max_rank_bytes"],
                f"{sent} {received} {a['total_bytes']}")


def check_switch(c, e):
    """`plan switch` between the tiny examples: a plan JSON and a strategy JSON."""
    exe, strategies = e.exe, os.path.join(e.examples, "strategies")
    hetero, zero = os.path.join(strategies, "tiny_hetero_8.json"), os.path.join(strategies, "tiny_zero_8.json")
    plan = e.p("switch_from.plan.json")
    r = run(exe, e.compile_args(hetero, out=plan))
    c.check("switch: compile the source plan", r.returncode == 0, r.stderr.strip()[:300])
    base = ["plan", "switch", "--model", e.model, "--world", "8"]
    r = run(exe, base + ["--from", plan, "--to", zero, "--json", "--cluster", e.p("cluster8.json")])
    c.check("switch: plan -> strategy --json", r.returncode == 0, r.stderr.strip()[:300])
    if r.returncode == 0:
        report = json.loads(r.stdout)
        check_switch_report(c, "switch", report, 8)
        fused, naive = report["algorithms"]["fused"], report["algorithms"]["naive"]
        c.check("switch: fused no slower than naive", fused["predicted_s"] <= naive["predicted_s"])
        c.check("switch: bytes move", fused["total_bytes"] > 0)
    r = run(exe, base + ["--from", zero, "--to", hetero, "--algorithm", "fused", "--bucket-mb", "0.01", "--json"])
    if r.returncode == 0:
        check_switch_report(c, "switch --algorithm fused", json.loads(r.stdout), 8, {"fused"})
    else:
        c.check("switch --algorithm fused", False, r.stderr.strip()[:300])
    r = run(exe, base + ["--from", zero, "--to", hetero, "--lost-ranks", "0,4"])
    c.check("switch: text, lost ranks and a checkpoint", r.returncode == 0 and "lower bound" in r.stdout
            and "fused:" in r.stdout and "naive:" in r.stdout, r.stderr.strip()[:300])
    r = run(exe, base + ["--from", zero, "--to", hetero, "--lost-ranks", "0,4", "--json"])
    reads = [sum(x["checkpoint_read"] for x in a["ranks"]) for a in json.loads(r.stdout)["algorithms"].values()] \
        if r.returncode == 0 else []
    c.check("switch: lost shards read from the checkpoint", len(reads) == 3 and min(reads) > 0, str(reads))
    c.error_case(exe, "switch: lost shard without checkpoint",
                 base + ["--from", zero, "--to", hetero, "--lost-ranks", "0,4", "--no-checkpoint"],
                 "is held by no available rank (lost: 0,4) and there is no checkpoint")
    c.error_case(exe, "switch: unknown algorithm", base + ["--from", zero, "--to", hetero, "--algorithm", "fast"],
                 "unknown switch algorithm 'fast'")
    c.error_case(exe, "switch: lost rank outside the world",
                 base + ["--from", zero, "--to", hetero, "--lost-ranks", "3,9"], "rank 9 is outside the world of 8")
    c.error_case(exe, "switch: bad rank list", base + ["--from", zero, "--to", hetero, "--lost-ranks", "3,x"],
                 "'x' is not a rank")
    c.error_case(exe, "switch: strategy without --model",
                 ["plan", "switch", "--world", "8", "--from", plan, "--to", zero], "--model is required")
    c.error_case(exe, "switch: plan of another world",
                 base[:-1] + ["9", "--from", plan, "--to", zero], "the plan's world has 8 ranks")
    c.error_case(exe, "switch: missing --to", base + ["--from", plan], "--to")
    c.error_case(exe, "switch: missing strategy file", base + ["--from", plan, "--to", e.p("nope.json")],
                 "nope.json")


def write_clusters(e):
    fast = {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 400, "inter_node_gbps": 25}
    slow = {"tflops": 50, "memory_gib": 96, "intra_node_gbps": 900, "inter_node_gbps": 25}
    write_json(e.p("cluster8.json"), {"catalog": {"fast": fast, "slow": slow},
                                      "nodes": [{"type": "fast", "ranks": [0, 3]},
                                                {"type": "slow", "ranks": [4, 7]}]})
    write_json(e.p("cluster4.json"), {"catalog": {"fast": fast}, "nodes": [{"type": "fast", "ranks": [0, 3]}]})


def compile_and_explain(c, e, name, basic):
    """Compiles examples/strategies/NAME.json; returns `explain --json`'s report (None on failure)."""
    exe, p = e.exe, e.p
    plan = p(name + ".plan.json")
    r = run(exe, e.compile_args(os.path.join(e.examples, "strategies", name + ".json"), out=plan))
    lines = r.stderr.strip().splitlines()
    c.check(f"{name}: compile", r.returncode == 0 and os.path.exists(plan) and len(lines) == 1
            and "pipelines" in lines[0], r.stderr.strip()[:300])
    if r.returncode != 0:
        return None
    r = run(exe, ["plan", "explain", plan, "--json"])
    c.check(f"{name}: explain --json", r.returncode == 0, r.stderr.strip()[:300])
    if r.returncode != 0:
        return None
    report = json.loads(r.stdout)
    if not basic:
        return report
    c.check(f"{name}: world_size", report["world_size"] == 8)
    if name == "tiny_hetero_8":
        check_pipelines(c, name, report, e)
    listed = len(report["reshards"])
    c.check(f"{name}: summary counts", sum(report["summary"].values()) >= listed > 0,
            f"{report['summary']} vs {listed} listed")
    c.check(f"{name}: identity hidden", all(res["kind"] != "identity" for res in report["reshards"]))
    r = run(exe, ["plan", "explain", plan])
    c.check(f"{name}: explain (text)", r.returncode == 0 and "summary" in r.stdout, r.stderr.strip()[:300])
    r = run(exe, ["plan", "explain", plan, "--json", "--rank", "5", "--all", "--cluster", p("cluster8.json")])
    ok = r.returncode == 0 and all(rank["rank"] == 5 for res in json.loads(r.stdout)["reshards"]
                                   for rank in res["ranks"])
    c.check(f"{name}: explain --rank 5 --all --cluster", ok, r.stderr.strip()[:300])
    c.error_case(exe, f"{name}: --rank outside the world", ["plan", "explain", plan, "--rank", "8"], "--rank 8")
    c.error_case(exe, f"{name}: cluster of another size",
                 ["plan", "explain", plan, "--cluster", p("cluster4.json")], "cluster4.json")
    return report


def check_pipelines(c, name, report, e):
    """`explain --json` lists the pipelines discovered from the plan: the strategy's."""
    with open(os.path.join(e.examples, "strategies", name + ".json")) as f:
        strategy = json.load(f)
    want = [[{"ranks": sorted(st["ranks"]), "layers": st["layers"]} for st in pl["stages"]]
            for pl in strategy["pipelines"]]
    got = report.get("pipelines")
    c.check(f"{name}: discovered pipelines", got == want, f"{got} != {want}")


def check_resolutions(c, e, reports):
    """What the dry runs resolve to (docs/resolver.md, docs/plan.md)."""
    with open(os.path.join(e.examples, "strategies", "tiny_hetero_8.json")) as f:
        hetero_strategy = json.load(f)
    if reports.get("tiny_hetero_8"):
        rep = reports["tiny_hetero_8"]
        check_kinds(c, "tiny_hetero_8", rep, hetero_strategy)
        grad = kinds_in_phase(rep, "grad_sync")
        c.check("tiny_hetero_8: grad sync by split_all_reduce", "split_all_reduce" in grad, str(sorted(grad)))
    if reports.get("tiny_zero_8"):
        rep = reports["tiny_zero_8"]
        grad, gather = kinds_in_phase(rep, "grad_sync"), kinds_in_phase(rep, "zero_gather")
        c.check("tiny_zero_8: grad sync by split_reduce_scatter", "split_reduce_scatter" in grad,
                str(sorted(grad)))
        c.check("tiny_zero_8: parameters by split_all_gather", "split_all_gather" in gather, str(sorted(gather)))
    if reports.get("tiny_cp_8"):
        # Communication inside ops: the tp 2 x cp 2 stage's ring attention
        # over cp pairs in its 4 layers, forward and backward.
        traffic = {(t["op"], t["phase"]): t for t in reports["tiny_cp_8"].get("op_traffic", [])}
        ring = traffic.get(("attention", "forward"))
        ok = (ring is not None and ring["kind"] == "ring_attention" and ring["calls"] == 4 and
              sorted(ring["ranks"]) == ["0", "1", "2", "3"] and
              ring["ranks"]["0"]["group"] == [0, 2] and ring["ranks"]["0"]["bytes_sent"] > 0 and
              ("attention_grad", "backward") in traffic)
        c.check("tiny_cp_8: ring attention inside ops", ok, str(sorted(traffic)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--part", choices=("basic", "kinds"), default="basic")
    a = ap.parse_args()
    e, c = Env(a.hspmd, a.examples), Checker()
    basic = a.part == "basic"
    if basic:
        check_help(c, e)
        check_bad_input(c, e)
        write_clusters(e)
        check_switch(c, e)
    reports = {name: compile_and_explain(c, e, name, basic)
               for name in ("tiny_hetero_8", "tiny_zero_8", "tiny_cp_8")}
    if not basic:
        check_resolutions(c, e, reports)
    if c.failures:
        sys.exit("FAILED: " + ", ".join(c.failures))
    print("PASS")


if __name__ == "__main__":
    main()
