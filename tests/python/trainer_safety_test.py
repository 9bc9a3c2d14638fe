"""The Python Trainer as safe as `hspmd train` (docs/reliability.md, "The
Python Trainer"), in one process on copies of the tiny Llama's config and a
token file of 20,000 random ids:

1. an output (log=, save=, trace=, op_times=, dump_grads=) that is an input
   (the data, the model's config; by name or through a symbolic link) or
   another output is one hspmd.Error naming both, before anything is written;
   the inputs stay byte for byte;

Each error is one line."""
import glob
import json
import os
import shutil
import sys
import tempfile

import numpy

import hspmd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
RUN = dict(seq_len=32, global_batch=4, micro_batches=1, threads=1, lr=1e-2)


def raises(fn, *parts):
    try:
        fn()
    except hspmd.Error as e:
        msg = str(e)
        assert "\n" not in msg, f"not one line: {msg!r}"
        for p in parts:
            assert p in msg, f"{p!r} not in {msg!r}"
        return msg
    raise AssertionError(f"no hspmd.Error (expected {parts!r})")


def trainer(m, d, steps=4, **kw):
    return hspmd.Trainer(m, None, d, steps=steps, **dict(RUN, **kw))


def snapshot(paths):
    out = {}
    for p in paths:
        with open(p, "rb") as f:
            out[p] = f.read()
    return out


def check_outputs_apart(m, d, tmp):
    """1. No output is an input or another output."""
    inputs = snapshot([m, d])
    link = os.path.join(tmp, "link-to-data.bin")
    os.symlink(d, link)
    cases = [(flag, target, what) for flag in ("log", "save", "trace", "op_times", "dump_grads")
             for target, what in ((d, "--data"), (m, "--model"))]
    cases.append(("log", link, "--data"))
    for flag, target, what in cases:
        def run():
            t = trainer(m, d, steps=1, **{flag: target})
            t.train()  # before the fix: the input is written over here (or already at setup)
        raises(run, f"--{flag.replace('_', '-')} {target}: is the same file as {what} ",
               "writing it would destroy that input")
        assert snapshot([m, d]) == inputs, f"{flag}={target}: an input changed"
    out = os.path.join(tmp, "both.json")
    raises(lambda: trainer(m, d, steps=1, log=out, trace=out), f"--trace {out}: is the same file as --log {out}",
           "another output")
    assert not os.path.exists(out), "a refused run wrote an output"


def main():
    parts = sys.argv[1:] or ["apart"]  # a part alone: e.g. `... load`
    with tempfile.TemporaryDirectory() as tmp:
        m = os.path.join(tmp, "m.json")
        shutil.copy(MODEL, m)
        d = os.path.join(tmp, "d.bin")
        numpy.random.default_rng(0).integers(0, 256, 20000, dtype=numpy.uint32).astype("<u4").tofile(d)
        checks = {"apart": check_outputs_apart}
        for part in parts:
            checks[part](m, d, tmp)
    print("ok")


if __name__ == "__main__":
    main()
