"""Token-budget steps (`hspmd train --batch-tokens T --max-seq-len L`,
docs/mixed_length.md) train the same model as one process whatever the
strategy dispatches: heavy-tailed documents are cut into pieces of at most
L tokens, each step takes the next pieces within T tokens, and the losses
(1e-5 relative per step) and final weights (1e-4) of pipelines that accept
different lengths — a context-parallel pipeline for the longest pieces,
ZeRO-1, a plan switch between two such strategies, and --strategies, which
picks the favoured strategy per step — equal the single-process run's. Also the step records' fields and the one-line errors
for a piece no pipeline accepts, a pipeline max_seq_len above its
strategy's, and a budget smaller than a piece."""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from equivalence_test import MODEL, read_safetensors, records  # noqa: E402
from switch_test import max_weight_error  # noqa: E402

L, T, STEPS = 32, 96, 6


def pipe(stages, max_seq_len=None, tokens=None):
    p = {"stages": [{"ranks": r, "layers": l, **({"cp": c} if c > 1 else {})} for r, l, c in stages]}
    if max_seq_len:
        p["max_seq_len"] = max_seq_len
    if tokens:
        p["micro_batch_tokens"] = tokens
    return p


# name -> (world, strategy); every strategy takes pieces of up to L tokens.
CASES = {
    # The longest pieces only on a CP2 x TP1 pipeline, short ones on two
    # small pipelines of one rank each (micro-batches of up to 2 pieces).
    "cp_long_short": (4, {"pipelines": [pipe([([0, 1], [0, 3], 2)], max_seq_len=L),
                                        pipe([([2], [0, 3], 1)], max_seq_len=12, tokens=24),
                                        pipe([([3], [0, 3], 1)], max_seq_len=12, tokens=24)]}),
    # TP2 x PP2 beside a PP2 pipeline, ZeRO-1 across them.
    "hetero_zero": (6, {"zero": True, "max_seq_len": L, "pipelines": [
        pipe([([0, 1], [0, 1], 1), ([2, 3], [2, 3], 1)]),
        pipe([([4], [0, 2], 1), ([5], [3, 3], 1)], max_seq_len=16)]}),
}


def make_docs(path, seed=11, n=12000):
    """Heavy-tailed documents (ids 1..63), each ending in eos 0."""
    rng = random.Random(seed)
    toks = []
    while len(toks) < n:
        k = min(200, int(rng.paretovariate(1.1) * 3))
        toks += [rng.randrange(1, 64) for _ in range(k)] + [0]
    with open(path, "wb") as f:
        f.write(b"".join(struct.pack("<I", t) for t in toks))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    a = ap.parse_args()
    failures = []

    def check(label, ok, detail):
        print(f"{label:32s} {detail} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(label)

    with tempfile.TemporaryDirectory() as tmp:
        model, data = os.path.join(tmp, "model.json"), os.path.join(tmp, "docs.bin")
        json.dump(MODEL, open(model, "w"))
        make_docs(data)
        base = [a.hspmd, "train", "--model", model, "--data", data, "--steps", str(STEPS), "--lr", "3e-3",
                "--eps", "1e-5", "--weight-decay", "0.1", "--clip-grad", "0.5", "--threads", "1", "--quiet",
                "--batch-tokens", str(T), "--max-seq-len", str(L)]

        def train(name, extra):
            log, weights = os.path.join(tmp, name + ".jsonl"), os.path.join(tmp, name + ".safetensors")
            r = subprocess.run(base + ["--log", log, "--save", weights] + extra, capture_output=True, text=True,
                               timeout=300)
            if r.returncode:
                return r.returncode, r.stderr, [], {}
            return 0, r.stderr, records(log), read_safetensors(weights)

        def strategy_file(name, s):
            p = os.path.join(tmp, name + ".strategy.json")
            json.dump(s, open(p, "w"))
            return p

        rc, err, want, want_w = train("single", [])
        if rc:
            sys.exit("single-process run failed: " + err)
        steps = [r for r in want if "loss" in r]
        check("single process", len(steps) == STEPS and all(
            r["tokens"] <= T and r["pieces"] >= 1 and r["pipeline_tokens"] == [r["tokens"]] for r in steps),
            f"pieces per step {[r['pieces'] for r in steps]}, tokens {[r['tokens'] for r in steps]}")

        def compare(label, got, got_w, switches=0):
            s = [r for r in got if "loss" in r]
            rel = max((abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(steps, s)), default=float("inf"))
            werr = max_weight_error(want_w, got_w)
            same_pieces = all(x["pieces"] == y["pieces"] and x["tokens"] == y["tokens"] for x, y in zip(steps, s))
            sums = all(sum(y["pipeline_tokens"]) == y["tokens"] and y["dispatch_s"] >= 0 for y in s)
            n_sw = len([r for r in got if r.get("event") == "switch"])
            check(label, len(s) == STEPS and rel <= 1e-5 and werr <= 1e-4 and same_pieces and sums and
                  n_sw == switches,
                  f"loss rel err {rel:.2e}, weights err {werr:.2e}, pipeline tokens "
                  f"{[y['pipeline_tokens'] for y in s[:3]]}")
            return s

        for name, (world, strategy) in CASES.items():
            rc, err, got, got_w = train(name, ["--strategy", strategy_file(name, strategy), "--nproc", str(world)])
            if rc:
                check(name, False, f"exit {rc}: {err.strip()[-400:]}")
                continue
            s = compare(name, got, got_w)
            if name == "cp_long_short":
                # Some step leaves a pipeline without a piece: its zero
                # gradients take part in the sync (and the losses still hold).
                check("cp_long_short: an empty pipeline", all(len(y["pipeline_tokens"]) == 3 for y in s) and
                      any(0 in y["pipeline_tokens"] for y in s), f"{[y['pipeline_tokens'] for y in s]}")

        # A switch between the two strategies at step 3 (6 ranks: the
        # 4-rank one leaves ranks 4 and 5 idle).
        rc, err, got, got_w = train("switch", ["--strategy", strategy_file("sw_a", CASES["cp_long_short"][1]),
                                               "--switch", "3:" + strategy_file("sw_b", CASES["hetero_zero"][1]),
                                               "--nproc", "6"])
        if rc:
            check("switch", False, f"exit {rc}: {err.strip()[-400:]}")
        else:
            compare("switch between token strategies", got, got_w, switches=1)

        # --strategies: per step the favoured strategy; one for short pieces
        # only (four ranks of one stage each), one with the CP pair for
        # the longest. Steps whose pieces are all short may use the first,
        # the others must use the second; both get used.
        short_only = {"max_seq_len": 16, "pipelines": [pipe([([r], [0, 3], 1)]) for r in range(4)]}
        rc, err, got, got_w = train("choose", ["--strategies", strategy_file("choose_a", short_only) + "," +
                                               strategy_file("choose_b", CASES["cp_long_short"][1]),
                                               "--nproc", "4"])
        if rc:
            check("strategies per step", False, f"exit {rc}: {err.strip()[-400:]}")
        else:
            s = [r for r in got if "loss" in r]
            n_sw = len([r for r in got if r.get("event") == "switch"])
            compare("strategies per step", got, got_w, switches=n_sw)
            picks = [r["strategy"] for r in s]
            check("strategies per step: both used", set(picks) == {0, 1} and n_sw >= 1, f"per step {picks}")

        # --bucket-switching (the HotSPa-like baseline): the same two
        # strategies, bucket by bucket inside a step; gradients add up across
        # the buckets' plans.
        rc, err, got, got_w = train("buckets", ["--strategies", strategy_file("choose_a", short_only) + "," +
                                                strategy_file("choose_b", CASES["cp_long_short"][1]),
                                                "--bucket-switching", "--nproc", "4"])
        if rc:
            check("bucket switching", False, f"exit {rc}: {err.strip()[-400:]}")
        else:
            s = [r for r in got if "loss" in r]
            n_sw = len([r for r in got if r.get("event") == "switch"])
            compare("bucket switching", got, got_w, switches=n_sw)
            both = [r for r in s if len(r["pipeline_tokens"]) == 4 + 3]  # a step of both buckets
            check("bucket switching: inside a step", bool(both) and n_sw >= 2,
                  f"{len(both)} steps with both buckets, {n_sw} switches")

        # Bad input: one line, non-zero, before the first step.
        short = {"pipelines": [pipe([([0], [0, 3], 1)], max_seq_len=8), pipe([([1], [0, 3], 1)], max_seq_len=16)]}
        above = {"max_seq_len": 16, "pipelines": [pipe([([0], [0, 3], 1)], max_seq_len=L)]}
        bad = {
            "no pipeline accepts the piece": (["--strategy", strategy_file("short", short), "--nproc", "2"],
                                              "no pipeline of the strategy accepts more than 16"),
            "pipeline above the strategy": (["--strategy", strategy_file("above", above), "--nproc", "1"],
                                            "above the strategy's max_seq_len=16"),
        }
        for what, (extra, want_err) in bad.items():
            rc, err, *_ = train("bad", extra)
            lines = [l for l in err.splitlines() if l.strip()]
            check(what, rc != 0 and len(lines) == 1 and want_err in err, lines[0][:160] if lines else "")
        r = subprocess.run([a.hspmd, "train", "--model", model, "--data", data, "--steps", "2", "--batch-tokens", "8",
                            "--max-seq-len", str(L), "--quiet"], capture_output=True, text=True)
        check("budget below a piece", r.returncode != 0 and "--batch-tokens 8 is smaller than the longest piece" in
              r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr.strip()[:160])
    if failures:
        sys.exit(f"{len(failures)} failure(s): {failures}")
    print("all mixed-length cases passed")


if __name__ == "__main__":
    main()
