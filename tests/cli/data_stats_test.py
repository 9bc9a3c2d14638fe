#!/usr/bin/env python3
"""`hspmd data stats`: the figures of a small token file (table, --json,
--svg, --model), and bad input: each error case must exit non-zero with one
stderr line that names the problem, and write no SVG.

usage: data_stats_test.py --hspmd PATH
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile


def write_tokens(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack("<%dI" % len(tokens), *tokens))


def run(exe, args):
    return subprocess.run([exe] + args, capture_output=True, text=True, timeout=60)


def check_figures(exe, p, failures):
    # Documents (eos 256): 3, 2, 7 and a last one of 5 without an eos.
    tokens = [1, 2, 256, 3, 256] + [4] * 6 + [256] + [5] * 5
    write_tokens(p("ok.bin"), tokens)
    r = run(exe, ["data", "stats", p("ok.bin"), "--eos", "256", "--max-seq-len", "4", "--json",
                  "--svg", p("ok.svg")])
    if r.returncode != 0:
        failures.append("json run failed: " + r.stderr.strip())
        return
    j = json.loads(r.stdout)
    want = {"documents": 4, "tokens": 17, "eos_token_id": 256, "file": p("ok.bin")}
    for key, value in want.items():
        if j[key] != value:
            failures.append(f"json {key} = {j[key]}, expected {value}")
    if j["document_length"] != {"p50": 3, "p90": 7, "p97": 7, "p99": 7, "max": 7, "mean": 4.25}:
        failures.append(f"json document_length = {j['document_length']}")
    if [b["documents"] for b in j["histogram"]] != [1, 1, 2]:
        failures.append(f"json histogram = {j['histogram']}")
    pieces = j["pieces"][0]  # 3 | 2 | 4 3 | 4 1
    if (pieces["pieces"], pieces["cut_documents"]) != (6, 2):
        failures.append(f"json pieces = {pieces}")
    if [b["pieces"] for b in pieces["intervals"]] != [1, 1, 4]:
        failures.append(f"json intervals = {pieces['intervals']}")
    with open(p("ok.svg")) as f:
        svg = f.read()
    if not svg.startswith("<svg xmlns=") or "L=4" not in svg:
        failures.append("svg is not the histogram")
    with open(p("cfg.json"), "w") as f:
        json.dump({"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
                   "eos_token_id": 4}, f)
    r = run(exe, ["data", "stats", p("ok.bin"), "--model", p("cfg.json")])
    if r.returncode != 0 or "in 7 documents (eos 4)" not in r.stdout or "p97" not in r.stdout:
        failures.append("table with --model: " + r.stdout[:200] + r.stderr.strip())
    print("figures", "ok" if not failures else "FAIL")


def error_cases(p):
    write_tokens(p("ok.bin"), [1, 256, 2, 256])
    open(p("empty.bin"), "wb").close()
    with open(p("odd.bin"), "wb") as f:
        f.write(b"\x01\x00\x00\x00\x02\x00")
    os.mkdir(p("dir.bin"))
    stats = ["data", "stats"]
    return [
        ("missing file", stats + [p("nope.bin")], "[data] " + p("nope.bin")),
        ("empty file", stats + [p("empty.bin")], "[data] " + p("empty.bin")),
        ("size not a multiple of 4", stats + [p("odd.bin")], "not a multiple of 4"),
        ("a directory", stats + [p("dir.bin")], "dir.bin"),
        ("no file", stats, "expected one token file"),
        ("two files", stats + [p("ok.bin"), p("ok.bin")], "expected one token file"),
        ("max-seq-len 0", stats + [p("ok.bin"), "--max-seq-len", "0"], "--max-seq-len"),
        ("max-seq-len not a number", stats + [p("ok.bin"), "--max-seq-len", "4k"], "--max-seq-len"),
        ("negative eos", stats + [p("ok.bin"), "--eos", "-1"], "--eos"),
        ("eos beyond uint32", stats + [p("ok.bin"), "--eos", "4294967296"], "--eos"),
        ("eos and model", stats + [p("ok.bin"), "--eos", "1", "--model", p("cfg.json")], "not both"),
        ("missing model", stats + [p("ok.bin"), "--model", p("nope.json")], "nope.json"),
        ("svg in a missing directory", stats + [p("ok.bin"), "--svg", p("no/dir/h.svg")], "--svg"),
        ("unknown flag", stats + [p("ok.bin"), "--frobnicate"], "--frobnicate"),
        ("unknown subcommand", ["data", "frobnicate"], "frobnicate"),
        ("no subcommand", ["data"], "missing subcommand"),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    exe = ap.parse_args().hspmd
    tmp = tempfile.mkdtemp()
    p = lambda n: os.path.join(tmp, n)  # noqa: E731
    failures = []
    check_figures(exe, p, failures)
    for name, args, needle in error_cases(p):
        r = run(exe, args + ["--svg", p("err.svg")] if args[-1].endswith(".bin") else args)
        lines = r.stderr.strip().splitlines()
        problems = []
        if r.returncode == 0:
            problems.append("exit code 0")
        if len(lines) != 1:
            problems.append(f"{len(lines)} stderr lines")
        elif needle not in lines[0] or not lines[0].startswith("hspmd: "):
            problems.append(f"message does not name '{needle}'")
        print(f"{name:28s} {'ok' if not problems else 'FAIL (' + ', '.join(problems) + ')'}: "
              f"{r.stderr.strip()[:160]}")
        if problems:
            failures.append(name)
    if os.path.exists(p("err.svg")):
        failures.append("an error case wrote the SVG")
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
