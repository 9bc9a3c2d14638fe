#!/usr/bin/env python3
"""Mixed lengths on the EMULATED cluster (docs/mixed_length.md): real tokens
per emulated second of

  fixed    the planner's best fixed strategy for sequences of L
           (`hspmd plan search --global-batch T/L --seq-len L`),
           trained with --pack-documents (Megatron-like: documents packed
           into windows of L)
  dynamic  token-budget steps of T tokens (--batch-tokens T --max-seq-len L)
           over the strategies of `hspmd plan search --lengths` (one per
           maximum-length bucket), chosen per step (--strategies)
  buckets  the HotSPa-like baseline (--bucket-switching: bucket by bucket
           inside each step, switching, gradients accumulated) on
           HOMOGENEOUS strategies, one per bucket, with SPMD's symmetric
           data parallelism (--dispatch symmetric: micro-batches packed to
           the bucket's maximum, each to the pipeline with the fewest
           tokens, blind to device speeds, as HotSPa runs): `plan search
           --lengths --homogeneous --dispatch symmetric` (every pipeline the
           same tp, cp, pp, each taking the bucket's maximum, on all ranks
           or on one device class; the best such layout per bucket under
           that dispatch, same buckets)
  buckets-cost  the same flow with HSPMD's cost-model dispatch (device
           speeds included) on `plan search --lengths --homogeneous`
           strategies scored under it: a baseline stronger than HotSPa,
           which keeps only the temporal (length) side of the comparison

side by side in one run, on 8 emulated ranks of two speeds (ranks 4-7 at
half speed) whose memory caps hold a piece of L only with TP or CP >= 2
(--cap-gib; `auto` computes one by that rule, below), under the model clock
(`--clock model`: emulated times from a profile of this machine made by the
run, deterministic for a given profile).

Documents (--docs):
  synthetic  heavy-tailed like the paper's corpus (90% of 8-48 tokens, 8% of
             48-160, 2% of 160-700, cut into pieces of L); the default
  code       the bundled code corpus (scripts/make_code_corpus.py, built into
             out/ or reused from there; docs/data.md "A heavy-tailed
             corpus"): its document lengths scaled to L (--scale), written
             in a seeded random order (whole permutations of the 509
             documents until the steps' tokens are covered), random token ids
             of the model's vocabulary, each document ended by the model's
             eos_token_id
--scale (code documents):
  paper      the paper-scale bench's rule (bench/mixed_length_paper.py): the
             corpus scaled so that its p97 is L/4, as the paper reports for
             its corpus (97% of sequences < 8K at 32K): n -> round(n * L /
             (4 * p97)), at least 1 (x0.0890 at 32K)
  context    the corpus taken as a 32K-context distribution: n -> round(n * L
             / 32768), at least 1 (11.2x longer documents than `paper`; the
             corpus is long-heavy at this scale, docs/data.md)

--cap-gib auto: from `hspmd plan cost` (memory of the cost model, one micro-
batch of s tokens): hi = one rank holding every layer at s = L; lo = the
largest of one rank at s = L/2, TP2 at s = L and CP2 at s = L; the cap is
(lo + hi) / 2, so a piece of L needs TP or CP >= 2 (or pipeline stages) and a
piece of L/2 fits a rank alone.

--svg writes the dynamic mode's per-step choice (the chosen strategy's
max_seq_len and the step's longest piece) as a plain SVG.

usage: bench/mixed_length_bench.py [--hspmd build/src/cli/hspmd] [--model M.json] [--docs synthetic|code]
           [--scale paper|context] [--max-seq-len 256] [--batch-tokens 2048] [--steps 12] [--buckets 3]
           [--cap-gib 0.011|auto] [--max-cp N] [--zero] [--profile P.json] [--profile-mbs 1,2,4,8]
           [--profile-repetitions 3] [--svg out.svg] [--json out.json] [--smoke]
"""
import argparse
import array
import collections
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = os.path.join(ROOT, "examples", "models", "llama-tiny-8l.json")
CORPUS = os.path.join(ROOT, "out", "code_corpus.bin")
CORPUS_EOS = 256  # scripts/make_code_corpus.py tokenizes with examples/tiny-llama/config.json
L_DEFAULT = 256
# --smoke's defaults: L != 256, so the tiny model takes the automatic cap (plan cost with the profile).
SMOKE = {"max_seq_len": 64, "batch_tokens": 128, "steps": 3, "buckets": 2, "profile_mbs": "1,2",
         "profile_repetitions": 1}
CLUSTER = {"catalog": {t: {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100, "inter_node_gbps": 25}
                       for t in ("fast", "slow")},
           "nodes": [{"type": "fast", "ranks": [0, 3]}, {"type": "slow", "ranks": [4, 7], "slowdown": 2.0}]}


def make_docs(path, n=400000, seed=5):
    """90% of documents 8-48 tokens, 8% 48-160, 2% 160-700 (cut into pieces of L)."""
    rng = random.Random(seed)
    toks = []
    while len(toks) < n:
        u = rng.random()
        k = rng.randint(8, 48) if u < 0.9 else rng.randint(48, 160) if u < 0.98 else rng.randint(160, 700)
        toks += [rng.randrange(1, 256) for _ in range(k - 1)] + [0]
    with open(path, "wb") as f:
        f.write(b"".join(struct.pack("<I", t) for t in toks))


def read_tokens(path):
    a = array.array("I")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    return a


def doc_lengths(tokens, eos):
    """Lengths of the documents of a token file, cut after each eos (a tail without one is a document)."""
    raw = tokens.tobytes() if sys.byteorder == "little" else None
    out, start = [], 0
    if raw is not None:  # fast path: search the eos as 4 little-endian bytes at aligned offsets
        pat = struct.pack("<I", eos)
        i = raw.find(pat)
        while i >= 0:
            if i % 4 == 0:
                out.append(i // 4 + 1 - start)
                start = i // 4 + 1
                i = raw.find(pat, i + 4)
            else:
                i = raw.find(pat, i + 1)
    else:
        for i, t in enumerate(tokens):
            if t == eos:
                out.append(i + 1 - start)
                start = i + 1
    if start < len(tokens):
        out.append(len(tokens) - start)
    return out


def p97(xs):
    s = sorted(xs)
    return s[max(0, -(-97 * len(s) // 100) - 1)]


def code_corpus(hs):
    """out/code_corpus.bin, built by scripts/make_code_corpus.py when absent."""
    if not os.path.exists(CORPUS):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_code_corpus.py"), "--hspmd", hs],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit("make_code_corpus.py failed:\n" + r.stderr[-2000:])
    return doc_lengths(read_tokens(CORPUS), CORPUS_EOS)


def write_code_docs(path, base, L, rule, vocab, eos, min_tokens, seed=7):
    """The corpus's documents scaled to L, whole seeded permutations until min_tokens; returns the factor."""
    factor = L / (4 * p97(base)) if rule == "paper" else L / 32768
    scaled = [max(1, round(n * factor)) for n in base]
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t != eos]
    toks = array.array("I")
    while len(toks) < min_tokens:
        order = list(range(len(scaled)))
        rng.shuffle(order)
        for i in order:
            n = scaled[i]
            toks.extend(rng.choices(ids, k=n - 1))
            toks.append(eos)
    if sys.byteorder != "little":
        toks.byteswap()
    with open(path, "wb") as f:
        toks.tofile(f)
    return factor


def pieces_of(lengths, L):
    out = []
    for n in lengths:
        out += [L] * (n // L) + ([n % L] if n % L else [])
    return out


def token_steps(pieces, T, steps):
    """The pieces of each step, as the trainer forms them (DistTrainer::step_pieces: next pieces while
    their total stays within T, at least one, wrapping)."""
    out, cursor, n = [], 0, len(pieces)
    for _ in range(steps):
        chosen, tok = [], 0
        for k in range(n):
            size = pieces[(cursor + k) % n]
            if chosen and tok + size > T:
                break
            chosen.append(size)
            tok += size
        out.append(chosen)
        cursor = (cursor + len(chosen)) % n
    return out


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit("failed: " + " ".join(cmd) + "\n" + r.stderr[-2000:])
    return r.stdout


def records(log):
    return [json.loads(l) for l in open(log)]


def throughput(log):
    steps = [s for s in records(log) if "loss" in s and s["step"] > 0]
    tokens = sum(s["tokens"] for s in steps)
    emulated = sum(s["emulated_step_time_s"] for s in steps)
    return tokens / emulated, statistics.median(s["emulated_step_time_s"] for s in steps), \
        statistics.median(s["tokens"] for s in steps)


def memory_gib(hs, model, cluster, profile, tmp, ranks, cp, s):
    """The cost model's largest rank memory for one pipeline of one stage (every layer) on `ranks` ranks.
    `hspmd plan cost` needs the profile: the cluster's device types are emulated on this CPU, and the
    planner refuses them without one (it has no silent roofline for emulated devices)."""
    layers = json.load(open(model))["num_hidden_layers"]
    st = {"pipelines": [{"micro_batch_size": 1, "micro_batches": 1,
                         "stages": [{"ranks": list(range(ranks)), "layers": [0, layers - 1],
                                     **({"cp": cp} if cp > 1 else {})}]}]}
    path = os.path.join(tmp, "mem_strategy.json")
    json.dump(st, open(path, "w"))
    j = json.loads(run([hs, "plan", "cost", "--model", model, "--cluster", cluster, "--strategy", path,
                        "--seq-len", str(s), "--profile", profile, "--json"]))
    return max(r["memory_gib"] for r in j["ranks"])


def auto_cap(hs, model, cluster, profile, tmp, L):
    hi = memory_gib(hs, model, cluster, profile, tmp, 1, 1, L)
    parts = {"1 rank, L/2": memory_gib(hs, model, cluster, profile, tmp, 1, 1, L // 2),
             "TP2, L": memory_gib(hs, model, cluster, profile, tmp, 2, 1, L),
             "CP2, L": memory_gib(hs, model, cluster, profile, tmp, 2, 2, L)}
    lo = max(parts.values())
    if lo >= hi:
        raise SystemExit(f"--cap-gib auto: no cap between {lo:.5f} and {hi:.5f} GiB")
    return (lo + hi) / 2, hi, parts


def describe(strategy):
    """'<= 512: ranks 0-1 tp1 cp2 | ranks 2-3 tp2; <= 128: ranks 4-4 tp1' per pipeline."""
    out = []
    for p in strategy["pipelines"]:
        stages = " | ".join(
            f"ranks {min(s['ranks'])}-{max(s['ranks'])} tp{len(s['ranks']) // s.get('cp', 1)}"
            + (f" cp{s['cp']}" if s.get("cp", 1) > 1 else "") + (" rc" if s.get("recompute") else "")
            for s in p["stages"])
        out.append((f"<= {p['max_seq_len']}: " if "max_seq_len" in p else "") + stages)
    return "; ".join(out)


def svg_choice(path, steps, picks, strat_len, longest, title):
    """Per step: the chosen strategy's max_seq_len (bar) and the step's longest piece (dot)."""
    W, H, left, right, top, bottom = 720, 320, 64, 150, 34, 46
    n = len(steps)
    hi = max(max(strat_len), max(longest)) * 1.08
    x = lambda i: left + (W - left - right) * (i + 0.5) / n  # noqa: E731
    y = lambda v: top + (H - top - bottom) * (1 - v / hi)  # noqa: E731
    colors = ["#4a90d9", "#d9534f", "#5cb85c", "#f0ad4e", "#9b59b6", "#7f8c8d"]
    bw = max(2.0, (W - left - right) / n * 0.6)
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
         f'font-size="11">', f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{left}" y="18" font-size="12">{title}</text>',
         f'<line x1="{left}" y1="{top}" x2="{left}" y2="{H - bottom}" stroke="black"/>',
         f'<line x1="{left}" y1="{H - bottom}" x2="{W - right}" y2="{H - bottom}" stroke="black"/>']
    for k in range(5):
        v = hi / 1.08 * k / 4
        o.append(f'<line x1="{left - 4}" y1="{y(v):.1f}" x2="{W - right}" y2="{y(v):.1f}" stroke="#ddd"/>')
        o.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    o.append(f'<text x="14" y="{(top + H - bottom) / 2}" transform="rotate(-90 14 {(top + H - bottom) / 2})" '
             f'text-anchor="middle">tokens</text>')
    every = max(1, n // 12)
    for i, (s, p) in enumerate(zip(steps, picks)):
        c = colors[p % len(colors)]
        o.append(f'<rect x="{x(i) - bw / 2:.1f}" y="{y(strat_len[i]):.1f}" width="{bw:.1f}" '
                 f'height="{H - bottom - y(strat_len[i]):.1f}" fill="{c}" fill-opacity="0.35" stroke="{c}">'
                 f'<title>step {s}: strategy {p} (max_seq_len {strat_len[i]}), longest piece {longest[i]}'
                 f'</title></rect>')
        o.append(f'<circle cx="{x(i):.1f}" cy="{y(longest[i]):.1f}" r="3" fill="black"/>')
        if i % every == 0:
            o.append(f'<text x="{x(i):.1f}" y="{H - bottom + 14}" text-anchor="middle">{s}</text>')
    o.append(f'<text x="{(left + W - right) / 2}" y="{H - 10}" text-anchor="middle">step</text>')
    ly = top + 6
    for p in sorted(set(picks)):
        c = colors[p % len(colors)]
        ml = strat_len[picks.index(p)]
        o.append(f'<rect x="{W - right + 12}" y="{ly}" width="12" height="10" fill="{c}" fill-opacity="0.35" '
                 f'stroke="{c}"/><text x="{W - right + 30}" y="{ly + 9}">strategy {p} (&lt;= {ml})</text>')
        ly += 18
    o.append(f'<circle cx="{W - right + 18}" cy="{ly + 5}" r="3" fill="black"/>'
             f'<text x="{W - right + 30}" y="{ly + 9}">longest piece</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")


def main():  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build", "src", "cli", "hspmd"))
    ap.add_argument("--model", default=MODEL, help="config.json (default: the 8-layer tiny model)")
    ap.add_argument("--docs", choices=("synthetic", "code"), default="synthetic")
    ap.add_argument("--scale", choices=("paper", "context"), default="paper",
                    help="how code documents are scaled to L (see the module help)")
    ap.add_argument("--max-seq-len", type=int, default=L_DEFAULT, help="L (default 256)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--buckets", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="T (default 2048)")
    ap.add_argument("--cap-gib", default=None,
                    help="memory cap per rank in GiB, or 'auto' (default: 0.011 for the tiny model at L = 256, "
                         "which holds 128 tokens on one rank and 256 only with TP or CP >= 2; else auto)")
    ap.add_argument("--max-cp", type=int, default=None,
                    help="--max-cp for both plan searches (default: none, the planners' own defaults: 1 for the "
                         "fixed search, the node for --lengths; the profile measures cp 1 and 2)")
    ap.add_argument("--profile-mbs", default="1,2,4,8", help="micro-batch sizes the profile measures")
    ap.add_argument("--profile-repetitions", type=int, default=3, help="the profile's --repetitions")
    ap.add_argument("--profile", help="reuse this profile (made by `hspmd profile` with the flags this bench "
                                      "uses for the same model and L) instead of measuring one")
    ap.add_argument("--zero", action="store_true", help="ZeRO-1 in every mode (all plan searches get --zero)")
    ap.add_argument("--svg", help="write the dynamic mode's per-step choice here")
    ap.add_argument("--json", help="write the figures as JSON here")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (L 64, T 128, 3 steps, 2 buckets, a one-repetition profile of micro-batch "
                         "sizes 1 and 2; flags given explicitly win), every mode and the automatic cap: the same "
                         "calls, checked to give figures (the CTest bench_smoke_mixed_length_bench)")
    a = ap.parse_args()
    if a.smoke:
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    T, L, hs = a.batch_tokens, a.max_seq_len, a.hspmd
    model = os.path.abspath(a.model)
    cfg = json.load(open(model))
    if a.cap_gib is None:
        a.cap_gib = "0.011" if (model == MODEL and L == L_DEFAULT) else "auto"
    if T < L:
        raise SystemExit("--batch-tokens must be at least --max-seq-len")
    if a.docs == "synthetic" and (cfg.get("eos_token_id", 0) != 0 or cfg["vocab_size"] < 256):
        raise SystemExit("--docs synthetic writes ids 1..255 and eos 0: the model needs eos_token_id 0 "
                         "and a vocabulary of at least 256")
    with tempfile.TemporaryDirectory() as tmp:
        p = lambda name: os.path.join(tmp, name)  # noqa: E731
        wall0 = time.perf_counter()
        if a.docs == "code":
            base = code_corpus(hs)
            factor = write_code_docs(p("docs.bin"), base, L, a.scale, cfg["vocab_size"], cfg["eos_token_id"],
                                     (a.steps + 1) * T)
            docs_desc = (f"code corpus ({len(base)} documents) scaled x{factor:.5f} "
                         f"({'p97 -> L/4' if a.scale == 'paper' else 'n * L / 32768'}), at least 1 token")
        else:
            make_docs(p("docs.bin"))
            docs_desc = "synthetic (90% 8-48, 8% 48-160, 2% 160-700 tokens)"
        eos = cfg.get("eos_token_id", 0)
        lengths = doc_lengths(read_tokens(p("docs.bin")), eos)
        pieces = pieces_of(lengths, L)
        plan_steps = token_steps(pieces, T, a.steps)
        longest = [max(s) for s in plan_steps]
        # The profile first: the automatic cap's `plan cost` calls need it as much as the plan searches.
        seq_lens = sorted({max(8, L // 8), max(8, L // 4), max(8, L // 2), L})
        t0 = time.perf_counter()
        if a.profile:
            shutil.copyfile(a.profile, p("profile.json"))
        else:
            run([hs, "profile", "--model", model, "--tp", "1,2,4", "--cp", "1,2", "--seq-lens",
                 ",".join(map(str, seq_lens)), "--micro-batch-sizes", a.profile_mbs, "--repetitions",
                 str(a.profile_repetitions), "-o", p("profile.json")])
        profile_s = time.perf_counter() - t0
        cluster = json.loads(json.dumps(CLUSTER))
        json.dump(cluster, open(p("cluster_nocap.json"), "w"))
        cap_note = ""
        if a.cap_gib == "auto":
            cap, hi, parts = auto_cap(hs, model, p("cluster_nocap.json"), p("profile.json"), tmp, L)
            cap_note = (f"auto cap {cap:.5f} GiB: 1 rank at L {hi:.5f}; " +
                        ", ".join(f"{k} {v:.5f}" for k, v in parts.items()))
        else:
            cap = float(a.cap_gib)
        if cap > 0:
            for node in cluster["nodes"]:
                node["memory_cap_gib"] = cap
        json.dump(cluster, open(p("cluster.json"), "w"))
        max_cp = ["--max-cp", str(a.max_cp)] if a.max_cp else []
        common = ["--model", model, "--cluster", p("cluster.json"), "--profile", p("profile.json")]
        zero = ["--zero"] if a.zero else []
        # fixed: the planner's best strategy for windows of L, documents packed
        t0 = time.perf_counter()
        fixed = json.loads(run([hs, "plan", "search"] + common + ["--global-batch", str(T // L), "--seq-len", str(L),
                                                                 "-o", p("fixed.json"), "--json"] + max_cp + zero))
        fixed_plan_s = time.perf_counter() - t0
        # dynamic: one strategy per bucket from the length statistics
        os.mkdir(p("buckets"))
        os.mkdir(p("homogeneous"))
        os.mkdir(p("homogeneous-cost"))
        t0 = time.perf_counter()
        dyn = json.loads(run([hs, "plan", "search"] + common + ["--lengths", p("docs.bin"), "--batch-tokens", str(T),
                                                               "--max-seq-len", str(L), "--strategies-out", p("buckets"),
                                                               "--buckets", str(a.buckets), "--json"] + max_cp + zero))
        dyn_plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        homog = json.loads(run([hs, "plan", "search"] + common + ["--lengths", p("docs.bin"), "--batch-tokens", str(T),
                                                                 "--max-seq-len", str(L), "--strategies-out",
                                                                 p("homogeneous"), "--buckets", str(a.buckets),
                                                                 "--homogeneous", "--dispatch", "symmetric",
                                                                 "--json"] + max_cp + zero))
        homog_plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        json.loads(run([hs, "plan", "search"] + common + ["--lengths", p("docs.bin"), "--batch-tokens", str(T),
                                                          "--max-seq-len", str(L), "--strategies-out",
                                                          p("homogeneous-cost"), "--buckets", str(a.buckets),
                                                          "--homogeneous", "--json"] + max_cp + zero))
        homog_cost_plan_s = time.perf_counter() - t0

        def bucket_files(d):
            return sorted((os.path.join(d, f) for f in os.listdir(d)), key=lambda f: int(f.split("_")[-1][:-5]))
        buckets = bucket_files(p("buckets"))
        homog_files = bucket_files(p("homogeneous"))
        homog_cost_files = bucket_files(p("homogeneous-cost"))
        strategies = [json.load(open(b)) for b in buckets]
        homog_strategies = [json.load(open(b)) for b in homog_files]
        homog_cost_strategies = [json.load(open(b)) for b in homog_cost_files]
        train = [hs, "train", "--data", p("docs.bin"), "--steps", str(a.steps), "--nproc", "8", "--threads", "1",
                 "--quiet", "--clock", "model"] + common
        walls = {}
        t0 = time.perf_counter()
        run(train + ["--strategy", p("fixed.json"), "--pack-documents", "--seq-len", str(L), "--global-batch",
                     str(T // L), "--log", p("fixed.jsonl")])
        walls["fixed"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        run(train + ["--strategies", ",".join(buckets), "--batch-tokens", str(T), "--max-seq-len", str(L),
                     "--log", p("dynamic.jsonl")])
        walls["dynamic"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        run(train + ["--strategies", ",".join(homog_files), "--batch-tokens", str(T), "--max-seq-len", str(L),
                     "--bucket-switching", "--dispatch", "symmetric", "--log", p("buckets.jsonl")])
        walls["buckets"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        run(train + ["--strategies", ",".join(homog_cost_files), "--batch-tokens", str(T), "--max-seq-len", str(L),
                     "--bucket-switching", "--log", p("buckets-cost.jsonl")])
        walls["buckets-cost"] = time.perf_counter() - t0
        modes = ("fixed", "dynamic", "buckets", "buckets-cost")
        res = {m: throughput(p(f"{m}.jsonl")) for m in modes}
        dyn_recs = [r for r in records(p("dynamic.jsonl")) if "loss" in r]
        picks = [r.get("strategy", 0) for r in dyn_recs]
        if [r["pieces"] for r in dyn_recs] != [len(s) for s in plan_steps]:
            print("note: the bench's replica of the steps' pieces differs from the trainer's records", file=sys.stderr)
        switches = {m: sum(1 for r in records(p(f"{m}.jsonl")) if r.get("event") == "switch")
                    for m in ("dynamic", "buckets", "buckets-cost")}
        strat_len = [strategies[k].get("max_seq_len", L) for k in picks]
        if a.svg:
            name = os.path.basename(model).replace(".json", "")
            svg_choice(a.svg, [r["step"] for r in dyn_recs], picks, strat_len, longest,
                       f"dynamic mode, {name}, {a.docs} documents, L {L}, T {T}: chosen strategy per step")
        bucket_steps = {b["max_seq_len"]: b.get("steps") for b in dyn.get("buckets", [])}
        print(f"{os.path.basename(model)}, {docs_desc}; L {L}, T {T} tokens per step, 8 emulated ranks "
              f"(4 at half speed), cap {cap:.5f} GiB, {a.steps} steps (the first left out), model clock"
              + (", ZeRO-1" if a.zero else ""))
        if cap_note:
            print(cap_note)
        print(f"pieces of the first {a.steps} steps: median {statistics.median(len(s) for s in plan_steps):.0f} "
              f"per step, longest per step {longest}")
        print(f"profile {profile_s:.1f} s; train wall: " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()) +
              f"; whole bench {time.perf_counter() - wall0:.1f} s")
        print(f"fixed strategy: {describe(json.load(open(p('fixed.json'))))} "
              f"(micro-batch size {json.load(open(p('fixed.json')))['pipelines'][0].get('micro_batch_size')})")
        for i, (b, s) in enumerate(zip(buckets, strategies)):
            ml = s.get("max_seq_len", L)
            print(f"strategy {i} (max_seq_len {ml}, {bucket_steps.get(ml, '?')} planner steps, "
                  f"picked {picks.count(i)}x): {describe(s)}")
        for i, (b, s) in enumerate(zip(homog_files, homog_strategies)):
            print(f"homogeneous {i} (max_seq_len {s.get('max_seq_len', L)}): {describe(s)}")
        for i, (b, s) in enumerate(zip(homog_cost_files, homog_cost_strategies)):
            print(f"homogeneous-cost {i} (max_seq_len {s.get('max_seq_len', L)}): {describe(s)}")
        print(f"per-step choice {picks}; switch events: dynamic {switches['dynamic']}, buckets {switches['buckets']}, "
              f"buckets-cost {switches['buckets-cost']}")
        print(f"{'mode':12s} {'tokens/emulated s':>18s} {'median step s':>14s} {'median tokens':>14s} {'plan s':>7s}")
        for m, ps in (("fixed", fixed_plan_s), ("dynamic", dyn_plan_s), ("buckets", homog_plan_s),
                      ("buckets-cost", homog_cost_plan_s)):
            tps, st, tok = res[m]
            print(f"{m:12s} {tps:18.0f} {st:14.5f} {tok:14.0f} {ps:7.2f}")
        d, f, b, bc = res["dynamic"][0], res["fixed"][0], res["buckets"][0], res["buckets-cost"][0]
        print(f"dynamic / fixed: {d / f:.2f}x; dynamic / buckets: {d / b:.2f}x; dynamic / buckets-cost: {d / bc:.2f}x")
        bad = [m for m in modes if not (res[m][0] > 0 and res[m][0] < float("inf"))]
        if bad:
            raise SystemExit(f"no throughput for {', '.join(bad)}")
        if a.json:
            json.dump({"model": os.path.basename(model), "docs": a.docs, "scale": a.scale if a.docs == "code" else None,
                       "L": L, "T": T, "steps": a.steps, "cap_gib": cap, "cap_note": cap_note,
                       "modes": {m: {"tokens_per_emulated_s": v[0], "median_step_s": v[1], "median_tokens": v[2]}
                                 for m, v in res.items()},
                       "dynamic_over_fixed": d / f, "dynamic_over_buckets": d / b,
                       "dynamic_over_buckets_cost": d / bc, "zero": a.zero, "picks": picks,
                       "homogeneous_strategies": [describe(s) for s in homog_strategies],
                       "homogeneous_cost_strategies": [describe(s) for s in homog_cost_strategies],
                       "longest": longest, "strategies": [describe(s) for s in strategies],
                       "strategy_max_seq_len": [s.get("max_seq_len", L) for s in strategies],
                       "fixed_strategy": describe(json.load(open(p("fixed.json")))),
                       "switches": switches, "walls_s": walls, "profile_s": profile_s},
                      open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
