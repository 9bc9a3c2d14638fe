#!/usr/bin/env python3
"""The backend seam's check: no code above src/kernels/ touches tensor bytes.

Tensor elements are read and written by kernels (src/kernels/, dispatched per
device) and handed to communication libraries by the communicator backends.
Everything else reaches them through a kernel, or through NDArray::host_data /
host_raw_data for arrays that must live in host memory (batches built on the
host, files, checkers), which throw for an array on another device. This
script fails, naming file and line, when a file outside the places below
uses a raw accessor (data<T>(), raw_data()), a byte copy or fill (memcpy,
memmove, memset), std::byte staging, or a CPU kernel header.

Allowed:
  src/kernels/**                           the kernels themselves
  src/core/ndarray.cc, include/hspmd/core/ the accessors and host conveniences
  src/comm/{communicator,mpi_communicator,shadow,staged_communicator,nccl_communicator}.cc
                                           communicator backends (buffers to the library)
  src/core/device_runtime.cc               copy_bytes of the CPU device runtime (memmove)
  src/io/**                                memcpy/memset/std::byte on host file bytes
                                           (tensor bytes only through host_raw_data)

usage: scripts/lint_tensor_bytes.py [ROOT]      (exit 1 on a violation)
       scripts/lint_tensor_bytes.py --self-test (checks that the rules catch each form)
"""
import os
import re
import sys

RAW_ACCESS = re.compile(r"(?<![\w])(data\s*<\s*\w+\s*>\s*\(|raw_data\s*\()")
BYTE_OPS = re.compile(r"\b(memcpy|memmove|memset)\s*\(|std::byte\b")
CPU_KERNELS = re.compile(r'#\s*include\s*"kernels/cpu/')

KERNELS = ("src/kernels/",)
ACCESS_OK = ("src/core/ndarray.cc", "include/hspmd/core/", "src/comm/communicator.cc",
             "src/comm/mpi_communicator.cc", "src/comm/shadow.cc", "src/comm/staged_communicator.cc",
             "src/comm/nccl_communicator.cc", "src/core/device_runtime.cc")
BYTES_OK = ACCESS_OK + ("src/io/",)


def code_of(line):
    """The line without its // comment and string literals (roughly)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    i = line.find("//")
    return line if i < 0 else line[:i]


def violations(rel, text):
    if rel.startswith(KERNELS):
        return []
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if CPU_KERNELS.search(line):
            out.append((n, "includes a CPU kernel header (call the dispatched kernel)"))
        code = code_of(line)
        if not rel.startswith(ACCESS_OK) and RAW_ACCESS.search(code):
            out.append((n, "reads tensor memory directly (use a kernel, or host_data for a host array)"))
        if not rel.startswith(BYTES_OK) and BYTE_OPS.search(code):
            out.append((n, "copies or fills bytes (use kernels::copy/copy_block/fill)"))
    return out


def lint(root):
    found = []
    for top in ("src", "include"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith((".h", ".cc", ".cu", ".cuh", ".hpp", ".cpp")):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for n, why in violations(rel, fh.read()):
                        found.append(f"{rel}:{n}: {why}")
    return found


def self_test():
    bad = {
        "src/ops/x.cc": ["  float* p = a.data<float>();", "  void* p = a->raw_data();",
                         "  std::memcpy(d, s, n);", "  std::vector<std::byte> b;",
                         '#include "kernels/cpu/cpu.h"'],
        "src/io/x.cc": ["  char* p = static_cast<char*>(t.raw_data());"],
        "src/train/x.cc": ["  memset(p, 0, n);", "  int32_t* v = ids.data<int32_t>() + 4;"],
    }
    good = {
        "src/ops/x.cc": ["  float* p = a.host_data<float>();", "  // a.data<float>() in a comment",
                         '  fail("memcpy(")', "  void* p = a.host_raw_data(\"x\");", "  x.data(); v.data();"],
        "src/io/x.cc": ["  std::memcpy(&word, p + i, 8);"],
        "src/kernels/cpu/x.cc": ["  float* p = a.data<float>(); std::memcpy(d, s, n);"],
        "src/comm/mpi_communicator.cc": ["  MPI_Isend(a.raw_data(), n);"],
    }
    ok = True
    for rel, lines in bad.items():
        for line in lines:
            if not violations(rel, line):
                print(f"self-test: not caught in {rel}: {line.strip()}")
                ok = False
    for rel, lines in good.items():
        for line in lines:
            if violations(rel, line):
                print(f"self-test: wrongly flagged in {rel}: {line.strip()}")
                ok = False
    print("self-test:", "passed" if ok else "FAILED")
    return 0 if ok else 1


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test":
        return self_test()
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = lint(root)
    for f in found:
        print(f)
    if found:
        print(f"lint_tensor_bytes: {len(found)} place(s) above src/kernels/ touch tensor bytes "
              "(docs/architecture.md, 'The backend seam')")
        return 1
    print("lint_tensor_bytes: no code above src/kernels/ touches tensor bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
