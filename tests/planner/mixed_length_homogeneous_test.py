"""`hspmd plan search --lengths` against hand-made candidates, scored by
`hspmd plan cost --lengths` (the same dispatch and sync prediction), on an
8-rank cluster of two speeds (ranks 4-7 at half speed) whose optimizer step
is a large part of a step (a fixed profile: per-token work split over tp, a
small overhead per call, AdamW at 1e-7 s per parameter), so that data
parallelism repeats the optimizer over every parameter on every rank while
TP shards it, and a slow rank's optimizer takes twice as long:

* the best candidate of one TP degree per class (all tp1, tp2 or tp4, tp1
  or tp2 on the fast ranks beside tp2 or tp4 on the slow ones) mixes the
  degrees (the slow ranks want the wider pipelines), and the heterogeneous
  plan (one bucket) predicts no slower a step than it: a sweep of one least
  pipeline size for every class (the planner before per-class minima) gives
  all tp4 here, 0.3% slower;
* `--homogeneous`: every pipeline of every bucket has the same layout (tp,
  cp, stages) and accepts the bucket's maximum, the pipelines fill the
  ranks or one device class's, and the prediction is no slower than all
  tp1, tp2 or tp4; with `--dispatch symmetric` likewise, scored as `plan
  cost --dispatch symmetric` scores it;
* `plan cost --lengths` leaves out steps it does not accept; its one-line
  errors."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "exec"))
from equivalence_test import MODEL  # noqa: E402
from mixed_length_plan_test import make_docs  # noqa: E402

L, T = 32, 96


def layout(p):
    return [(len(s["ranks"]), s.get("cp", 1), s["layers"]) for s in p["stages"]], p["max_seq_len"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    a = ap.parse_args()
    failures = []

    def check(label, ok, detail=""):
        print(f"{label:52s} {detail} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(label)

    with tempfile.TemporaryDirectory() as tmp:
        f = lambda name: os.path.join(tmp, name)  # noqa: E731
        model, data, cluster, prof = f("model.json"), f("docs.bin"), f("cluster.json"), f("prof.json")
        json.dump(MODEL, open(model, "w"))
        make_docs(data, n=6000)
        dev = {"tflops": 2, "memory_gib": 1, "intra_node_gbps": 10, "inter_node_gbps": 2}
        json.dump({"catalog": {"fast": dev, "slow": dev},
                   "nodes": [{"type": "fast", "ranks": [0, 3]}, {"type": "slow", "ranks": [4, 7], "slowdown": 2.0}]},
                  open(cluster, "w"))
        subprocess.run([a.hspmd, "profile", "--model", model, "--tp", "1,2,4", "--seq-lens", "8,16,32",
                        "--micro-batch-sizes", "1", "--repetitions", "1", "-o", prof],
                       check=True, capture_output=True, timeout=300)
        # Fixed timings of the measured magnitude (per-token work split over
        # tp, a fixed overhead per call), and an optimizer step of 2e-7 s per
        # parameter: the plan does not depend on the machine's load.
        fixed = {"embed_fwd": (4e-9, 2e-6), "embed_bwd": (6e-9, 2e-6), "block_fwd": (1.4e-6, 2e-5),
                 "block_bwd": (1.1e-6, 4e-5), "head_fwd": (1.3e-7, 4e-6), "head_bwd": (1.5e-7, 6e-6)}
        pj = json.load(open(prof))
        for e in pj["entries"]:
            e.pop("emulation_factor", None)
            for part, (c, d) in fixed.items():
                e["parts"][part].update({"a": 0.0, "c": c / (e["tp"] * e["cp"]), "d": d / 100})
        pj["optimizer"].update({"per_param_s": 1e-7, "fixed_s": 0.0})
        json.dump(pj, open(prof, "w"))
        lengths = ["--lengths", data, "--batch-tokens", str(T), "--max-seq-len", str(L)]
        base = [a.hspmd, "plan", "search", "--model", model, "--cluster", cluster, "--profile", prof,
                "--max-cp", "1", "--no-recompute", "--json"] + lengths

        def cost(strategy, extra=()):
            path = f("cand.json")
            json.dump(strategy, open(path, "w"))
            r = subprocess.run([a.hspmd, "plan", "cost", "--model", model, "--cluster", cluster, "--profile", prof,
                                "--strategy", path, "--json"] + lengths + list(extra), capture_output=True, text=True)
            if r.returncode:
                sys.exit("plan cost --lengths failed: " + r.stderr)
            return json.loads(r.stdout)

        def cand(groups):
            return {"max_seq_len": L, "pipelines": [
                {"max_seq_len": L, "micro_batch_tokens": L, "stages": [{"ranks": g, "layers": [0, 3]}]}
                for g in groups]}

        cands = {"all tp1": cand([[r] for r in range(8)]), "all tp2": cand([[0, 1], [2, 3], [4, 5], [6, 7]]),
                 "all tp4": cand([[0, 1, 2, 3], [4, 5, 6, 7]]),
                 "tp1 fast, tp4 slow": cand([[0], [1], [2], [3], [4, 5, 6, 7]]),
                 "tp1 fast, tp2 slow": cand([[0], [1], [2], [3], [4, 5], [6, 7]]),
                 "tp2 fast, tp4 slow": cand([[0, 1], [2, 3], [4, 5, 6, 7]])}
        pred = {k: cost(v)["median_step_s"] for k, v in cands.items()}
        best = min(pred, key=pred.get)
        check("the best candidate mixes TP degrees by class", not best.startswith("all") and all(
            pred[best] < v for k, v in pred.items() if k.startswith("all")),
              ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in pred.items()))

        r = subprocess.run(base + ["--buckets", "1"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            sys.exit("plan search --lengths failed: " + r.stderr)
        b = json.loads(r.stdout)["buckets"][0]
        got = cost(b["strategy"])["median_step_s"]
        check("plan: predicted as plan cost --lengths predicts it", abs(got - b["predicted_step_s"]) <= 1e-9 * got,
              f"{b['predicted_step_s']:.6g} / {got:.6g}")
        check("plan: no slower than every candidate", got <= pred[best] * (1 + 1e-9),
              f"{got * 1e3:.3f} ms against {pred[best] * 1e3:.3f} ({best}); " +
              "; ".join(f"<={p['max_seq_len']} ranks {[s['ranks'] for s in p['stages']]}"
                        for p in b["strategy"]["pipelines"]))

        r = subprocess.run(base + ["--buckets", "2", "--homogeneous"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            sys.exit("plan search --lengths --homogeneous failed: " + r.stderr)
        hb = json.loads(r.stdout)["buckets"]
        same = all(len({json.dumps(layout(p)) for p in x["strategy"]["pipelines"]}) == 1 and
                   all(p["max_seq_len"] == x["max_seq_len"] for p in x["strategy"]["pipelines"]) for x in hb)
        check("--homogeneous: one layout per bucket, each takes the maximum", len(hb) == 2 and same,
              "; ".join(str(sorted({json.dumps(layout(p)) for p in x["strategy"]["pipelines"]})) for x in hb))
        used = [sorted(r for p in x["strategy"]["pipelines"] for s in p["stages"] for r in s["ranks"]) for x in hb]
        check("--homogeneous: the pipelines fill the ranks, or one class's",
              all(u in (list(range(8)), list(range(4)), list(range(4, 8))) for u in used), f"ranks used {used}")
        # Scored under the symmetric dispatch (blind to the slow ranks' speed):
        # plan cost predicts the chosen plan the same way, no slower than the
        # same layouts on every rank, and on no more ranks than those.
        sym = ["--dispatch", "symmetric"]
        r = subprocess.run(base + ["--buckets", "1", "--homogeneous"] + sym, capture_output=True, text=True,
                           timeout=300)
        if r.returncode:
            sys.exit("plan search --lengths --homogeneous --dispatch symmetric failed: " + r.stderr)
        hs = json.loads(r.stdout)["buckets"][0]
        sgot = cost(hs["strategy"], sym)["median_step_s"]
        check("--dispatch symmetric: predicted as plan cost --dispatch symmetric predicts it",
              abs(sgot - hs["predicted_step_s"]) <= 1e-9 * sgot, f"{hs['predicted_step_s']:.6g} / {sgot:.6g}")
        sbest = min(cost(cands[k], sym)["median_step_s"] for k in ("all tp1", "all tp2", "all tp4"))
        check("--dispatch symmetric: no slower than all tp1, tp2 or tp4", sgot <= sbest * (1 + 1e-9),
              f"{sgot * 1e3:.3f} ms against {sbest * 1e3:.3f}")
        t1 = (cost(cands["all tp1"], sym)["median_step_s"], cost(cands["all tp1"])["median_step_s"])
        check("--dispatch symmetric: blind to the slow ranks (all tp1 slower than by cost)", t1[0] > t1[1],
              f"{t1[0] * 1e3:.3f} ms against {t1[1] * 1e3:.3f}")
        r = subprocess.run(base + ["--buckets", "1", "--homogeneous"], capture_output=True, text=True, timeout=300)
        h1 = json.loads(r.stdout)["buckets"][0]
        hgot = cost(h1["strategy"])["median_step_s"]
        hbest = min(pred["all tp1"], pred["all tp2"], pred["all tp4"])
        check("--homogeneous: no slower than all tp1 or all tp2", hgot <= hbest * (1 + 1e-9),
              f"{hgot * 1e3:.3f} ms against {hbest * 1e3:.3f}")

        # plan cost --lengths: steps above a strategy's longest piece are left out; errors.
        short = cand([[r] for r in range(8)])
        for p in short["pipelines"]:
            p["max_seq_len"] = p["micro_batch_tokens"] = 16
        short["max_seq_len"] = 16
        c = cost(short)
        check("plan cost --lengths skips steps it does not accept", c["skipped_steps"] > 0 and c["steps"] > 0 and
              c["max_accepted"] == 16, f"{c['steps']} steps, {c['skipped_steps']} skipped")
        json.dump(cands["all tp1"], open(f("s.json"), "w"))
        pc = [a.hspmd, "plan", "cost", "--model", model, "--cluster", cluster, "--profile", prof,
              "--strategy", f("s.json")]

        def err(extra, want_text, args):
            r = subprocess.run(args + extra, capture_output=True, text=True)
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            check("error: " + want_text, r.returncode != 0 and len(lines) == 1 and want_text in r.stderr,
                  lines[0][:150] if lines else "")
        err(["--lengths", data], "[flags] --lengths needs --batch-tokens T >= 1 and --max-seq-len L >= 1", pc)
        err(lengths + ["--seq-len", "8"], "[flags] --seq-len is not read with --lengths", pc)
        err(["--seq-len", "8", "--batch-tokens", "96"], "[flags] --batch-tokens, --max-seq-len and --dispatch are "
            "read only with --lengths", pc)
        err(["--seq-len", "8", "--dispatch", "symmetric"], "[flags] --batch-tokens, --max-seq-len and --dispatch are "
            "read only with --lengths", pc)
        err(lengths + ["--dispatch", "fast"], "[flags] --dispatch must be cost or symmetric, got 'fast'", pc)
    if failures:
        sys.exit(f"{len(failures)} failure(s): {failures}")
    print("all mixed-length candidate cases passed")


if __name__ == "__main__":
    main()
