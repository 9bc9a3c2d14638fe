#!/usr/bin/env python3
"""Flag ranges and combinations (docs/training.md, docs/reliability.md): each
case must exit non-zero with one stderr line that names the flag, quickly (a
FIFO given as input must not block), and write nothing.

usage: flags_test.py --hspmd PATH
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

CONFIG = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 64, "eos_token_id": 256}
STRATEGY = {"pipelines": [{"micro_batch_size": 2, "micro_batches": 1, "stages": [{"ranks": [0], "layers": [0, 0]}]}]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    exe = ap.parse_args().hspmd
    tmp = tempfile.mkdtemp()
    p = lambda n: os.path.join(tmp, n)  # noqa: E731
    json.dump(CONFIG, open(p("cfg.json"), "w"))
    json.dump(STRATEGY, open(p("s.json"), "w"))
    json.dump({"pipelines": [{"micro_batch_size": 4, "micro_batches": 1, "stages": [{"ranks": [0], "layers": [0, 0]}]}]},
              open(p("s4.json"), "w"))
    json.dump({"pipelines": [{"micro_batch_size": 2, "micro_batches": 1, "stages": [{"ranks": [0, 1], "layers": [0, 0]}]}]},
              open(p("s2r.json"), "w"))
    with open(p("data.bin"), "wb") as f:
        f.write(struct.pack("<200I", *([5] * 200)))
    with open(p("doc.txt"), "w") as f:
        f.write("hello")
    os.mkdir(p("adir"))
    os.mkfifo(p("fifo"))
    json.dump({"catalog": {"cpu": {"tflops": 1, "memory_gib": 16, "intra_node_gbps": 10, "inter_node_gbps": 1}},
               "nodes": [{"type": "cpu", "ranks": [0, 0]}]}, open(p("cluster.json"), "w"))
    json.dump({"catalog": {"cpu": {"tflops": 1, "memory_gib": 16, "intra_node_gbps": 10, "inter_node_gbps": 1}},
               "nodes": [{"type": "cpu", "ranks": [0, 0], "slowdown": 2.0}]}, open(p("emulated.json"), "w"))
    with open(p("long.bin"), "wb") as f:  # one document of 40 tokens: pieces of 32 and 8
        f.write(struct.pack("<41I", *([5] * 40 + [256])))

    base = ["train", "--model", p("cfg.json"), "--data", p("data.bin"), "--seq-len", "16",
            "--global-batch", "2", "--steps", "1", "--threads", "1", "--quiet"]
    dist = [a for a in base if a not in ("--global-batch", "2")] + ["--strategy", p("s.json")]

    def with_flag(args, flag, value):
        args = list(args)
        args[args.index(flag) + 1] = value
        return args

    plan = ["plan", "compile", "--model", p("cfg.json"), "--strategy", p("s.json"), "--world", "1", "-o", p("p.json")]
    cases = [
        ("beta1 = 1", base + ["--beta1", "1"], "--beta1"),
        ("beta2 < 0", base + ["--beta2", "-0.1"], "--beta2"),
        ("min-lr above lr", base + ["--lr", "0.01", "--min-lr", "0.1"], "--min-lr"),
        ("threads 100000", with_flag(base, "--threads", "100000"), "--threads"),
        ("nproc 0", dist + ["--nproc", "0"], "--nproc"),
        ("global-batch 0", with_flag(base, "--global-batch", "0"), "--global-batch"),
        ("tokenize eos beyond uint32", ["tokenize", "--output", p("o.bin"), "--eos", "4294967552", p("doc.txt")],
         "--eos"),
        ("plan compile seq-len 0", plan + ["--seq-len", "0"], "--seq-len"),
        ("data is a directory", with_flag(base, "--data", p("adir")), "is a directory"),
        ("data is a FIFO", with_flag(base, "--data", p("fifo")), "is a FIFO"),
        ("model is a FIFO", with_flag(base, "--model", p("fifo")), "is a FIFO"),
        ("strategy is a directory", with_flag(dist, "--strategy", p("adir")),
         "is a directory"),
        ("tokenize input is a directory", ["tokenize", "--output", p("o.bin"), "--eos", "256", p("adir")],
         "is a directory"),
        ("micro-batches under a strategy", dist + ["--micro-batches", "2"], "--micro-batches"),
        ("timeout without nproc", dist + ["--timeout", "10"], "--timeout"),
        ("switch file is a FIFO", with_flag(dist, "--steps", "3") + ["--switch", "1:" + p("fifo")], "is a FIFO"),
        # Every emulated rank is a process here: a count no machine runs is refused up front.
        ("profile emulated-ranks 100000", ["profile", "--model", p("cfg.json"), "-o", p("prof.json"),
                                           "--emulated-ranks", "100000"], "--emulated-ranks 100000 must lie in"),
        # A switch keeps the global batch (as events do), and a bad strategy
        # there is named with its flag and file.
        ("switch to another global batch", with_flag(dist, "--steps", "3") + ["--switch", "1:" + p("s4.json")],
         "global batch 4, the run's is 2"),
        ("switch to a strategy for more ranks", with_flag(dist, "--steps", "3") + ["--switch", "1:" + p("s2r.json")],
         "--switch 1: " + p("s2r.json")),
        # Not-a-number values pass a "< 0" or "<= 0" test; each is refused by name.
        ("plan search time-limit nan", ["plan", "search", "--model", p("cfg.json"), "--cluster", p("cluster.json"),
                                        "--global-batch", "2", "--seq-len", "16", "--time-limit", "nan"],
         "--time-limit"),
        ("plan switch bucket-mb nan", ["plan", "switch", "--model", p("cfg.json"), "--from", p("s.json"), "--to",
                                       p("s.json"), "--world", "1", "--bucket-mb", "nan"], "--bucket-mb"),
        # With token budgets the longest piece is --max-seq-len, and the message says so.
        ("max-seq-len beyond the model", [a for a in base if a not in ("--seq-len", "16", "--global-batch", "2")] +
         ["--batch-tokens", "4096", "--max-seq-len", "2048"], "--max-seq-len 2048 exceeds"),
        # A cluster emulated on this CPU is timed from a profile of this CPU,
        # never from the catalog's roofline (it predicted 0.006 s where the
        # emulator measured 0.107 s).
        ("plan search emulated, no profile", ["plan", "search", "--model", p("cfg.json"), "--cluster",
                                              p("emulated.json"), "--global-batch", "2", "--seq-len", "16"],
         "is emulated on this CPU"),
        ("plan cost emulated, no profile", ["plan", "cost", "--model", p("cfg.json"), "--strategy", p("s.json"),
                                            "--cluster", p("emulated.json"), "--seq-len", "16"],
         "hspmd profile"),
        # --device: checked before any work, one line whatever the reason
        # (no CUDA in the build, no GPU, no such index, CUDA training not yet).
        ("device cuda", base + ["--device", "cuda"], "cuda:0"),
        ("device cuda index", base + ["--device", "cuda:7"], "cuda:7"),
        ("device unknown", base + ["--device", "tpu"], "--device: 'tpu' (expected cpu, cuda or cuda:N)"),
        # --comm chooses how CUDA ranks communicate: alone or unknown, an error.
        ("comm without cuda", base + ["--comm", "mpi"], "--comm is read only with --device cuda"),
        ("comm unknown", base + ["--comm", "gloo"], "--comm: 'gloo' (expected auto, nccl or mpi)"),
        # plan cost refuses the token budget that train refuses.
        ("plan cost budget below a piece", ["plan", "cost", "--model", p("cfg.json"), "--strategy", p("s.json"),
                                            "--cluster", p("cluster.json"), "--lengths", p("long.bin"),
                                            "--batch-tokens", "10", "--max-seq-len", "32"],
         "--batch-tokens 10 is smaller than the longest piece"),
    ]
    # Integers go through one range check in the flag parser (issue 39 item 9):
    # a value an int cannot hold is refused with the flag and the range, never
    # cut to 32 bits (--world 4294967300 wrote "world_size": 4).
    search = ["plan", "search", "--model", p("cfg.json"), "--cluster", p("cluster.json"), "--global-batch", "2",
              "--seq-len", "16"]
    prof = ["profile", "--model", p("cfg.json"), "-o", p("prof.json")]
    cases += [
        ("plan compile world 2^32+4", with_flag(plan, "--world", "4294967300"),
         "--world 4294967300 is outside [1, 1048576]"),
        ("plan compile world beyond 64 bits", with_flag(plan, "--world", "99999999999999999999"),
         "--world 99999999999999999999 is outside [1, 1048576]"),
        ("plan switch world 2^32+1", ["plan", "switch", "--model", p("cfg.json"), "--from", p("s.json"), "--to",
                                      p("s.json"), "--world", "4294967297"], "--world 4294967297 is outside"),
        ("plan search global-batch 2^32+8", with_flag(search, "--global-batch", "4294967304"),
         "--global-batch 4294967304 is outside [1, "),
        ("plan search global-batch 10^15", with_flag(search, "--global-batch", "1000000000000000"),
         "--global-batch 1000000000000000 is outside [1, "),
        ("plan search top 2^32+5", search + ["--top", "4294967301"], "--top 4294967301 is outside"),
        ("plan search tp 2^32+1", search + ["--tp", "4294967297"], "--tp 4294967297 is outside"),
        ("plan search unavailable 2^32", search + ["--unavailable", "4294967296"], "--unavailable 4294967296 is outside"),
        ("plan search seq-len 10^15", with_flag(search, "--seq-len", "1000000000000000"),
         "--seq-len 1000000000000000 is outside"),
        ("profile repetitions 2^32+1", prof + ["--repetitions", "4294967297"], "--repetitions 4294967297 is outside"),
        ("profile tp 2^32+2", prof + ["--tp", "4294967298"], "--tp 4294967298 is outside"),
    ]
    failures = []
    for name, args, needle in cases:
        try:
            r = subprocess.run([exe] + args, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            print(f"{name:34s} FAIL (hangs)")
            failures.append(name)
            continue
        lines = r.stderr.strip().splitlines()
        problems = []
        if r.returncode == 0:
            problems.append("exit code 0")
        if len(lines) != 1:
            problems.append(f"{len(lines)} stderr lines")
        elif needle not in lines[0] or not lines[0].startswith("hspmd: "):
            problems.append(f"message does not name '{needle}'")
        print(f"{name:34s} {'ok' if not problems else 'FAIL (' + ', '.join(problems) + ')'}: "
              f"{r.stderr.strip()[:200]}")
        if problems:
            failures.append(name)
    for out in ("o.bin", "p.json", "t.json", "prof.json"):
        if os.path.exists(p(out)):
            failures.append(f"{out} written despite an error")

    # Two independent single-process runs under mpirun would write the same files.
    if shutil.which("mpirun"):
        r = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", exe] + base,
                           capture_output=True, text=True, timeout=120)
        ours = [l for l in r.stderr.splitlines() if l.startswith("hspmd: ")]
        ok = r.returncode != 0 and len(ours) == 1 and "--strategy" in ours[0]
        print(f"{'mpirun -np 2 without a strategy':34s} {'ok' if ok else 'FAIL'}: {ours[:2]}")
        if not ok:
            failures.append("mpirun -np 2 without a strategy")
    if failures:
        sys.exit("FAILED: " + ", ".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
