"""Integers from Python go through the one integer-range check the CLI's
flags go through (hspmd/core/int_range.h; issue 39 item 9): a value that an
int cannot hold is refused with hspmd.Error naming the argument and the
range, never cut to 32 bits (plan_search(global_batch=4294967304) planned for
8; compile_plan(world=4294967300) raised a raw pybind11 TypeError)."""
import json
import os
import sys
import tempfile

import hspmd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
STRATEGY = os.path.join(ROOT, "examples", "python", "tiny_hetero_4.json")


def error_of(fn):
    try:
        fn()
    except hspmd.Error as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 -- any other type is a failure, reported by name
        return f"{type(e).__name__}: {e}"
    return None


def main():
    failures = []

    def expect(name, fn, needle):
        msg = error_of(fn)
        ok = msg is not None and needle in msg and "\n" not in msg and not msg.startswith(("TypeError", "Overflow"))
        print(f"{name:40s} {'ok' if ok else 'FAIL'}: {msg}")
        if not ok:
            failures.append(name)

    tmp = tempfile.mkdtemp()
    cluster = os.path.join(tmp, "cluster.json")
    with open(cluster, "w") as f:
        json.dump({"catalog": {"cpu": {"tflops": 1, "memory_gib": 16}}, "nodes": [{"type": "cpu", "ranks": [0, 3]}]}, f)

    expect("compile_plan world 2^32+4", lambda: hspmd.compile_plan(MODEL, STRATEGY, 4294967300),
           "[python] compile_plan: world 4294967300 is outside [1, 1048576]")
    expect("compile_plan world 2^70", lambda: hspmd.compile_plan(MODEL, STRATEGY, 2 ** 70),
           "[python] compile_plan: world 1180591620717411303424 is outside [1, 1048576]")
    expect("compile_plan world -1", lambda: hspmd.compile_plan(MODEL, STRATEGY, -1), "world -1 is outside")
    expect("compile_plan world 4.0", lambda: hspmd.compile_plan(MODEL, STRATEGY, 4.0),
           "world must be an integer, got float 4.0")
    expect("compile_plan seq_len 2^40", lambda: hspmd.compile_plan(MODEL, STRATEGY, 4, seq_len=2 ** 40),
           "seq_len 1099511627776 is outside")
    expect("plan_search global_batch 2^32+8", lambda: hspmd.plan_search(MODEL, cluster, 4294967304, 16),
           "--global-batch 4294967304 is outside [1, ")
    expect("plan_search global_batch 10^15", lambda: hspmd.plan_search(MODEL, cluster, 10 ** 15, 16),
           "--global-batch 1000000000000000 is outside [1, ")
    expect("plan_search top 2^32+1", lambda: hspmd.plan_search(MODEL, cluster, 8, 16, top=2 ** 32 + 1),
           "--top 4294967297 is outside")
    # The values that fit still work.
    plan = hspmd.compile_plan(MODEL, STRATEGY, 4)
    if plan.world_size != 4:
        failures.append(f"compile_plan(world=4) gave world_size {plan.world_size}")
    if failures:
        sys.exit("FAILED: " + ", ".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
