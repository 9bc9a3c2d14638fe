#!/usr/bin/env python3
"""The CPU kernel variants (src/kernels/cpu/variant.h) keep to their rules,
read from the compiled objects:

1. one definition: every symbol a variant object defines globally is in
   the variant's namespace (hspmd::kernels::cpu::<variant>), or is a weak
   copy (an inline function or template instantiation shared with other
   objects) whose code is baseline x86-64: the linker keeps one copy of a
   weak symbol for every object, so an AVX-512 copy would run on an AVX2 CPU
   (SIGILL) and an AVX2 copy on any CPU;
2. no start-up code: the AVX2 and AVX-512 objects have no static
   initializers (.init_array), which would run before the dispatch chose a
   variant;
3. the target pragma works: the baseline objects use no AVX register, the
   AVX2 ones use ymm and no zmm, the AVX-512 ones use zmm.

--self-test --cxx CXX compiles an object that breaks all three rules and
checks that each is reported.

usage: cpu_variants_check.py --variant NAME OBJECT... [--variant NAME OBJECT...]"""
import re
import subprocess
import sys

# Instructions that baseline x86-64 (SSE2) does not have: every VEX/EVEX
# encoding starts with 'v'; BMI1/2, MOVBE and LZCNT are integer ones that
# x86-64-v3 code may use. (TZCNT is left out: GCC writes `rep bsf` for
# generic x86-64, which objdump shows as tzcnt and old CPUs run as bsf.)
ABOVE_BASELINE = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx",
                  "sarx", "shlx", "shrx", "movbe", "lzcnt"}
AVX_REGISTER = re.compile(r"%([yz]mm\d+|k[0-7])\b")
LEVEL_REGS = {"baseline": set(), "avx2": {"y"}, "avx512": {"z"}}


def parse_args(argv):
    variants, current = {}, None
    it = iter(argv)
    for a in it:
        if a == "--variant":
            current = next(it)
            variants[current] = []
        elif current is None:
            sys.exit(f"usage: {__doc__.splitlines()[-1]}")
        else:
            variants[current].extend(x for x in a.split(";") if x)
    if not variants:
        sys.exit(f"usage: {__doc__.splitlines()[-1]}")
    return variants


def run(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def disassembly(obj):
    """{mangled symbol: [instruction lines]} for every function in `obj`."""
    funcs, cur = {}, None
    for line in run(["objdump", "-d", "--no-show-raw-insn", obj]).splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
        elif cur is not None and "\t" in line:
            cur.append(line.split("\t", 1)[1].strip())
    return funcs


def above_baseline(instructions):
    for ins in instructions:
        mnemonic = ins.split()[0] if ins.split() else ""
        if mnemonic.startswith("v") or mnemonic in ABOVE_BASELINE or AVX_REGISTER.search(ins):
            return ins
    return None


def demangle(names):
    out = run(["c++filt"] + names).splitlines() if names else []
    return dict(zip(names, out))


def check(variant, objects):
    errors = []
    prefix = f"hspmd::kernels::cpu::{variant}::"
    regs = set()
    for obj in objects:
        defined = []
        for line in run(["nm", obj]).splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBRWVui":
                defined.append((parts[2], parts[1]))
        names = demangle([n for n, _ in defined])
        code = disassembly(obj)
        for mangled, kind in defined:
            plain = names.get(mangled, mangled)
            if plain.startswith(prefix) or (" " in plain and prefix in plain.split("(")[0]):
                continue
            if kind not in "WVu":
                errors.append(f"{obj}: {plain} is a strong symbol outside namespace {prefix[:-2]} "
                              f"(two variants would define it)")
                continue
            bad = above_baseline(code.get(mangled, []))
            if bad:
                errors.append(f"{obj}: the weak (shared) copy of {plain} holds '{bad}', above baseline x86-64: "
                              f"include what defines it before kernels/cpu/variant.h, or put it in the "
                              f"variant's namespace")
        if variant != "baseline" and ".init_array" in run(["objdump", "-h", obj]):
            errors.append(f"{obj}: has static initializers (.init_array): {variant} code would run at start-up, "
                          f"before the dispatch chose a variant")
        for ins_list in code.values():
            for ins in ins_list:
                for r in AVX_REGISTER.findall(ins):
                    regs.add(r[0])
    want = LEVEL_REGS.get(variant)
    if want is not None:
        used = regs & {"y", "z"}
        if variant == "baseline" and used:
            errors.append(f"baseline objects use {sorted(used)}mm registers")
        if variant == "avx2" and ("y" not in used or "z" in used):
            errors.append(f"avx2 objects: ymm used {'y' in used}, zmm used {'z' in used} (want ymm, no zmm)")
        if variant == "avx512" and "z" not in used:
            errors.append("avx512 objects use no zmm register: the target pragma did not apply")
    return errors


BAD_SOURCE = r"""
#pragma GCC target("arch=x86-64-v4")
inline __attribute__((noinline)) void shared_loop(float* a, int n) { for (int i = 0; i < n; ++i) a[i] = a[i] * 3 + 1; }
struct G { G() { static float x[64]; shared_loop(x, 64); } } g;
namespace hspmd::kernels::cpu::avx512 { void k(float* a, int n) { shared_loop(a, n); } }
"""


def self_test(cxx):
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "bad.cc"), os.path.join(d, "bad.o")
        with open(src, "w") as f:
            f.write(BAD_SOURCE)
        subprocess.run([cxx, "-O3", "-c", src, "-o", obj], check=True)
        errors = check("avx512", [obj])
    want = ["weak (shared) copy of shared_loop", "g is a strong symbol", "static initializers"]
    missed = [w for w in want if not any(w in e for e in errors)]
    for e in errors:
        print("reported:", e)
    if missed:
        sys.exit(f"FAIL: the check missed {missed}")
    print("self-test: all three rules caught")


def main():
    if sys.argv[1:2] == ["--self-test"]:
        return self_test(sys.argv[3] if sys.argv[2:3] == ["--cxx"] else "c++")
    variants = parse_args(sys.argv[1:])
    errors = []
    for v, objs in variants.items():
        if not objs:
            errors.append(f"variant {v}: no objects given")
        e = check(v, objs)
        print(f"variant {v}: {len(objs)} objects, {'OK' if not e else f'{len(e)} problems'}")
        errors += e
    for e in errors:
        print("FAIL:", e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
