#!/usr/bin/env python3
"""No command-line flag spelled below the command line.

The options are named once, by their field ("seq_len"); the front end
decides how a user sees the name: the `hspmd` command line as a flag
("--seq-len"), Python as a keyword ("seq_len") (hspmd/core/options.h,
option_name). A string literal holding a flag ("--seq-len") in library code
would print the command line's spelling to a Python user, so this lint fails
on any such literal in src/ outside src/cli/ and in python/src/.

Usage: flag_literal_lint.py --root REPO [--self-test]
Exit 1 with one line per literal: FILE:LINE: "literal": rule.
"""
import argparse
import os
import re
import sys
import tempfile

# A flag, or a literal that builds one at run time ("--" + name).
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*|$)")
EXTS = (".h", ".cc", ".cpp", ".cu", ".cuh", ".inc")
# The one place that spells a flag: option_name itself.
SPELLER = os.path.join("src", "core", "options.cc")


def string_literals(text):
    """(line, literal) for every C++ string literal of `text` (comments,
    char literals and raw strings understood)."""
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            line += text.count("\n", i, j)
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            k = text.find("(", i + 2)
            delim = text[i + 2:k]
            end = text.find(")" + delim + '"', k)
            end = n if end < 0 else end
            yield line, text[k + 1:end]
            line += text.count("\n", i, end)
            i = end + len(delim) + 2
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            yield line, text[i + 1:j]
            i = j + 1
        elif c == "'" and not (i > 0 and text[i - 1].isalnum()):  # a char literal (not a digit separator)
            j = i + 1
            while j < n and text[j] != "'":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1


def checked_files(root):
    for top, skip in (("src", os.path.join("src", "cli")), (os.path.join("python", "src"), None)):
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = os.path.relpath(dirpath, root)
            if skip and (rel_dir == skip or rel_dir.startswith(skip + os.sep)):
                dirnames[:] = []
                continue
            for f in sorted(filenames):
                if f.endswith(EXTS) and os.path.join(rel_dir, f) != SPELLER:
                    yield os.path.join(dirpath, f)


def check(root):
    out = []
    for path in sorted(checked_files(root)):
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for line, lit in string_literals(text):
            if FLAG.search(lit):
                rel = os.path.relpath(path, root)
                out.append(f'{rel}:{line}: "{lit}": a command-line flag below src/cli (name the option: '
                           f'option_name("{FLAG.search(lit).group(1).replace("-", "_") or "field"}"))')
    return out


def self_test():
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "src", "train"))
        os.makedirs(os.path.join(d, "src", "cli"))
        os.makedirs(os.path.join(d, "python", "src"))
        ok = '// --seq-len in a comment\nauto a = option_name("seq_len"); char c = \'-\'; int x = 1\'000;\n'
        open(os.path.join(d, "src", "train", "ok.cc"), "w").write(ok)
        open(os.path.join(d, "src", "cli", "cli.cc"), "w").write('f.add_int("--steps");\n')
        assert check(d) == [], check(d)
        bad = {"src/train/a.cc": 'fail("[flags] --steps must be positive");\n',
               "src/train/d.cc": 'fail("[flags] with --", name);\n',
               "src/train/b.h": 'auto s = R"(--lr x)";\n',
               "python/src/c.cc": '/* x */ fail("use --seq-len");\n'}
        for rel, text in bad.items():
            p = os.path.join(d, rel)
            open(p, "w").write(text)
            found = check(d)
            assert len(found) == 1 and found[0].startswith(rel + ":1:"), (rel, found)
            os.remove(p)
    print("flag_literal_lint self-test: ok")


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
        print(f"flag_literal_lint: {len(found)} literal(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
