#!/usr/bin/env python3
"""The structure check must be able to fail (CTest structure_check_selftest):
it is run on fake source trees written to a temporary folder. A clean tree,
full of the constructs its brace matcher must see through (braces in
comments, strings, character literals and raw strings, constructor
initialiser lists with braces, namespace-scope lambdas, limits met exactly),
must pass; each other tree adds one violation of one rule to the clean tree
and must fail with exactly one line, naming the file, the line and the rule.

usage: structure_check_selftest.py
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def body_lines(n):
    """n statements, one per line."""
    return "".join(f"  x += {i};\n" for i in range(n))


def function(name, total):
    """A function whose signature-to-closing-brace span is total lines."""
    return f"int {name}(int x) {{\n" + body_lines(total - 3) + "  return x;\n}\n"


def klass(name, total):
    """A class whose keyword-to-closing-brace span is total lines."""
    return f"class {name} {{\n public:\n" + "".join(f"  int m{i}_ = {i};\n" for i in range(total - 3)) + "};\n"


# Tricky but clean: every block here is short, every brace in a literal or a
# comment is unbalanced on purpose, so a matcher that saw them would misplace
# the ends of functions (and the 80-line function below would grow past 80).
TRICKY = r'''#include "hspmd/a/a.h"
#include "b/detail.h"
#include <vector>

namespace hspmd {
namespace {
// A comment with a brace { that is never closed
/* and a block comment
   that closes } nothing */
const char* kOpen = "{ \" {";
const char kBrace = '{';
const char kQuote = '\'';
const long kBig = 1'000'000;
const char* kRaw = R"json({"a": {"b": )json";
const char* kRaw2 = u8R"(})";
const char* kRaw3 = R"(a" { ")";  // read as plain strings, the brace would show
const auto kLambda = [](int v) {
  return v + 1;
};
std::vector<int> kList{1, 2, 3};
int kArr[] = {1, 2};
}  // namespace

struct Holder {
  Holder(int a, int b) : a_{a}, b_(b), c_{std::vector<int>{a, b}} {
    if (a > b) { a_ = b; }
  }
  auto get() const -> std::vector<int> { return c_; }
  bool operator==(const Holder& o) const { return a_ == o.a_; }
  int a_;
  int b_;
  std::vector<int> c_;
};

#define HSPMD_BRACE {
#define HSPMD_TWO_LINES \
  }
'''


def clean_tree():
    return {
        "include/hspmd/a/a.h": "#pragma once\nnamespace hspmd { int a(); }\n",
        "src/a/a.cc": '#include "hspmd/a/a.h"\n#include "a/local.h"\n' + function("a", 80),
        "src/a/local.h": "#pragma once\n#include \"util.h\"\n",
        "src/a/util.h": "#pragma once\n",
        "src/b/detail.h": "#pragma once\n#include \"hspmd/a/a.h\"\n" + klass("Detail", 300),
        "src/b/tricky.cc": TRICKY + function("eighty", 80) + "}  // namespace hspmd\n",
        "src/b/long.cc": "\n" * 799 + "int x;\n",
    }


# (name, files changed or added, the text the one violation line must hold)
CASES = [
    ("file over 800 lines", {"src/b/long.cc": "\n" * 800 + "int x;\n"},
     "src/b/long.cc:1: file is 801 lines: rule: at most 800 lines per file"),
    ("function over 80 lines", {"src/a/a.cc": '#include "hspmd/a/a.h"\n' + "\n" + function("a", 81)},
     "src/a/a.cc:3: function a is 81 lines (to line 83): rule: at most 80 lines per function"),
    ("function over 80 lines past braces in literals",
     {"src/b/tricky.cc": TRICKY + function("eighty", 81) + "}  // namespace hspmd\n"},
     "function eighty is 81 lines"),
    ("constructor over 80 lines after a braced initialiser list",
     {"src/b/ctor.cc": "struct S {\n  S(int a)\n      : a_{a}, b_(a) {\n" + body_lines(78) + "  }\n  int a_, b_;\n};\n"},
     "src/b/ctor.cc:2: function S::S is 81 lines (to line 82): rule: at most 80 lines per function"),
    ("class over 300 lines", {"src/b/detail.h": "#pragma once\n" + klass("Detail", 301)},
     "src/b/detail.h:2: class Detail body is 301 lines (to line 302): rule: at most 300 lines per class/struct body"),
    ("module include circle", {"src/a/back.cc": '#include "hspmd/a/a.h"\n\n#include "b/detail.h"\n'},
     "src/a/back.cc:3: module include circle a -> b -> a (a -> b: src/a/back.cc:3 #include \"b/detail.h\"; "
     "b -> a: src/b/detail.h:2 #include \"hspmd/a/a.h\"): rule: no module includes itself through others"),
    ("module include circle through a public header",
     {"include/hspmd/a/a.h": '#pragma once\n#include "hspmd/b/b.h"\n', "include/hspmd/b/b.h": "#pragma once\n"},
     "module include circle a -> b -> a"),
    ("file include circle", {"src/a/util.h": '#pragma once\n#include "a/local.h"\n'},
     "src/a/local.h:2: file include circle src/a/local.h -> src/a/util.h -> src/a/local.h"),
    ("unmatched brace", {"src/b/broken.cc": "namespace x {\nvoid f() {\n}\n"},
     "src/b/broken.cc:1: braces do not match (this block is never closed): rule: every file can be measured"),
]


def write_tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def run(root):
    r = subprocess.run([sys.executable, os.path.join(HERE, "structure_check.py"), "--root", root],
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if not ln.startswith("structure_check:")]
    return r.returncode, lines, r.stdout + r.stderr


def main():
    failures = []
    with tempfile.TemporaryDirectory(prefix="structure_check_selftest_") as tmp:
        clean = os.path.join(tmp, "clean")
        write_tree(clean, clean_tree())
        rc, lines, out = run(clean)
        print(f"clean tree: exit {rc}")
        if rc != 0:
            failures.append(f"the clean tree failed:\n{out}")
        for i, (name, changes, expected) in enumerate(CASES):
            root = os.path.join(tmp, f"case{i}")
            files = clean_tree()
            files.update(changes)
            write_tree(root, files)
            rc, lines, out = run(root)
            named = len(lines) == 1 and expected in lines[0]
            print(f"{name}: exit {rc}, one line naming it: {named}")
            if rc != 1 or not named:
                failures.append(f"{name}: expected exit 1 and one line holding\n  {expected}\ngot exit {rc}:\n{out}")
        rc, _, out = run(os.path.join(tmp, "missing"))
        print(f"a root without src/: exit {rc}")
        if rc != 2:
            failures.append(f"a root without src/: expected exit 2, got {rc}:\n{out}")
    for f in failures:
        print("FAIL: " + f)
    print("ok" if not failures else f"{len(failures)} case(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
