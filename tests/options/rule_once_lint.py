#!/usr/bin/env python3
"""Each option rule written once.

A rule about an option reads "<option> <rule>" in its error: in library code
fail_option("steps", " must be positive, got ", n); on the command line
"[flags] --nproc must lie in [1, ". The same (option, rule) pair written in
two places is the same rule twice: two places to change, two messages that
drift apart. This lint collects every pair from src/ and python/src/ (the
option's field, and the first words of the rule up to the first value) and
fails on a pair found at more than one place.

Usage: rule_once_lint.py --root REPO [--self-test]
Exit 1 with one line per repeated rule: the option, the rule, the places.
"""
import argparse
import os
import re
import sys
import tempfile

EXTS = (".h", ".cc", ".cpp", ".cu", ".cuh")
# fail_option("field", "<rule>"
FAIL_OPTION = re.compile(r'fail_option\(\s*"([a-z0-9_]+)"\s*,\s*"((?:[^"\\]|\\.)*)"'
                         r'(?:\s*,\s*option_name\("([a-z0-9_]+)"\))?')
# "[flags] --flag <rule>" (the command line's own spelling)
CLI_RULE = re.compile(r'"\[flags\] --([a-z0-9-]+)((?:[^"\\]|\\.)*)"')


def rule_key(rule):
    """The rule's words before its first value: ' must be positive, got ' ->
    'must be positive'. Empty for a rule that is only punctuation (': ')."""
    words = re.sub(r"[^a-z0-9 \[\]()]", " ", rule.lower()).split()
    while words and words[-1] in ("got", "is", "of", "a", "the"):
        words.pop()
    return " ".join(words)


def rules(root):
    found = {}
    for top in ("src", os.path.join("python", "src")):
        for dirpath, _, filenames in os.walk(os.path.join(root, top)):
            for f in sorted(filenames):
                if not f.endswith(EXTS):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                text = open(path, encoding="utf-8", errors="replace").read()
                for pattern, norm in ((FAIL_OPTION, lambda s: s), (CLI_RULE, lambda s: s.replace("-", "_"))):
                    for m in pattern.finditer(text):
                        key = rule_key(m.group(2))
                        if pattern is FAIL_OPTION and m.group(3):  # "needs" + the option it needs
                            key += " " + m.group(3)
                        if len(key.split()) < 2:  # ": '" and the like: no rule in the words
                            continue
                        line = text.count("\n", 0, m.start()) + 1
                        found.setdefault((norm(m.group(1)), key), []).append(f"{rel}:{line}")
    return found


def check(root):
    out = []
    for (field, key), places in sorted(rules(root).items()):
        if len(places) > 1:
            out.append(f"option {field}: rule '{key}' written {len(places)} times: {', '.join(places)}")
    return out


def self_test():
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "src", "train"))
        os.makedirs(os.path.join(d, "src", "cli"))
        os.makedirs(os.path.join(d, "python", "src"))
        open(os.path.join(d, "src", "train", "a.cc"), "w").write(
            'fail_option("steps", " must be positive, got ", n);\nfail_option("seq_len", ": \'", s);\n')
        open(os.path.join(d, "src", "cli", "b.cc"), "w").write('fail("[flags] --nproc must lie in [1, ", n);\n')
        assert check(d) == [], check(d)
        for rel, text in (("src/cli/c.cc", 'fail("[flags] --steps must be positive, got ", n);\n'),
                          ("python/src/d.cc", 'fail_option("steps", " must be positive, got ", n);\n')):
            p = os.path.join(d, rel)
            open(p, "w").write(text)
            found = check(d)
            assert len(found) == 1 and "option steps: rule 'must be positive'" in found[0] and rel in found[0], found
            os.remove(p)
    print("rule_once_lint self-test: ok")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return 0
    found = check(args.root)
    for line in found:
        print(line)
    if found:
        print(f"rule_once_lint: {len(found)} rule(s) written more than once")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
