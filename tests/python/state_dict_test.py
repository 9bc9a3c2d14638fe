"""Trainer.load_state_dict: the weights of run A (state_dict(), after 3
steps) loaded into a fresh Trainer B give B exactly those weights, and a round
trip load_state_dict -> state_dict is exact. Loaded before the first step they
train as `hspmd train --init` with the same weights does, bit for bit: in one
process and on 4 MPI ranks under the asymmetric tiny_hetero_4.json (every rank
gives the full arrays, each keeps its slices). A wrong shape, a missing or
unknown name, a NaN or a float64 array is one hspmd.Error naming the tensor,
and the weights stay as they were."""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy

from safetensors_util import write_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
STRATEGY = os.path.join(ROOT, "examples", "python", "tiny_hetero_4.json")
TRAIN = dict(seq_len=64, lr=3e-3, lr_schedule="cosine", warmup_steps=2, weight_decay=0.1, clip_grad=1.0, threads=1)
FLAGS = ["--seq-len", "64", "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "2", "--weight-decay",
         "0.1", "--clip-grad", "1.0", "--threads", "1", "--quiet"]
FIELDS = ("step", "loss", "grad_norm", "lr", "tokens")
# HSPMD_TEST_DEVICE=cpu:1 (the device test double) or cuda runs every Trainer
# and CLI run on that device.
DEVICE = os.environ.get("HSPMD_TEST_DEVICE", "cpu")
TRAIN["device"] = DEVICE
FLAGS += ["--device", DEVICE]


def same(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: names {sorted(set(a) ^ set(b))}"
    for name in a:
        assert a[name].dtype == b[name].dtype == numpy.float32, (what, name, a[name].dtype, b[name].dtype)
        assert numpy.array_equal(a[name], b[name]), f"{what}: {name} differs"


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def worker(a):
    """One rank under mpirun: a fresh Trainer (seed 1) given the weights of
    a.weights, trained 3 steps; its log written to a.log."""
    import hspmd
    weights = dict(numpy.load(a.weights))
    t = hspmd.Trainer(MODEL, STRATEGY, a.data, steps=3, seed=1, log=a.log, **TRAIN)
    t.load_state_dict(weights)
    same(t.state_dict(), weights, f"rank {t.rank}: after load_state_dict")
    t.train()


def expect_error(trainer, weights, want):
    import hspmd
    before = trainer.state_dict()
    try:
        trainer.load_state_dict(weights)
    except hspmd.Error as e:
        assert want in str(e) and "\n" not in str(e), f"expected '{want}' in: {e}"
    else:
        raise AssertionError(f"accepted weights that should fail with '{want}'")
    same(trainer.state_dict(), before, f"after the refused load ({want})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd")
    ap.add_argument("--mpirun", default="")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--data")
    ap.add_argument("--weights")
    ap.add_argument("--log")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    import hspmd
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    one = dict(global_batch=8, micro_batches=2)
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "corpus.bin")
        corpus = sorted(glob.glob(os.path.join(ROOT, "data", "corpus", "*.txt")))
        subprocess.run([a.hspmd, "tokenize", "--model", MODEL, "--output", data, *corpus], check=True,
                       capture_output=True)
        run_a = hspmd.Trainer(MODEL, None, data, steps=3, seed=0, **one, **TRAIN)
        run_a.train()
        weights = run_a.state_dict()

        # A's weights into a fresh B: B holds exactly them; a round trip is exact.
        b = hspmd.Trainer(MODEL, None, data, steps=3, seed=1, log=os.path.join(d, "b.jsonl"), **one, **TRAIN)
        assert not all(numpy.array_equal(v, weights[k]) for k, v in b.state_dict().items()), "B starts as A ends"
        b.load_state_dict(weights)
        same(b.state_dict(), weights, "state_dict after load_state_dict")
        back = b.state_dict()
        b.load_state_dict(back)
        same(b.state_dict(), back, "round trip")

        # Bad weights: one line naming the tensor; B unchanged.
        name = "model.layers.0.self_attn.q_proj.weight"
        bad_shape = dict(weights, **{name: weights[name][:, :-1]})
        missing = {k: v for k, v in weights.items() if k != name}
        nan = dict(weights, **{name: weights[name].copy()})
        nan[name][1, 2] = numpy.nan
        f64 = dict(weights, **{name: weights[name].astype(numpy.float64)})
        extra = dict(weights, **{"model.extra.weight": weights[name]})
        for w, want in ((bad_shape, f"{name}: shape"), (missing, f"missing tensor {name}"),
                        (nan, f"tensor '{name}' holds nan at element"), (f64, f"{name}: dtype float64"),
                        (extra, "unexpected tensor model.extra.weight")):
            expect_error(b, w, want)

        # Loaded before the first step: the run --init with these weights trains.
        init = os.path.join(d, "a.safetensors")
        write_safetensors(init, weights)
        cli_log = os.path.join(d, "cli.jsonl")
        cli = [a.hspmd, "train", "--model", MODEL, "--data", data, *FLAGS, "--steps", "3", "--seed", "1", "--init",
               init, "--log", cli_log]
        subprocess.run(cli + ["--global-batch", "8", "--micro-batches", "2"], check=True, env=env)
        b.train()
        logs = [(os.path.join(d, "b.jsonl"), "1 process")]
        if a.mpirun:
            mpirun = [a.mpirun, "--oversubscribe", "--allow-run-as-root", "-np", "4", "-x", "PYTHONPATH"]
            npz = os.path.join(d, "a.npz")
            numpy.savez(npz, **weights)
            cli4_log, py4_log = os.path.join(d, "cli4.jsonl"), os.path.join(d, "py4.jsonl")
            subprocess.run(mpirun + [a.hspmd, "train", "--model", MODEL, "--data", data, *FLAGS, "--steps", "3",
                                     "--seed", "1", "--init", init, "--strategy", STRATEGY, "--log", cli4_log],
                           check=True, env=env)
            subprocess.run(mpirun + [sys.executable, os.path.abspath(__file__), "--worker", "--data", data,
                                     "--weights", npz, "--log", py4_log], check=True, env=env)
            logs.append((py4_log, "4 ranks", cli4_log))
        for entry in logs:
            got, what = records(entry[0]), entry[1]
            want = records(entry[2] if len(entry) > 2 else cli_log)
            assert len(want) == len(got) == 3, (what, len(want), len(got))
            for w, g in zip(want, got):
                for k in FIELDS:
                    assert w[k] == g[k], f"{what}: step {w['step']}: {k} {g[k]!r} after load_state_dict, " \
                                         f"{w[k]!r} with --init"
    print(f"ok: load_state_dict exact, errors in one line, == --init in {' and '.join(e[1] for e in logs)}")


if __name__ == "__main__":
    main()
