#!/usr/bin/env python3
"""Builds a heavy-tailed code corpus from the Python standard library that
Debian installs (/usr/lib/python3.X), one document per source file, tokenized
by `hspmd tokenize` into a token file, plus a provenance file beside it.

The file list is deterministic for a given Debian python3 package: every
regular, non-empty *.py file of the standard library that belongs to
libpython3.X-minimal or libpython3.X-stdlib (the two packages python3 always
installs; the optional python3-distutils, python3-lib2to3, python3.X-venv and
libpython3.X-dev are left out), outside the directories test, tests,
idle_test, __pycache__, site-packages and dist-packages. Their versions are
recorded in the provenance. When
they hold more than --max-mb MiB, files are taken in the order of the SHA-256
of their relative path (an order that does not favour any package) until the
next one would pass the cap. Documents are written in sorted path order.

No network. The files are under the Python Software Foundation License
(see the provenance and docs/data.md, "A heavy-tailed corpus").

usage: scripts/make_code_corpus.py [--output out/code_corpus.bin] [--hspmd PATH]
           [--model examples/tiny-llama/config.json] [--stdlib DIR] [--max-mb 16]
"""
import argparse
import glob
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIPPED_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}
LICENSE = ("Python Software Foundation License Version 2 (PSF-2.0): the Python standard library "
           "as Debian ships it; full text in LICENSE.txt of the standard library directory and in "
           "/usr/share/doc/<package>/copyright, which also names the few files under other "
           "permissive licenses")


def fail(message):
    sys.exit(f"make_code_corpus: {message}")


def default_stdlib():
    """The newest /usr/lib/python3.X that holds os.py (Debian's, not a pyenv or /usr/local one)."""
    found = [d for d in glob.glob("/usr/lib/python3.*") if os.path.isfile(os.path.join(d, "os.py"))]
    if not found:
        fail("no /usr/lib/python3.X/os.py (install Debian's python3 package) or give --stdlib")
    return max(found, key=lambda d: [int(x) for x in re.findall(r"\d+", os.path.basename(d))])


def source_files(stdlib):
    """(relative path, bytes) of every candidate file, sorted by path."""
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not os.path.islink(os.path.join(root, d)))
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.endswith(".py") and not os.path.islink(path) and os.path.isfile(path):
                size = os.path.getsize(path)
                if size > 0:
                    files.append((os.path.relpath(path, stdlib), size))
    return sorted(files)


def capped(files, max_bytes):
    """The files kept under the cap, in sorted path order."""
    total, kept = 0, []
    for rel, size in sorted(files, key=lambda f: hashlib.sha256(f[0].encode()).hexdigest()):
        if total + size > max_bytes:
            break
        total += size
        kept.append((rel, size))
    return sorted(kept)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def owners(paths):
    """{path: set of Debian packages that own it}, from dpkg -S."""
    try:
        out = subprocess.run(["dpkg", "-S"] + paths, capture_output=True, text=True).stdout
    except FileNotFoundError:
        fail("dpkg is missing: the file list is defined by Debian's packages")
    owned = {}
    for line in out.splitlines():
        names, _, path = line.partition(": ")
        owned[path] = {n.strip().split(":")[0] for n in names.split(",")}
    return owned


def package_versions(names):
    versions = {}
    for name in sorted(names):
        r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True)
        versions[name] = r.stdout.strip() if r.returncode == 0 else "unknown"
    return versions


def packaged(stdlib, files):
    """The files owned by libpython3.X-minimal or -stdlib, and those packages' versions."""
    version = os.path.basename(stdlib).replace("python", "")
    wanted = {f"libpython{version}-minimal", f"libpython{version}-stdlib"}
    owned = owners([os.path.join(stdlib, rel) for rel, _ in files])
    kept = [f for f in files if owned.get(os.path.join(stdlib, f[0]), set()) & wanted]
    return kept, package_versions(wanted)


def python_version(stdlib):
    exe = os.path.join("/usr/bin", os.path.basename(stdlib))  # /usr/bin/python3.X
    if not os.access(exe, os.X_OK):
        return "unknown"
    return subprocess.run([exe, "-c", "import sys; print(sys.version.split()[0])"],
                          capture_output=True, text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default=os.path.join(REPO, "out", "code_corpus.bin"))
    ap.add_argument("--hspmd", default=os.path.join(REPO, "build", "src", "cli", "hspmd"))
    ap.add_argument("--model", default=os.path.join(REPO, "examples", "tiny-llama", "config.json"),
                    help="config.json whose eos_token_id ends each document")
    ap.add_argument("--stdlib", help="standard library directory (default: the newest /usr/lib/python3.X)")
    ap.add_argument("--max-mb", type=float, default=16.0, help="cap on the text, MiB (default 16)")
    args = ap.parse_args()
    stdlib = os.path.abspath(args.stdlib or default_stdlib())
    if not os.path.isfile(args.hspmd):
        fail(f"{args.hspmd} does not exist (build hspmd first: bash scripts/build.sh, or give --hspmd)")
    everything, packages = packaged(stdlib, source_files(stdlib))
    files = capped(everything, int(args.max_mb * (1 << 20)))
    if not files:
        fail(f"no .py files under {stdlib}")
    paths = [os.path.join(stdlib, rel) for rel, _ in files]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    r = subprocess.run([args.hspmd, "tokenize", "--model", args.model, "--output", args.output] + paths,
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"hspmd tokenize failed: {r.stderr.strip()}")
    write_provenance(args, stdlib, files, len(everything), packages)
    text_bytes = sum(size for _, size in files)
    print(f"make_code_corpus: {len(files)} of {len(everything)} files, {text_bytes} bytes of text "
          f"-> {args.output} ({os.path.getsize(args.output) // 4} tokens)")


def write_provenance(args, stdlib, files, candidates, packages):
    command = "python3 scripts/make_code_corpus.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    with open(args.model) as f:
        eos = json.load(f).get("eos_token_id")
    provenance = {
        "what": "Python standard library source files, one document per file, byte-level tokens "
                "(hspmd tokenize), each document ended by eos_token_id",
        "command": command.strip(),
        "stdlib": stdlib,
        "python": python_version(stdlib),
        "debian_packages": packages,
        "license": LICENSE,
        "selection": {"rule": "regular non-empty *.py files of the packages above; skipped directories: "
                              + ", ".join(sorted(SKIPPED_DIRS)) + "; no symbolic links; "
                              "under the cap, taken in SHA-256(relative path) order",
                      "max_mb": args.max_mb, "candidates": candidates, "kept": len(files)},
        "eos_token_id": eos,
        "text_bytes": sum(size for _, size in files),
        "tokens": os.path.getsize(args.output) // 4,
        "token_file_sha256": sha256_of(args.output),
        "files": [{"path": rel, "bytes": size, "sha256": sha256_of(os.path.join(stdlib, rel))}
                  for rel, size in files],
    }
    with open(os.path.splitext(args.output)[0] + ".provenance.json", "w") as f:
        json.dump(provenance, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
