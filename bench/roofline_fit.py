#!/usr/bin/env python3
"""Calibrates the GPU roofline of the paper's example clusters (docs/planner.md,
"Calibration against the paper's measured step times").

Data, all from the paper:
  * measured step times: the paper's text gives two, both 32B on 16 H800 +
    32 H20, batch 64, sequence 4096: its heterogeneous strategy with ZeRO-1
    (four pipelines, "DP4", examples/strategies/hetero_32b_16h800_32h20.json)
    6.05 s, and C4 of the elastic trace without ZeRO (two pipelines,
    elastic_c4_16h800_32h20.json) 6.91 s (appendix, scenario (b));
  * the layer splits of its planner: the paper's 32B strategies on 16 H800 +
    16/24/32 H20 (all TP 4, micro-batch 1) come from a profiling-based planner
    that balances stage times, so a calibrated model should find their
    slowest H20 stage and slowest H800 stage equally busy. Each strategy is
    one observation: log(max H20 rank compute / max H800 rank compute) = 0.

Parameters: the catalog's `efficiency` of the H800 and of the H20 and one
`inter_node_gbps` for both (the paper does not give its network). Fit:
least squares on the log residuals (log predicted / measured step time, and
the log balances), each over its sigma (a step time 5%, a balance half a
layer of the H20 stage), by a pattern search in log space over every prediction
`hspmd plan cost` makes with a temporary catalog. Leave-one-out: each
observation left out in turn, refitted, and predicted.

  python3 bench/roofline_fit.py            # table before/after, fit, leave-one-out
  python3 bench/roofline_fit.py --check    # the committed catalogs only; exit 1 when a
                                           # measured case is off by more than --tolerance
                                           # or C4 / DP4 falls below 1.02 (the paper's order;
                                           # the fit's 1.045, the catalog before it 0.964)
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EX = os.path.join(ROOT, "examples")
SEQ_LEN = "4096"

# (name, cluster, model, strategy, the paper's measured step s)
MEASURED = [("DP4: 32B, 16 H800 + 32 H20, ZeRO-1", "16h800_32h20.json", "llama-32b",
             "hetero_32b_16h800_32h20.json", 6.05),
            ("C4: 32B, 16 H800 + 32 H20, no ZeRO", "16h800_32h20.json", "llama-32b",
             "elastic_c4_16h800_32h20.json", 6.91)]
# (name, cluster, model, strategy): the paper's planner's balanced layer splits
# and the H20 stage's layer count: the split is known to half a layer of it.
BALANCED = [("balance 32B 16+16 (H800 23 : H20 7 layers)", "16h800_16h20.json", "llama-32b",
             "hetero_32b_16h800_16h20.json", 7),
            ("balance 32B 16+24 (21 : 6)", "16h800_24h20.json", "llama-32b", "hetero_32b_16h800_24h20.json", 6),
            ("balance 32B 16+32 (38 : 11)", "16h800_32h20.json", "llama-32b", "hetero_32b_16h800_32h20.json", 11)]
# The catalog before this calibration (2026-11-24 .. 2026-11-27).
BEFORE = {"H800": 0.4, "H20": 0.8, "inter": 25.0}
# Weights (1 / sigma of the log residual): a measured step time 5% (what the
# roofline can be asked for), a balance half a layer of the H20 stage.
SIGMA_STEP = 0.05
# --check's floor on the predicted C4 / DP4: the paper's order (C4 the slower,
# measured 1.142). The fit reaches 1.045 since the cost model overlaps a GPU's
# gradient sync with its last backward; without that overlap the best fit
# was 0.979 (docs/planner.md).
MIN_RATIO = 1.02
# Tolerance of --check: the largest error of the fit (4.5%, docs/planner.md), rounded up.
TOLERANCE = 0.06


def run_cost(hspmd, cluster_path, model, strategy):
    p = subprocess.run([hspmd, "plan", "cost", "--model", os.path.join(EX, "models", model + ".json"),
                        "--cluster", cluster_path, "--strategy", os.path.join(EX, "strategies", strategy),
                        "--seq-len", SEQ_LEN, "--json"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: plan cost {cluster_path} {strategy}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


class Model:
    """Predictions of `hspmd plan cost` with the catalog's efficiencies and
    inter-node bandwidth replaced (params None: the committed catalog)."""

    def __init__(self, hspmd, tmp):
        self.hspmd, self.tmp, self.cache = hspmd, tmp, {}

    def cluster(self, name, params):
        path = os.path.join(EX, "clusters", name)
        if params is None:
            return path
        c = json.load(open(path))
        for t, spec in c["catalog"].items():
            spec["efficiency"] = params[t]
            spec["inter_node_gbps"] = params["inter"]
        out = os.path.join(self.tmp, name)
        json.dump(c, open(out, "w"))
        return out

    def cost(self, params, cluster, model, strategy):
        key = (None if params is None else tuple(sorted(params.items())), cluster, model, strategy)
        if key not in self.cache:
            self.cache[key] = run_cost(self.hspmd, self.cluster(cluster, params), model, strategy)
        return self.cache[key]

    def step(self, params, case):
        return self.cost(params, case[1], case[2], case[3])["predicted_step_s"]

    def balance(self, params, case):
        ranks = [r for r in self.cost(params, case[1], case[2], case[3])["ranks"] if r["pipeline"] >= 0]
        h800 = max(r["compute_s"] for r in ranks if r["rank"] < 16)
        h20 = max(r["compute_s"] for r in ranks if r["rank"] >= 16)
        return h20 / h800

    def residuals(self, params, skip=None):
        """Weighted log residuals of every observation (the one at index `skip` left out)."""
        res = [math.log(self.step(params, c) / c[4]) / SIGMA_STEP for c in MEASURED]
        res += [math.log(self.balance(params, c)) / (0.5 / c[4]) for c in BALANCED]
        return [r for i, r in enumerate(res) if i != skip]


def snap(params):
    # Catalog precision: efficiencies to 0.01, the bandwidth to 1 GB/s.
    return {"H800": round(min(1.0, params["H800"]), 2), "H20": round(min(1.0, params["H20"]), 2),
            "inter": float(round(params["inter"]))}


def fit(model, start, skip=None):
    """Pattern search on log parameters; efficiencies capped at 1, bandwidth in [5, 50] GB/s (one 400 Gb/s NIC per GPU)."""
    bounds = {"H800": (0.05, 1.0), "H20": (0.05, 1.0), "inter": (5.0, 50.0)}
    cur = snap(start)
    loss = lambda p: sum(r * r for r in model.residuals(p, skip))
    best = loss(cur)
    step = 0.2
    while step > 0.004:
        improved = False
        for k in ("H800", "H20", "inter"):
            for sign in (1, -1):
                cand = dict(cur)
                lo, hi = bounds[k]
                cand[k] = min(hi, max(lo, cur[k] * math.exp(sign * step)))
                cand = snap(cand)
                if cand == cur:
                    continue
                l = loss(cand)
                if l < best - 1e-12:
                    cur, best, improved = cand, l, True
        if not improved:
            step /= 2
    return cur, best


def table(model, before, after):
    print(f"{'case':44s} {'paper':>7s} {'before':>8s} {'err':>7s} {'after':>8s} {'err':>7s}")
    errs = []
    for c in MEASURED:
        b, a = model.step(before, c), model.step(after, c)
        errs.append(a / c[4] - 1)
        print(f"{c[0]:44s} {c[4]:7.2f} {b:8.3f} {b / c[4] - 1:+7.1%} {a:8.3f} {a / c[4] - 1:+7.1%}")
    rb = model.step(before, MEASURED[1]) / model.step(before, MEASURED[0])
    ra = model.step(after, MEASURED[1]) / model.step(after, MEASURED[0])
    print(f"{'C4 / DP4':44s} {MEASURED[1][4] / MEASURED[0][4]:7.3f} {rb:8.3f} {'':7s} {ra:8.3f}")
    for c in BALANCED:
        print(f"{c[0] + ': H20 / H800 compute':44s} {1.0:7.2f} {model.balance(before, c):8.3f} {'':7s} "
              f"{model.balance(after, c):8.3f}")
    return errs, ra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--check", action="store_true", help="check the committed catalogs only")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits")
    args = ap.parse_args()
    model = Model(args.hspmd, tempfile.mkdtemp(prefix="hspmd_roofline_fit_"))
    if args.check:
        errs, ratio = table(model, BEFORE, None)
        bad = [f"{c[0]} off by {e:+.1%}" for c, e in zip(MEASURED, errs) if abs(e) > args.tolerance]
        if ratio < MIN_RATIO:
            bad.append(f"C4 / DP4 predicted {ratio:.3f} (< {MIN_RATIO}), the paper measured "
                       f"{MEASURED[1][4] / MEASURED[0][4]:.3f}")
        for b in bad:
            print("FAIL: " + b)
        print("ok" if not bad else "calibration check failed")
        return 1 if bad else 0
    fits = [fit(model, s) for s in (BEFORE, {"H800": 0.5, "H20": 0.8, "inter": 50.0})]
    params, loss = min(fits, key=lambda f: f[1])
    print(f"fitted: H800 efficiency {params['H800']:.2f}, H20 efficiency {params['H20']:.2f}, "
          f"inter_node_gbps {params['inter']:.0f} (before: {BEFORE['H800']}, {BEFORE['H20']}, "
          f"{BEFORE['inter']:.0f}); sum of squared log residuals {loss:.4f} "
          f"(before {sum(r * r for r in model.residuals(BEFORE)):.4f})\n")
    errs, _ = table(model, BEFORE, params)
    print(f"\nlargest error on a measured step time: {max(abs(e) for e in errs):.1%}")
    if args.no_loo:
        return 0
    print("\nleave-one-out (refit without the observation, then predict it):")
    names = [c[0] for c in MEASURED] + [c[0] for c in BALANCED]
    for i, name in enumerate(names):
        p, _ = fit(model, params, skip=i)
        r = model.residuals(p)[i] * (SIGMA_STEP if i < len(MEASURED) else 0.5 / BALANCED[i - len(MEASURED)][4])
        print(f"  {name:44s} {math.exp(r) - 1:+7.1%}   (fit: {p['H800']:.2f} {p['H20']:.2f} {p['inter']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
