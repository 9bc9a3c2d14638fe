#!/usr/bin/env python3
"""Every command quoted in README.md and docs/*.md names flags that exist
(docs/benchmarks.md, "Smoke tests and the docs check").

It reads the fenced code blocks and the inline code spans of each Markdown
file and finds the commands in them:

  hspmd       however spelled (`hspmd`, `./build/src/cli/hspmd`,
              `build/src/cli/hspmd`, any path ending in /hspmd), after
              environment variables (`X=1 hspmd ...`) or a launcher
              (`mpirun -np N hspmd ...`, `/usr/bin/time hspmd ...`): its
              (sub)command must exist and every flag must be listed by that
              (sub)command's `--help` (`hspmd plan compile --help`, ...);
  Python      `python3 PATH.py ...` (any interpreter spelling, or the bare
              path) of a script under bench/, examples/, tests/ or
              scripts/ that uses argparse: every flag must be one its
              `--help` lists, spelled out (argparse would accept a prefix;
              a document should not rely on it). A bare file name
              (`equivalence_test.py`) is looked up under those folders;
  shell       `bash PATH.sh ...` or `PATH.sh ...` of scripts/*.sh and
              examples/*.sh: never run. Its flags must appear in the
              script's header comment (the options it documents), and the
              environment variables set before it must be names the script
              reads.

Placeholders (`M.json`, `[--zero]`, `paper|context`, `...`) are fine: only
tokens that look like flags (`-x`, `--name`, `--name=value`) are checked.
A fenced command whose first word after `hspmd` is not a command fails; in
an inline span such a word is taken for prose (`a running hspmd job`).

usage: docs_check.py [--repo DIR] [--hspmd build/src/cli/hspmd] [--python python3] [--pythonpath build/python]
                     [--list] [FILE.md ...]
Exit 0 when every command checks, 1 otherwise (each problem on one line:
FILE:LINE: the command: what is wrong).
"""
import argparse
import glob
import os
import re
import shlex
import subprocess
import sys

FLAG = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*$")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|", "&"}
PYTHONS = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")
WRAPPERS = {"mpirun", "mpiexec", "time", "/usr/bin/time", "env", "sudo", "timeout", "nohup", "exec"}
SCRIPT_DIRS = ("bench", "examples", "tests", "scripts")


class Checker:
    def __init__(self, repo, hspmd, python, pythonpath):
        self.repo, self.hspmd, self.python, self.pythonpath = repo, hspmd, python, pythonpath
        self.help_cache = {}
        self.script_cache = {}
        self.counts = {"hspmd": 0, "python": 0, "shell": 0}
        self.skipped = []
        self.checked = []

    # ---- hspmd ---------------------------------------------------------
    def hspmd_help(self, words):
        """(flags, subcommands) of `hspmd WORDS --help`, or None when it fails."""
        key = tuple(words)
        if key not in self.help_cache:
            try:
                r = subprocess.run([self.hspmd] + list(words) + ["--help"], capture_output=True, text=True,
                                   timeout=60)
                text = r.stdout + r.stderr
                ok = r.returncode == 0
            except (OSError, subprocess.TimeoutExpired) as e:
                text, ok = str(e), False
            if not ok:
                self.help_cache[key] = None
            else:
                self.help_cache[key] = parse_cli_help(text)
        return self.help_cache[key]

    def check_hspmd(self, toks, strict):
        """toks: the words after the executable."""
        words, i = [], 0
        while True:
            h = self.hspmd_help(words)
            if h is None:
                return [f"`hspmd {' '.join(words)} --help` failed"]
            flags, subs, _ = h
            if subs and i < len(toks) and not toks[i].startswith("-"):
                if toks[i] in subs:
                    words.append(toks[i])
                    i += 1
                    continue
                if strict or words:
                    return [f"`{toks[i]}` is not a command of `{' '.join(['hspmd'] + words)}` "
                            f"(its commands: {', '.join(sorted(subs))})"]
                return None  # prose: "a running hspmd job"
            break
        self.counts["hspmd"] += 1
        name = "hspmd " + " ".join(words)
        rest = toks[i:]
        if words == ["launch"]:  # hspmd launch [flags] script.py [its args]: the script's flags are its own
            for k, t in enumerate(rest):
                if t.endswith(".py"):
                    rest = rest[:k]
                    break
        bad = [t for t in flag_tokens(rest) if t not in flags]
        # A flag the help does not list may switch the command into a mode of its own with its own
        # flags (`hspmd plan search --lengths`): `hspmd WORDS FLAG x --help` then prints a usage line
        # "usage: hspmd WORDS FLAG ...". Without such a mode the command refuses the flag, runs nothing.
        for t in list(bad):
            h = self.hspmd_help(words + [t, "x"])
            if h is not None and h[2].startswith(f"usage: {name.strip()} {t}"):
                flags = h[0]
                name = f"{name.strip()} {t}"
                bad = [u for u in flag_tokens(rest) if u not in flags]
                break
        return [f"{t} is not a flag of `{name.strip()}` (see `{name.strip()} --help`)" for t in bad]

    # ---- Python scripts ------------------------------------------------
    def resolve_script(self, path):
        cand = os.path.normpath(os.path.join(self.repo, path.lstrip("./") if path.startswith("./") else path))
        if os.path.isfile(cand) and os.path.relpath(cand, self.repo).split(os.sep)[0] in SCRIPT_DIRS:
            return cand
        if "/" in path and os.path.isfile(cand):
            return None  # outside the folders it checks
        base = os.path.basename(path)
        hits = [h for d in SCRIPT_DIRS for h in glob.glob(os.path.join(self.repo, d, "**", base), recursive=True)]
        hits = [h for h in hits if "/." not in os.path.relpath(h, self.repo)]
        return hits[0] if len(hits) == 1 else None

    def script_flags(self, script):
        if script not in self.script_cache:
            src = open(script, encoding="utf-8", errors="replace").read()
            if "argparse" not in src or "parse_args" not in src:
                self.script_cache[script] = "no argparse"
            else:
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join(
                    [self.pythonpath, os.path.dirname(script)]
                    + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
                try:
                    r = subprocess.run([self.python, script, "--help"], capture_output=True, text=True,
                                       timeout=120, cwd=self.repo, env=env)
                    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", r.stderr)
                    if r.returncode != 0 and missing and not self.local_module(missing.group(1)):
                        # an optional package this interpreter lacks (torch, transformers): not the
                        # script's fault, and nothing to check its flags against here
                        self.script_cache[script] = f"needs {missing.group(1)}"
                    elif r.returncode != 0:
                        self.script_cache[script] = ("error", (r.stderr or r.stdout).strip()[-300:])
                    else:
                        self.script_cache[script] = parse_argparse_help(r.stdout)
                except (OSError, subprocess.TimeoutExpired) as e:
                    self.script_cache[script] = ("error", str(e))
        return self.script_cache[script]

    def local_module(self, name):
        """A module this repository provides: a script's sibling, or the hspmd module when the build made
        it (a build without the Python module cannot run the scripts that import it: not checked)."""
        top = name.split(".")[0]
        if top == "hspmd":
            return os.path.exists(os.path.join(self.pythonpath, "hspmd"))
        return any(glob.glob(os.path.join(self.repo, d, "**", top + ".py"), recursive=True)
                                     for d in SCRIPT_DIRS)

    def check_python(self, path, rest):
        script = self.resolve_script(path)
        if script is None:
            self.skipped.append(f"{path}: not a script of this repository")
            return None
        flags = self.script_flags(script)
        rel = os.path.relpath(script, self.repo)
        if isinstance(flags, str):
            self.skipped.append(f"{rel}: {flags}")
            return None
        if isinstance(flags, tuple):
            return [f"`{rel} --help` failed: {flags[1]}"]
        self.counts["python"] += 1
        bad = [t for t in flag_tokens(rest) if t not in flags]
        return [f"{t} is not a flag of {rel} (see `python3 {rel} --help`)" for t in bad]

    # ---- shell scripts -------------------------------------------------
    def check_shell(self, path, rest, env_names):
        p = path[2:] if path.startswith("./") else path
        script = os.path.join(self.repo, p)
        rel = os.path.relpath(script, self.repo) if os.path.isfile(script) else None
        if rel is None or rel.split(os.sep)[0] not in ("scripts", "examples"):
            self.skipped.append(f"{path}: not a script of this repository")
            return None
        self.counts["shell"] += 1
        src = open(script, encoding="utf-8", errors="replace").read()
        header = shell_header(src)
        out = []
        for t in flag_tokens(rest):
            if not re.search(r"(?<![\w-])" + re.escape(t) + r"(?![\w-])", header):
                out.append(f"{t} is not an option {rel} documents (its header comment)")
        for v in env_names:
            if not re.search(r"\b" + re.escape(v) + r"\b", src):
                out.append(f"{v}= is not a variable {rel} reads")
        return out

    # ---- one command ---------------------------------------------------
    def check_command(self, toks, strict):
        """Problems of one command (a list of words), or None when it is not one we check."""
        env_names, i = [], 0
        while i < len(toks) and ENV.match(toks[i]):
            env_names.append(toks[i].split("=", 1)[0])
            i += 1
        # launchers: skip to the first word that is a command we know
        while i < len(toks):
            t = toks[i]
            if is_hspmd(t):
                return self.check_hspmd(toks[i + 1:], strict)
            if PYTHONS.match(t):
                j = i + 1
                while j < len(toks) and toks[j].startswith("-"):
                    if toks[j] in ("-m", "-c"):
                        return None  # a module or inline code: not a script of ours
                    j += 1
                if j < len(toks) and toks[j].endswith(".py"):
                    return self.check_python(toks[j], toks[j + 1:])
                return None
            if t in ("bash", "sh") and i + 1 < len(toks) and toks[i + 1].endswith(".sh"):
                return self.check_shell(toks[i + 1], toks[i + 2:], env_names)
            if t.endswith(".sh") and ("/" in t):
                return self.check_shell(t, toks[i + 1:], env_names)
            if t.endswith(".py") and i == 0:
                return self.check_python(t, toks[i + 1:])
            if t in WRAPPERS or os.path.basename(t) in WRAPPERS:
                i += 1
                while i < len(toks) and (toks[i].startswith("-") or re.match(r"^\d+$", toks[i])
                                         or (i > 0 and toks[i - 1] in ("-np", "-n", "-N", "--np"))):
                    i += 1
                continue
            return None
        return None


def is_hspmd(t):
    return t == "hspmd" or (t.endswith("/hspmd") and not t.startswith("-"))


def flag_tokens(toks):
    out = []
    for t in toks:
        t = t.strip("[](){},")
        if t.startswith("--") and "=" in t:
            t = t.split("=", 1)[0]
        if FLAG.match(t):
            out.append(t)
    return out


def parse_cli_help(text):
    """hspmd's help: flags at the start of option lines ("  --model STR  ..."),
    aliases written "(also -o)", commands under "commands:" / "subcommands:"."""
    flags, subs, in_subs, usage = {"--help", "-h"}, set(), False, ""
    for line in text.splitlines():
        if line.startswith("usage:") and not usage:
            usage = line.strip()
        if re.match(r"^(sub)?commands:\s*$", line.strip()):
            in_subs = True
            continue
        if in_subs:
            m = re.match(r"^\s{2,}([a-z][a-z0-9_-]*)\s{2,}\S", line)
            if m:
                subs.add(m.group(1))
                continue
            if line.strip():
                in_subs = False
        m = re.match(r"^\s+((?:--?[A-Za-z][\w-]*)(?:\s*,\s*--?[A-Za-z][\w-]*)*)", line)
        if m:
            flags.update(re.findall(r"--?[A-Za-z][\w-]*", m.group(1)))
        flags.update(re.findall(r"\balso (-{1,2}[A-Za-z][\w-]*)", line))
        if line.startswith("usage:"):
            flags.update(f for f in re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", line))
    return flags, subs, usage


def parse_argparse_help(text):
    """argparse's help: the invocation part of each option line."""
    flags = {"-h", "--help"}
    for line in text.splitlines():
        m = re.match(r"^\s{1,8}(-.*)$", line)
        if not m:
            continue
        inv = re.split(r"\s{2,}", m.group(1))[0]
        flags.update(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", inv))
    return flags


def shell_header(src):
    """The comment block at the top of a shell script (after the shebang)."""
    out = []
    for line in src.splitlines():
        if line.startswith("#!"):
            continue
        if line.startswith("#"):
            out.append(line)
        elif out or line.strip():
            break
    return "\n".join(out)


def split_commands(line):
    """Words of each command on a line: comments dropped, split at && || ; | (not inside [ ])."""
    line = re.sub(r"(^|\s)#.*$", "", line)
    try:
        words = shlex.split(line, posix=True)
    except ValueError:
        words = line.split()
    cmds, cur, depth = [], [], 0
    for w in words:
        if w in SEPARATORS and depth == 0:
            cmds.append(cur)
            cur = []
            continue
        depth += w.count("[") - w.count("]")
        depth = max(depth, 0)
        if w.startswith(">") or w.startswith("2>") or w.startswith("<"):
            continue
        cur.append(w)
    cmds.append(cur)
    return [c for c in cmds if c]


def commands_of(path):
    """(line, text, words, strict) for every command-like piece of a Markdown file."""
    text = open(path, encoding="utf-8").read()
    lines = text.split("\n")
    out, fenced = [], []
    in_block, start, buf = False, 0, []
    for n, l in enumerate(lines, 1):
        if l.strip().startswith("```"):
            if in_block:
                fenced.append((start, buf))
                in_block = False
            else:
                in_block, start, buf = True, n + 1, []
            continue
        if in_block:
            buf.append(l)
    for start, buf in fenced:
        k = 0
        while k < len(buf):
            first, joined = start + k, buf[k]
            while joined.rstrip().endswith("\\") and k + 1 < len(buf):
                k += 1
                joined = joined.rstrip()[:-1] + " " + buf[k].strip()
            k += 1
            for words in split_commands(joined):
                out.append((first, joined.strip(), words, True))
    # inline code spans outside fenced blocks (a span may wrap lines, not paragraphs)
    masked = []
    in_block = False
    for l in lines:
        if l.strip().startswith("```"):
            in_block = not in_block
            masked.append("")
            continue
        masked.append("" if in_block else l)
    body = "\n".join(masked)
    for m in re.finditer(r"(`+)(?!`)((?:(?!\1).)+?)\1", body, flags=re.S):
        span = m.group(2)
        if re.search(r"\n\s*\n", span):
            continue
        span = re.sub(r"\s*\n\s*", " ", span).strip()
        line = body.count("\n", 0, m.start()) + 1
        for words in split_commands(span):
            out.append((line, span, words, False))
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo_default = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=repo_default, help="the repository root")
    ap.add_argument("--hspmd", default=None, help="the hspmd executable (default REPO/build/src/cli/hspmd)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs the scripts' --help")
    ap.add_argument("--pythonpath", default=None,
                    help="where the hspmd module is built (default REPO/build/python)")
    ap.add_argument("--list", action="store_true", help="print every command checked")
    ap.add_argument("files", nargs="*", help="Markdown files (default: README.md and docs/*.md)")
    a = ap.parse_args()
    repo = os.path.abspath(a.repo)
    hspmd = a.hspmd or os.path.join(repo, "build", "src", "cli", "hspmd")
    if not os.access(hspmd, os.X_OK):
        sys.exit(f"docs_check: no hspmd executable at {hspmd}")
    files = a.files or [os.path.join(repo, "README.md")] + sorted(glob.glob(os.path.join(repo, "docs", "*.md")))
    ck = Checker(repo, hspmd, a.python, os.path.abspath(a.pythonpath or os.path.join(repo, "build", "python")))
    problems, n = [], 0
    for f in files:
        rel = os.path.relpath(f, repo) if os.path.abspath(f).startswith(repo + os.sep) else f
        for line, text, words, strict in commands_of(f):
            got = ck.check_command(words, strict)
            if got is None:
                continue
            n += 1
            if a.list:
                print(f"{rel}:{line}: {'ok ' if not got else 'BAD'} {' '.join(words)}")
            for g in got:
                problems.append(f"{rel}:{line}: `{text}`: {g}")
    for p in problems:
        print(p)
    c = ck.counts
    print(f"docs_check: {n} commands in {len(files)} files ({c['hspmd']} hspmd, {c['python']} Python scripts, "
          f"{c['shell']} shell scripts); {len(problems)} problem(s); "
          f"{len(set(ck.skipped))} not checked ({'; '.join(sorted(set(ck.skipped))) or 'none'})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
