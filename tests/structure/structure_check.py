#!/usr/bin/env python3
"""Structure rules of the C++ sources (docs/refactoring.md, "Structure
check"; issue "[3/12] The trainer taken apart"): sizes that stay readable
and layers that do not include each other in a circle.

Files: every .h .hpp .cc .cpp .cu .cuh .inc under src/ for the size rules;
those and the headers under include/hspmd/ for the include rules.

Rules (each violation is one line, `FILE:LINE: what: rule`, and the exit
status is 1):

  file      a file has at most 800 lines (lines as `wc -l` counts them, plus
            a last line without a newline).
  function  a function body has at most 80 lines, counted inclusively from
            the line of the function's name (the token before its parameter
            list; a `template <...>` line above it and the return type on an
            earlier line do not count, a parameter list wrapped over several
            lines does) to the line of the `}` that closes its body. A
            function is a `{ ... }` block opened at namespace or class scope
            whose header (the text since the previous `;`, `{`, `}` or access
            specifier at that scope) has a parenthesised group followed only
            by qualifiers (const, noexcept(...), override, final, &, &&,
            `-> type`, requires ..., try, attributes) or a constructor's
            initialiser list, and has no `=` before that group (so
            `auto f = [] {...};` and `T x{...}` are initialisers, not
            functions). Everything inside a function (lambdas, local classes)
            counts as part of it.
  class     a class/struct/union body has at most 300 lines, counted
            inclusively from the line of its `class`/`struct`/`union` keyword
            to the line of its closing `}`. Nested classes are measured on
            their own as well as inside their enclosing class.
  module    the module include graph has no circle. A module is a folder
            directly under src/ (src/graph -> graph); the headers under
            include/hspmd/<module>/ belong to <module>. A file of A that
            includes a file of B (resolved like the compiler does: the
            including file's folder, then src/, then include/; or, when the
            file is absent, spelled "hspmd/B/..." or "B/...") is an edge
            A -> B. Every elementary circle is reported, with one include
            line per edge.
  include   the file include graph (same resolution) has no circle.
  parse     a file whose braces do not match cannot be measured, which is
            reported rather than skipped.

The brace matcher is a heuristic: comments, string and character literals
(with digit separators told apart), raw strings R"d(...)d" and preprocessor
lines are blanked first, keeping line numbers. `--list` prints every function
and class it measured, to audit it.

usage: structure_check.py [--root DIR] [--list]
Exit 0 when every rule holds, 1 on any violation, 2 when DIR has no src/.
"""
import argparse
import os
import re
import sys

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300
MAX_CIRCLES = 200  # per graph; more than this is one broken graph, not news

SOURCE_EXTS = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh", ".inc")
INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^">]+)[">]', re.M)
IDENT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def blank(text):
    """text with comments, literals and preprocessor lines replaced by spaces
    (newlines kept), so braces inside them are not seen and lines still match."""
    out = list(text)
    n = len(text)
    i = 0
    line_start = True  # only whitespace since the last newline

    def wipe(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if line_start and c == "#":
            # A directive runs to the end of the line, joined by backslashes;
            # a comment inside it is blanked with it.
            j = i
            while j < n:
                if text[j] == "\n" and text[j - 1] != "\\":
                    break
                if text.startswith("/*", j):
                    end = text.find("*/", j + 2)
                    j = n if end < 0 else end + 2
                    continue
                j += 1
            wipe(i, j)
            i = j
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            wipe(i, j)
            i = j
            continue
        if c == '"':
            # Raw string: R"delim( ... )delim", with an optional u8/u/U/L prefix.
            k = i - 1
            while k >= 0 and text[k] in IDENT_CHARS:
                k -= 1
            prefix = text[k + 1:i]
            if prefix in ("R", "u8R", "uR", "UR", "LR"):
                paren = text.find("(", i + 1)
                delim = text[i + 1:paren] if paren >= 0 else ""
                end = text.find(")" + delim + '"', paren + 1) if paren >= 0 else -1
                j = n if end < 0 else end + len(delim) + 2
                wipe(i + 1, j - 1)
                i = j
                continue
            j = i + 1
            while j < n and text[j] != '"' and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            wipe(i + 1, j)
            i = j + 1
            continue
        if c == "'":
            # A digit separator (1'000) follows a number token; a character
            # literal follows anything else (u8'x' and L'x' included).
            k = i - 1
            while k >= 0 and text[k] in IDENT_CHARS:
                k -= 1
            if k + 1 < i and text[k + 1].isdigit():
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != "'" and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            wipe(i + 1, j)
            i = j + 1
            continue
        i += 1
    return "".join(out)


def strip_groups(s, open_c, close_c, repl):
    """s with every outermost open_c...close_c group replaced by repl."""
    out, depth = [], 0
    for ch in s:
        if ch == open_c:
            if depth == 0:
                out.append(repl)
            depth += 1
        elif ch == close_c and depth > 0:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def strip_template_prefix(h):
    """h without leading `template <...>` clauses (angle brackets matched,
    ignoring those inside parentheses)."""
    while True:
        m = re.match(r"\s*template\s*<", h)
        if not m:
            return h
        depth, paren, i = 1, 0, m.end()
        while i < len(h) and depth > 0:
            ch = h[i]
            if ch == "(":
                paren += 1
            elif ch == ")":
                paren -= 1
            elif paren == 0 and ch == "<":
                depth += 1
            elif paren == 0 and ch == ">":
                depth -= 1
            i += 1
        h = h[i:]


QUALIFIER_TAIL = re.compile(
    r"""^\s*(?:(?:const|volatile|noexcept\s*(?:\(\))?|throw\s*\(\)|override|final|mutable|&&|&|\[\[\]\]|
              __attribute__\s*\(\)|__device__|__host__)\s*)*
        (?:->(?:::|[^:])*?)?               # trailing return type
        (?:requires\b.*?)?                 # constraint
        (?:\btry\b\s*)?
        (?:(?<!:):(?!:)\s*(?P<init>.*))?$""", re.X | re.S)
INIT_ITEM = re.compile(r"\s*(?:[A-Za-z_][\w:]*\s*(?:<[^(){}]*>)?\s*(?:\(\)|\{\})\s*(?:\.\.\.)?)\s*")
ASSIGN_RE = re.compile(r"(?<![=!<>+\-*/%&|^])=(?!=)")


def init_list_complete(init):
    items = init.split(",")
    return all(INIT_ITEM.fullmatch(it) for it in items)


def classify(header):
    """'namespace', 'class', 'enum', ('function', name, name_offset) or
    'expr' for the `{` that ends header (at namespace or class scope)."""
    h = re.sub(r"^\s*(?:(?:public|private|protected)\s*:(?!:)\s*)+", "", header)
    h = strip_template_prefix(h)
    skip = len(header) - len(h)  # only a prefix was stripped: offsets into h map back by adding skip
    h = re.sub(r"\[\[.*?\]\]", lambda m: " " * len(m.group(0)), h, flags=re.S)
    words = h.split()
    first = words[0] if words else ""
    if first in ("namespace", "inline") and re.match(r"\s*(?:inline\s+)?namespace\b", h):
        return "namespace"
    if first == "extern" and re.fullmatch(r'\s*extern\s*"\s*"\s*', h):
        return "namespace"
    if not words:
        return "expr"
    kw = re.match(r"\s*(?:(?:typedef|friend|export)\s+)*(class|struct|union|enum)\b", h)
    if kw:
        return "enum" if kw.group(1) == "enum" else ("class", skip + kw.start(1))
    # Find the parameter list: the first top-level parenthesised group whose
    # tail reads as qualifiers or a constructor initialiser list.
    depth = 0
    for i, ch in enumerate(h):
        if ch == "(":
            if depth == 0:
                start = i
            depth += 1
        elif ch == ")" and depth > 0:
            depth -= 1
            if depth != 0:
                continue
            before = h[:start]
            if ASSIGN_RE.search(re.sub(r"operator\s*\S+\s*$", "", before)):
                return "expr"
            tail = strip_groups(strip_groups(h[i + 1:], "(", ")", "()"), "{", "}", "{}")
            m = QUALIFIER_TAIL.match(tail)
            if not m:
                continue
            if m.group("init") is not None and not init_list_complete(m.group("init")):
                return "expr"  # `X() : a_{...}`: this brace initialises a member
            nm = re.search(r"((?:~\s*)?[A-Za-z_]\w*(?:\s*<[^()]*>)?|operator\s*(?:\(\)|\[\]|[^\s(\w]+|\s\w[\w:<>* ]*?))\s*$",
                           before)
            name_at = nm.start(1) if nm else start
            name = re.sub(r"\s+", " ", nm.group(1).strip()) if nm else "?"
            qual = re.search(r"((?:[A-Za-z_]\w*(?:<[^()]*>)?\s*::\s*)+)$", before[:name_at])
            if qual:
                name = re.sub(r"\s+", "", qual.group(1)) + name
            return ("function", name, skip + name_at)
    return "expr"


def line_of(line_starts, offset):
    lo, hi = 0, len(line_starts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if line_starts[mid] <= offset:
            lo = mid
        else:
            hi = mid - 1
    return lo + 1


def measure(text):
    """(functions, classes, problem): functions and classes as (name, first
    line, last line); problem is a (line, message) when braces do not match."""
    code = blank(text)
    line_starts = [0] + [i + 1 for i, ch in enumerate(code) if ch == "\n"]
    functions, classes = [], []
    # Scope stack of ('namespace'|'class', name, header start) for open blocks.
    stack = []
    header_start = 0
    i, n = 0, len(code)

    def match_brace(j):
        depth = 0
        while j < n:
            if code[j] == "{":
                depth += 1
            elif code[j] == "}":
                depth -= 1
                if depth == 0:
                    return j
            j += 1
        return -1

    while i < n:
        ch = code[i]
        if ch == ";":
            header_start = i + 1
        elif ch == ":" and re.search(r"\b(?:public|private|protected)\s*$", code[header_start:i]) and \
                code[i + 1:i + 2] != ":":
            header_start = i + 1
        elif ch == "}":
            if not stack:
                return functions, classes, (line_of(line_starts, i), "a `}` closes nothing")
            kind, name, start = stack.pop()
            if kind == "class":
                classes.append((name, line_of(line_starts, start), line_of(line_starts, i)))
            header_start = i + 1
        elif ch == "{":
            header = code[header_start:i]
            kind = classify(header)
            if kind == "namespace":
                stack.append(("namespace", "", i))
                header_start = i + 1
            elif isinstance(kind, tuple) and kind[0] == "class":
                m = re.match(r"\s*(?:(?:class|struct|union)\s+)(?:\s*(?:alignas\s*\([^)]*\)|final|[A-Z_]+_API)\s+)*"
                             r"([A-Za-z_][\w:]*)?", header[kind[1]:])
                name = (m.group(1) if m and m.group(1) else "(anonymous)")
                stack.append(("class", name, header_start + kind[1]))
                header_start = i + 1
            else:
                end = match_brace(i)
                if end < 0:
                    return functions, classes, (line_of(line_starts, i), "this `{` is never closed")
                if isinstance(kind, tuple) and kind[0] == "function":
                    owners = [nm for k, nm, _ in stack if k == "class"]
                    name = kind[1] if "::" in kind[1] else "::".join(owners + [kind[1]])
                    functions.append((name, line_of(line_starts, header_start + kind[2]),
                                      line_of(line_starts, end)))
                    header_start = end + 1
                elif kind == "enum":
                    header_start = end + 1
                # An initialiser's braces stay part of the header (`T x{1};`,
                # `X() : a_{1} {`): the statement goes on after them.
                i = end
        i += 1
    if stack:
        return functions, classes, (line_of(line_starts, stack[-1][2]), "this block is never closed")
    return functions, classes, None


def list_files(root, top):
    out = []
    base = os.path.join(root, top)
    for d, dirs, files in os.walk(base):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(SOURCE_EXTS):
                out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return out


def module_of(rel):
    parts = rel.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[0] == "include" and len(parts) > 3 and parts[1] == "hspmd":
        return parts[2]
    return None


def resolve(root, rel, quote, target, known):
    """The repository path `#include target` in rel opens, or None."""
    cands = []
    if quote == '"':
        cands.append(os.path.normpath(os.path.join(os.path.dirname(rel), target)).replace(os.sep, "/"))
    cands += ["src/" + target, "include/" + target]
    for c in cands:
        if c in known:
            return c
    return None


def find_circles(graph, limit):
    """Elementary circles of graph {node: set(node)}, each starting at its
    smallest node, in sorted order; at most limit (and whether more exist)."""
    circles = []
    nodes = sorted(graph)
    for s in nodes:
        # DFS over nodes > s only, so each circle is found once, from its smallest node.
        stack = [(s, iter(sorted(graph.get(s, ()))))]
        path, on_path = [s], {s}
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                on_path.discard(path.pop())
                continue
            if nxt == s:
                circles.append(path + [s])
                if len(circles) > limit:
                    return circles[:limit], True
            elif nxt > s and nxt not in on_path:
                path.append(nxt)
                on_path.add(nxt)
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
    return circles, False


def reachable_sccs(graph):
    """Nodes on some circle (to skip DFS over the acyclic rest)."""
    index, low, onstack, st, out = {}, {}, set(), [], set()
    counter = [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        st.append(v)
        onstack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in onstack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = st.pop()
                onstack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.update(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def circle_violations(graph, examples, what):
    cyclic = reachable_sccs(graph)
    sub = {v: {w for w in graph[v] if w in cyclic} for v in graph if v in cyclic}
    circles, more = find_circles(sub, MAX_CIRCLES)
    out = []
    for c in circles:
        edges = list(zip(c, c[1:]))
        where = "; ".join(f"{a} -> {b}: {examples[(a, b)][0]}:{examples[(a, b)][1]} "
                          f"#include {examples[(a, b)][2]}" for a, b in edges)
        f, ln, _ = examples[edges[0]]
        out.append(f"{f}:{ln}: {what} include circle {' -> '.join(c)} ({where}): "
                   f"rule: no {what} includes itself through others")
    if more:
        out.append(f"src:1: more than {MAX_CIRCLES} {what} include circles, only the first are listed: "
                   f"rule: no {what} includes itself through others")
    return out


def check(root, listing=False):
    src_files = list_files(root, "src")
    hdr_files = list_files(root, os.path.join("include", "hspmd"))
    violations = []
    texts = {}
    for rel in src_files + hdr_files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            texts[rel] = f.read()

    for rel in src_files:
        text = texts[rel]
        nlines = len(text.splitlines())
        if nlines > MAX_FILE_LINES:
            violations.append(f"{rel}:1: file is {nlines} lines: rule: at most {MAX_FILE_LINES} lines per file")
        functions, classes, problem = measure(text)
        if problem:
            violations.append(f"{rel}:{problem[0]}: braces do not match ({problem[1]}): "
                              f"rule: every file can be measured")
        for name, a, b in functions:
            if listing:
                print(f"{rel}:{a}: function {name} {b - a + 1} lines")
            if b - a + 1 > MAX_FUNCTION_LINES:
                violations.append(f"{rel}:{a}: function {name} is {b - a + 1} lines (to line {b}): "
                                  f"rule: at most {MAX_FUNCTION_LINES} lines per function")
        for name, a, b in sorted(classes, key=lambda c: c[1]):
            if listing:
                print(f"{rel}:{a}: class {name} {b - a + 1} lines")
            if b - a + 1 > MAX_CLASS_LINES:
                violations.append(f"{rel}:{a}: class {name} body is {b - a + 1} lines (to line {b}): "
                                  f"rule: at most {MAX_CLASS_LINES} lines per class/struct body")

    known = set(texts)
    modules = {module_of(r) for r in known} - {None}
    file_graph, file_ex = {r: set() for r in known}, {}
    mod_graph, mod_ex = {m: set() for m in modules}, {}
    for rel in sorted(known):
        text = texts[rel]
        line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        for m in INCLUDE_RE.finditer(text):
            quote, target = m.group(1), m.group(2).strip()
            ln = line_of(line_starts, m.start(2))
            spelled = f'{quote}{target}{">" if quote == "<" else chr(34)}'
            dest = resolve(root, rel, quote, target, known)
            if dest:
                file_graph[rel].add(dest)
                file_ex.setdefault((rel, dest), (rel, ln, spelled))
                b = module_of(dest)
            else:
                parts = target.split("/")
                b = parts[1] if parts[0] == "hspmd" and len(parts) > 2 else parts[0] if len(parts) > 1 else None
                b = b if b in modules else None
            a = module_of(rel)
            if a and b and a != b:
                mod_graph[a].add(b)
                mod_ex.setdefault((a, b), (rel, ln, spelled))
    violations += circle_violations(mod_graph, mod_ex, "module")
    violations += circle_violations(file_graph, file_ex, "file")
    return violations


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    help="the repository (holding src/ and include/hspmd/)")
    ap.add_argument("--list", action="store_true", help="print every function and class measured")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(args.root, "src")):
        print(f"structure_check: {args.root} has no src/ folder", file=sys.stderr)
        return 2
    violations = check(args.root, args.list)
    for v in violations:
        print(v)
    print(f"structure_check: {len(violations)} violation(s)" if violations else "structure_check: ok")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
