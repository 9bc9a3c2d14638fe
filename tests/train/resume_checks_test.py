#!/usr/bin/env python3
"""What a resume checks (docs/checkpoint.md): a checkpoint resumed under
another model (KV heads 2 -> 4, another FFN, more layers, another
vocabulary or rope_theta) or another data mode (--seq-len, --global-batch,
token budgets) is refused in one line naming the field; a meta whose
samples or seed are not integers in range is refused by name; and
--checkpoint without --save-every writes one checkpoint after the last step,
which resumes.

usage: resume_checks_test.py --hspmd PATH --repo PATH
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    a = ap.parse_args()
    failures = []

    def check(label, ok, detail=""):
        print(f"{label:58s} {'ok' if ok else 'FAIL'} {detail}")
        if not ok:
            failures.append(label)

    with tempfile.TemporaryDirectory() as tmp:
        p = lambda n: os.path.join(tmp, n)  # noqa: E731
        cfg = json.load(open(os.path.join(a.repo, "examples", "tiny-llama", "config.json")))
        json.dump(cfg, open(p("m.json"), "w"))
        with open(p("d.bin"), "wb") as f:
            f.write(struct.pack("<4000I", *[(i * 7919) % 256 for i in range(4000)]))
        base = [a.hspmd, "train", "--data", p("d.bin"), "--threads", "1", "--quiet"]
        run = lambda extra: subprocess.run(base + extra, capture_output=True, text=True, timeout=120)  # noqa: E731

        r = run(["--model", p("m.json"), "--seq-len", "32", "--global-batch", "2", "--steps", "3",
                 "--checkpoint", p("ck")])
        index = p("ck/index.json")
        check("--checkpoint without --save-every: one checkpoint at the end",
              r.returncode == 0 and os.path.exists(index) and json.load(open(index))["step"] == 3, r.stderr[-300:])
        r = run(["--model", p("m.json"), "--seq-len", "32", "--global-batch", "2", "--steps", "5",
                 "--resume", p("ck")])
        check("... which resumes", r.returncode == 0, r.stderr[-300:])

        for field, value in [("num_key_value_heads", 4), ("intermediate_size", 320), ("num_hidden_layers", 5),
                             ("vocab_size", 330), ("rope_theta", 5e5)]:
            json.dump(dict(cfg, **{field: value}), open(p("other.json"), "w"))
            r = run(["--model", p("other.json"), "--seq-len", "32", "--global-batch", "2", "--steps", "5",
                     "--resume", p("ck")])
            lines = [l for l in r.stderr.splitlines() if l.strip()]
            check(f"resume with another {field}: refused, naming it",
                  r.returncode != 0 and len(lines) == 1 and f"written for {field}" in lines[0] and
                  "[checkpoint]" in lines[0], lines[0][:200] if lines else "")
        for extra, field in [(["--seq-len", "16", "--global-batch", "2"], "data seq_len"),
                             (["--seq-len", "32", "--global-batch", "4"], "data global_batch"),
                             (["--batch-tokens", "64", "--max-seq-len", "32"], "data mode")]:
            r = run(["--model", p("m.json"), "--steps", "5", "--resume", p("ck")] + extra)
            lines = [l for l in r.stderr.splitlines() if l.strip()]
            check(f"resume with another {field}: refused, naming it",
                  r.returncode != 0 and len(lines) == 1 and f"written for {field}" in lines[0],
                  lines[0][:200] if lines else "")

        good = json.load(open(index))
        for field, value, needle in [("samples", -7, "meta.samples: -7 is not an integer"),
                                     ("samples", 2 ** 63 + 5, "meta.samples: 9223372036854775813 is not"),
                                     ("samples", 1.5, "meta.samples: 1.5 is not an integer"),
                                     ("seed", "abc", "meta.seed: \"abc\" is not an integer")]:
            bad = json.loads(json.dumps(good))
            bad["meta"][field] = value
            json.dump(bad, open(index, "w"))
            r = run(["--model", p("m.json"), "--seq-len", "32", "--global-batch", "2", "--steps", "5",
                     "--resume", p("ck")])
            lines = [l for l in r.stderr.splitlines() if l.strip()]
            check(f"meta.{field} = {value!r}: refused, naming it",
                  r.returncode != 0 and len(lines) == 1 and needle in lines[0], lines[0][:200] if lines else "")
        json.dump(good, open(index, "w"))
    if failures:
        sys.exit("FAILED: " + ", ".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
