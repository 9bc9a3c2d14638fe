#!/usr/bin/env python3
"""The docs check must be able to fail (CTest docs_check_self_test): it is fed
Markdown snippets, each with one wrong flag, command or variable, and must
exit 1 naming it; a snippet of correct commands of every kind and an
unchanged copy of README.md must pass; the same README with one flag renamed
must fail.

usage: docs_check_self_test.py --hspmd build/src/cli/hspmd [--repo DIR] [--python python3] [--pythonpath DIR]
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

GOOD = """# Good

```sh
./build/src/cli/hspmd train --model M --data D --seq-len 128 --global-batch 16 --steps 3 \\
    --lr 3e-3 --log out/t.jsonl   # a comment --not-a-flag
HSPMD_X=1 build/src/cli/hspmd plan compile --model M --strategy S --world 8 -o P.json
mpirun --allow-run-as-root --oversubscribe -np 2 hspmd train --strategy S.json --nproc 2
python3 bench/dist_step.py --hspmd build/src/cli/hspmd [--steps 6] [--seq-len 256]
bash scripts/gpu_check.sh --local core
```

Inline: `hspmd plan search --lengths D.bin --batch-tokens T --max-seq-len L --strategies-out DIR`,
`hspmd data stats D.bin [--eos ID | --model M.json] [--json]`, a running hspmd job is prose,
`hspmd launch --nproc 2 script.py --anything`, `BUDGET=420 bash scripts/gpu_check.sh`,
`STEPS=3 NPROC=6 bash examples/train_tiny_distributed.sh`.
"""

# (name, snippet, the word the failure must name)
BAD = [
    ("hspmd flag", "```sh\n./build/src/cli/hspmd train --model M --stesp 3\n```\n", "--stesp"),
    ("subcommand flag after env and continuation",
     "```sh\nHSPMD_X=1 build/src/cli/hspmd plan compile --model M \\\n    --wrld 31 -o P.json\n```\n", "--wrld"),
    ("flag of a mode", "Run `hspmd plan search --lengths D.bin --bucket 3`.\n", "--bucket"),
    ("flag under mpirun", "`mpirun -np 2 hspmd train --nprocs 2`\n", "--nprocs"),
    ("unknown command in a code block", "```\nhspmd trian --steps 3\n```\n", "trian"),
    ("unknown plan subcommand", "`hspmd plan complie --model M`\n", "complie"),
    ("Python script flag", "`python3 bench/dist_step.py --seq-lenn 32`\n", "--seq-lenn"),
    ("Python script flag as an argparse prefix", "`python3 bench/dist_step.py --seq 32`\n", "--seq"),
    ("a test script by its file name", "`equivalence_test.py --devcie cpu:1`\n", "--devcie"),
    ("shell script option", "```sh\nbash scripts/gpu_check.sh --locale core\n```\n", "--locale"),
    ("shell script variable", "`BUDGTE=300 bash scripts/gpu_check.sh`\n", "BUDGTE"),
]


def check(args, files):
    extra = ["--pythonpath", args.pythonpath] if args.pythonpath else []
    r = subprocess.run([args.python, os.path.join(HERE, "docs_check.py"), "--repo", args.repo, "--hspmd", args.hspmd,
                        "--python", args.python] + extra + files, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(HERE)))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pythonpath", default=None, help="where the hspmd module is built (docs_check.py's flag)")
    args = ap.parse_args()
    failures = []
    with tempfile.TemporaryDirectory(prefix="docs_check_self_test_") as tmp:
        good = os.path.join(tmp, "good.md")
        open(good, "w").write(GOOD)
        rc, out = check(args, [good])
        print(f"correct commands: exit {rc}")
        if rc != 0:
            failures.append(f"correct commands were refused:\n{out}")
        for name, snippet, word in BAD:
            path = os.path.join(tmp, name.replace(" ", "_") + ".md")
            open(path, "w").write(snippet)
            rc, out = check(args, [path])
            named = any(word in line and "problem" not in line for line in out.splitlines())
            print(f"{name}: exit {rc}, names {word}: {named}")
            if rc != 1 or not named:
                failures.append(f"{name}: expected exit 1 naming {word}, got exit {rc}:\n{out}")
        readme = open(os.path.join(args.repo, "README.md")).read()
        same = os.path.join(tmp, "README.md")
        open(same, "w").write(readme)
        rc, out = check(args, [same])
        print(f"README.md as it is: exit {rc}")
        if rc != 0:
            failures.append(f"README.md as it is failed:\n{out}")
        renamed = readme.replace("--global-batch 16", "--global-batches 16", 1)
        if renamed == readme:
            failures.append("README.md no longer quotes --global-batch 16: the rename case has nothing to rename")
        else:
            open(same, "w").write(renamed)
            rc, out = check(args, [same])
            print(f"README.md with --global-batch renamed --global-batches: exit {rc}")
            if rc != 1 or "--global-batches" not in out:
                failures.append(f"README.md with a renamed flag: expected exit 1 naming it, got {rc}:\n{out}")
    for f in failures:
        print("FAIL: " + f)
    print("ok" if not failures else f"{len(failures)} case(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
