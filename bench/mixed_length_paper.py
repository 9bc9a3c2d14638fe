"""Mixed lengths at the paper's scale, dry run (docs/benchmarks.md "Mixed
lengths at the paper's scale"): the 32B model on 32 H20, contexts 32K and
16K, steps of 200K tokens, predicted per-step times over 100 steps for

  (a) `hspmd plan search --lengths` strategies, one per bucket, chosen per
      step as `hspmd train --strategies` chooses (the lowest prediction
      among those accepting the step's longest piece; switch time left out);
  (b) one fixed strategy for the longest pieces with packing (Megatron-like,
      the paper's appendix table: DP2TP8CP2 at 32K, TP8PP4 at 16K, bs1,
      ZeRO-1): the step's pieces packed next-fit into rows of L, each row
      costed as a sequence of L tokens;
  (c) bucket switching (HotSPa-like, the paper's table): per length interval
      a homogeneous strategy, the step's pieces of each interval packed into
      rows of the interval's top, the intervals run in turn; one gradient
      sync per step; switch time left out.

Document lengths: the code corpus (out/code_corpus.bin, docs/data.md "A
heavy-tailed corpus") scaled so that its p97 is L/4 (the paper: 97% of
sequences < 8K at 32K), sampled with a fixed seed; a Pareto distribution
with the same p97 when the corpus is absent. Writes docs/mixed_length_paper.svg
and prints the markdown section.

usage: bench/mixed_length_paper.py [--hspmd build/src/cli/hspmd] [--svg docs/mixed_length_paper.svg] [--smoke]"""
import argparse
import array
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from mixed_length_bench import doc_lengths, p97, read_tokens  # noqa: E402  (the same directory)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "examples", "models", "llama-32b.json")
CLUSTER = os.path.join(REPO, "examples", "clusters", "32h20.json")
T, STEPS, EOS = 200_000, 100, 50256
SMOKE_STEPS = 5


def corpus_lengths():
    path = os.path.join(REPO, "out", "code_corpus.bin")
    if not os.path.exists(path):
        return None
    return doc_lengths(read_tokens(path), 256)


def write_docs(path, base, L, seed):
    """Documents sampled from `base` scaled to p97 = L/4, about STEPS x T tokens."""
    rng = random.Random(seed)
    scale = (L / 4) / p97(base)
    toks = array.array("I")
    while len(toks) < STEPS * T + T:
        n = max(2, round(rng.choice(base) * scale))
        toks.extend([1] * (n - 1))
        toks.append(EOS)
    with open(path, "wb") as f:
        toks.tofile(f)
    return scale


def pieces_of(path, L):
    a = array.array("I")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    out, start = [], 0
    for i, t in enumerate(a):
        if t == EOS:
            n = i + 1 - start
            out += [L] * (n // L) + ([n % L] if n % L else [])
            start = i + 1
    return out


def steps_of(pieces):
    steps, cur, tok = [], [], 0
    for p in pieces:
        if cur and tok + p > T:
            steps.append(cur)
            cur, tok = [], 0
        cur.append(p)
        tok += p
    return steps[:STEPS]


def rows(pieces, width):
    """Next-fit packing into rows of `width` tokens."""
    n, used = 0, width
    for p in pieces:
        if used + p > width:
            n, used = n + 1, 0
        used += p
    return n


def sym(tp, cp, pp, dp, L_layers=60):
    pipes, r = [], 0
    per = L_layers // pp
    for _ in range(dp):
        stages = []
        for k in range(pp):
            stages.append({"ranks": list(range(r, r + tp * cp)), "layers": [k * per, k * per + per - 1],
                           **({"cp": cp} if cp > 1 else {})})
            r += tp * cp
        pipes.append({"micro_batch_size": 1, "micro_batches": 1, "stages": stages})
    return {"zero": True, "pipelines": pipes}


class Coster:
    """plan cost of a homogeneous strategy at R rows of s tokens (cached)."""

    def __init__(self, hs, tmp):
        self.hs, self.tmp, self.cache = hs, tmp, {}

    def __call__(self, name, strategy, R, s):
        key = (name, R, s)
        if key not in self.cache:
            st = json.loads(json.dumps(strategy))
            P = len(st["pipelines"])
            for i, p in enumerate(st["pipelines"]):
                p["micro_batches"] = max(1, R // P + (1 if i < R % P else 0))
            path = os.path.join(self.tmp, "cost.json")
            json.dump(st, open(path, "w"))
            r = subprocess.run([self.hs, "plan", "cost", "--model", MODEL, "--cluster", CLUSTER, "--strategy", path,
                                "--seq-len", str(s), "--json"], capture_output=True, text=True, check=True)
            j = json.loads(r.stdout)
            over = any(x["memory_gib"] > x["capacity_gib"] > 0 for x in j["ranks"])
            self.cache[key] = (j["predicted_step_s"], max(j["pipeline_s"]), over)
        return self.cache[key]


BASELINES = {
    32768: {"fixed": ("DP2TP8CP2", sym(8, 2, 1, 2)),
            "buckets": [(16384, 32768, "DP2TP16", sym(16, 1, 1, 2)), (4096, 16384, "DP2TP8PP2", sym(8, 1, 2, 2)),
                        (0, 4096, "DP4TP4PP2", sym(4, 1, 2, 4))]},
    16384: {"fixed": ("TP8PP4", sym(8, 1, 4, 1)),
            "buckets": [(4096, 16384, "DP2TP8PP2", sym(8, 1, 2, 2)), (0, 4096, "DP4TP4PP2", sym(4, 1, 2, 4))]},
}


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def svg(results, path):
    """Box plots (whiskers min..max) per context and regime."""
    W, H, left, top, bottom = 640, 300, 60, 20, 50
    hi = max(max(v) for r in results.values() for v in r.values()) * 1.05
    y = lambda v: top + (H - top - bottom) * (1 - v / hi)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{H - bottom}" stroke="black"/>']
    for k in range(6):
        v = hi * k / 5
        out.append(f'<text x="{left - 5}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    out.append(f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">predicted step (s)</text>')
    colors = {"(a)": "#4a90d9", "(b)": "#d9534f", "(c)": "#5cb85c"}
    x = left + 20
    for ctx, r in results.items():
        for name, v in r.items():
            q1, med, q3 = quartiles(v)
            c = colors[name[:3]]
            out.append(f'<line x1="{x + 15}" y1="{y(min(v)):.1f}" x2="{x + 15}" y2="{y(max(v)):.1f}" stroke="{c}"/>')
            out.append(f'<rect x="{x}" y="{y(q3):.1f}" width="30" height="{max(1, y(q1) - y(q3)):.1f}" '
                       f'fill="{c}" fill-opacity="0.4" stroke="{c}"/>')
            out.append(f'<line x1="{x}" y1="{y(med):.1f}" x2="{x + 30}" y2="{y(med):.1f}" stroke="black"/>')
            out.append(f'<text x="{x + 15}" y="{H - bottom + 15}" text-anchor="middle">{name[:3]}</text>')
            x += 45
        out.append(f'<text x="{x - 80}" y="{H - bottom + 32}" text-anchor="middle">{ctx // 1024}K</text>')
        x += 40
    out.append(f'<text x="{left + 10}" y="{H - 5}">(a) planned per-bucket strategies, (b) fixed with packing, '
               f'(c) bucket switching</text></svg>')
    open(path, "w").write("\n".join(out) + "\n")


def main():
    global STEPS
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(REPO, "build", "src", "cli", "hspmd"))
    ap.add_argument("--svg", default=None, help="the figure (default docs/mixed_length_paper.svg; --smoke: none)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"{SMOKE_STEPS} steps per context instead of {STEPS}: the same plan search, costs and "
                         "figure (written only with --svg), checked to give every regime a time (the CTest "
                         "bench_smoke_mixed_length_paper)")
    a = ap.parse_args()
    if a.smoke:
        STEPS = SMOKE_STEPS
    svg_path = a.svg or (None if a.smoke else os.path.join(REPO, "docs", "mixed_length_paper.svg"))
    base = corpus_lengths()
    source = "code corpus" if base else "Pareto(1.1)"
    if not base:
        rng = random.Random(1)
        base = [int(rng.paretovariate(1.1) * 1000) for _ in range(5000)]
    results, lines = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        cost = Coster(a.hspmd, tmp)
        for L in (32768, 16384):
            data = os.path.join(tmp, f"docs{L}.bin")
            scale = write_docs(data, base, L, seed=L)
            out = os.path.join(tmp, f"s{L}")
            os.mkdir(out)
            t0 = time.perf_counter()
            r = subprocess.run([a.hspmd, "plan", "search", "--model", MODEL, "--cluster", CLUSTER, "--lengths", data,
                                "--batch-tokens", str(T), "--max-seq-len", str(L), "--zero", "--strategies-out", out,
                                "--json"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if r.returncode:
                sys.exit(r.stderr)
            plan = json.loads(r.stdout)
            steps = steps_of(pieces_of(data, L))
            preds = plan["step_predictions"][:STEPS]
            a_s = [min(x for x in p["bucket_s"] if x >= 0) for p in preds]
            fname, fixed = BASELINES[L]["fixed"]
            b_s, over = [], set()
            for st in steps:
                step, _, o = cost(fname, fixed, rows(st, L), L)
                b_s.append(step)
                over |= {fname} if o else set()
            c_s = []
            for st in steps:
                total, sync = 0.0, 0.0
                for lo, hi, name, strat in BASELINES[L]["buckets"]:
                    mine = [p for p in st if lo < p <= hi]
                    if not mine:
                        continue
                    step, pipes, o = cost(name, strat, rows(mine, hi), hi)
                    total += pipes
                    sync = step - pipes
                    over |= {name} if o else set()
                c_s.append(total + sync)
            results[L] = {"(a) planned": a_s, "(b) fixed": b_s, "(c) buckets": c_s}
            lines.append(f"### {L // 1024}K context (lengths scaled x{scale:.4f}, {len(steps)} steps)\n")
            lines.append(f"Planning: {plan['planning_s']:.2f} s inside the planner, {wall:.2f} s wall for the command "
                         f"({plan['pieces']} pieces, {plan['steps']} steps read).\n")
            for b in plan["buckets"]:
                pipes = [f"<= {p['max_seq_len']}: " + " | ".join(
                    f"{len(s['ranks'])}r" + (f" cp{s['cp']}" if s.get('cp', 1) > 1 else "") +
                    (" rc" if s.get("recompute") else "") for s in p["stages"]) for p in b["strategy"]["pipelines"]]
                lines.append(f"* bucket <= {b['max_seq_len']} ({b['steps']} steps, median predicted "
                             f"{b['predicted_step_s']:.2f} s): " + "; ".join(pipes))
            lines.append("")
            lines.append("| regime | p25 (s) | median (s) | p75 (s) | mean (s) |")
            lines.append("|---|---:|---:|---:|---:|")
            for name, v in results[L].items():
                q1, med, q3 = quartiles(v)
                lines.append(f"| {name} | {q1:.2f} | {med:.2f} | {q3:.2f} | {statistics.mean(v):.2f} |")
            if over:
                lines.append(f"\nOver the memory of the cost model: {sorted(over)}.")
            lines.append("")
    if svg_path:
        svg(results, svg_path)
    print(f"Document lengths from the {source}.\n")
    print("\n".join(lines))
    bad = [f"{L} {name}" for L, r in results.items() for name, v in r.items()
           if len(v) < min(STEPS, 2) or not all(x > 0 for x in v)]
    if bad:
        sys.exit(f"no predicted step times for {bad}")


if __name__ == "__main__":
    main()
