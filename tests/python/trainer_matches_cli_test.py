"""hspmd.Trainer against `hspmd train`: examples/python/train_tiny.py and the
command line with the same flags give the same step records (loss, gradient
norm, lr, tokens) and final weights, bit for bit: in one process, or on 4 MPI
ranks under the asymmetric examples/python/tiny_hetero_4.json (a TP2+TP1
pipeline beside a TP1 pipeline, ZeRO-1), where the Python run overlaps its
gradient synchronization (overlap=True) and the command line does not. Then the checkpoint Trainer.save_checkpoint
writes resumes under `hspmd train --resume` as the command line's own does."""
import argparse
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "train_tiny.py")
STRATEGY = os.path.join(ROOT, "examples", "python", "tiny_hetero_4.json")
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
# The example's training flags, as `hspmd train` flags.
FLAGS = ["--seq-len", "64", "--steps", "6", "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "2",
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "0", "--threads", "1", "--quiet"]
FIELDS = ("step", "loss", "grad_norm", "lr", "tokens")


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        b, e = t["data_offsets"]
        out[name] = numpy.frombuffer(data[b:e], dtype=numpy.float32).reshape(t["shape"])
    return out


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--mpirun", default="mpirun")
    a = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    mpirun = [a.mpirun, "--oversubscribe", "--allow-run-as-root", "-np", str(a.nproc), "-x", "PYTHONPATH"]
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "corpus.bin")
        corpus = sorted(glob.glob(os.path.join(ROOT, "data", "corpus", "*.txt")))
        subprocess.run([a.hspmd, "tokenize", "--model", MODEL, "--output", data, *corpus], check=True,
                       capture_output=True)
        cli_log, cli_save = os.path.join(d, "cli.jsonl"), os.path.join(d, "cli.safetensors")
        py_records, py_weights = os.path.join(d, "py.jsonl"), os.path.join(d, "py.npz")
        ckpt, cli_ckpt = os.path.join(d, "ckpt"), os.path.join(d, "cli_ckpt")
        cli = [a.hspmd, "train", "--model", MODEL, "--data", data, *FLAGS, "--log", cli_log, "--save", cli_save,
               "--checkpoint", cli_ckpt]
        py = [sys.executable, EXAMPLE, "--data", data, "--records", py_records, "--weights", py_weights,
              "--checkpoint", ckpt]
        if a.nproc > 1:
            cli = mpirun + cli + ["--strategy", STRATEGY]
            py = mpirun + py + ["--strategy", STRATEGY, "--overlap"]
        else:
            cli += ["--global-batch", "8", "--micro-batches", "2"]
        subprocess.run(cli, check=True, env=env)
        subprocess.run(py, check=True, env=env, stdout=subprocess.DEVNULL)

        want, got = records(cli_log), records(py_records)
        assert len(want) == len(got) == 6, (len(want), len(got))
        for w, g in zip(want, got):
            for k in FIELDS:
                assert w[k] == g[k], f"step {w['step']}: {k} {g[k]!r} from Python, {w[k]!r} from the CLI"
        assert set(want[0]) <= set(got[0]), f"keys missing from Trainer.step(): {set(want[0]) - set(got[0])}"
        if a.nproc > 1:  # Trainer(overlap=True) really handed gradients to the communication thread
            assert all(sum(g.get("grad_sync_overlapped", [])) > 0 for g in got), "overlap=True did not overlap"

        saved, weights = read_safetensors(cli_save), numpy.load(py_weights)
        assert sorted(saved) == sorted(weights.files), "state_dict names differ from --save's"
        for name in saved:
            assert numpy.array_equal(saved[name], weights[name]), f"{name}: state_dict differs from --save"

        # Trainer.save_checkpoint writes what --resume reads: resumed for two
        # more steps, it continues as the command line's own checkpoint does.
        more = list(FLAGS)
        more[more.index("--steps") + 1] = "8"
        extra = ["--strategy", STRATEGY] if a.nproc > 1 else ["--global-batch", "8", "--micro-batches", "2"]
        pre = mpirun if a.nproc > 1 else []
        tails = []
        for source in (cli_ckpt, ckpt):
            log = source + ".jsonl"
            subprocess.run(pre + [a.hspmd, "train", "--model", MODEL, "--data", data, *more, *extra, "--log", log,
                                  "--resume", source], check=True, env=env)
            tails.append([(r["step"], r["loss"], r["grad_norm"]) for r in records(log)])
        assert [t[0] for t in tails[0]] == [6, 7], tails[0]
        assert tails[0] == tails[1], f"resumed from the CLI's checkpoint {tails[0]}, from Python's {tails[1]}"
    print(f"ok: Trainer == hspmd train on {a.nproc} rank(s), 6 steps; checkpoint resumes")


if __name__ == "__main__":
    main()
