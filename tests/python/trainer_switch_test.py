"""Trainer.switch_to against `hspmd train --switch`: on 4 MPI ranks,
examples/python/switch_plans.py (tiny_hetero_4.json, then tiny_dp2_tp2_4.json
from step 3) and the command line with --switch 3:tiny_dp2_tp2_4.json give the
same step records (loss, gradient norm, lr, tokens) bit for bit and the same
switch record; so does a switch to a plan compiled in Python. In one process:
a switch that changes the global batch, a missing file and a switch after the
last step are one-line hspmd.Errors and the run goes on under its plan."""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "switch_plans.py")
FIRST = os.path.join(ROOT, "examples", "python", "tiny_hetero_4.json")
SECOND = os.path.join(ROOT, "examples", "python", "tiny_dp2_tp2_4.json")
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
FLAGS = ["--seq-len", "64", "--steps", "6", "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "2",
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "0", "--threads", "1", "--quiet"]
FIELDS = ("step", "loss", "grad_norm", "lr", "tokens")
SWITCH_FIELDS = ("event", "step", "algorithm", "bytes_sent", "predicted_bytes", "rounds", "checkpoint_bytes")


def read_log(path):
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    return [r for r in lines if "loss" in r], [r for r in lines if r.get("event") == "switch"]


def compare(want_path, got_path, what):
    (want, want_sw), (got, got_sw) = read_log(want_path), read_log(got_path)
    assert len(want) == len(got) == 6, (what, len(want), len(got))
    for w, g in zip(want, got):
        for k in FIELDS:
            assert w[k] == g[k], f"{what}: step {w['step']}: {k} {g[k]!r} from Python, {w[k]!r} from the CLI"
    assert len(want_sw) == len(got_sw) == 1, (what, want_sw, got_sw)
    for k in SWITCH_FIELDS:
        assert want_sw[0][k] == got_sw[0][k], f"{what}: switch record {k}: {got_sw[0][k]!r} vs {want_sw[0][k]!r}"
    assert want_sw[0]["step"] == 3


def one_process_errors(data):
    import hspmd
    log = os.path.join(os.path.dirname(data), "one.jsonl")
    t = hspmd.Trainer(MODEL, None, data, seq_len=64, steps=3, global_batch=8, micro_batches=2, threads=1, seed=0,
                      switch_algorithm="naive", log=log)
    t.step()
    half = {"pipelines": [{"micro_batch_size": 2, "micro_batches": 2, "stages": [{"ranks": [0], "layers": [0, 3]}]}]}
    cases = [(half, "global batch 4, the run's is 8"), (os.path.join(ROOT, "no-such.json"), "no-such.json")]
    for target, want in cases:
        try:
            t.switch_to(target)
        except hspmd.Error as e:
            assert want in str(e) and "\n" not in str(e), str(e)
        else:
            raise AssertionError(f"switch_to({target!r}) was accepted")
    same = {"pipelines": [{"micro_batch_size": 4, "micro_batches": 2, "stages": [{"ranks": [0], "layers": [0, 3]}]}]}
    t.switch_to(same)  # 2 x 4 -> 4 x 2 samples per micro-batch: same batch
    assert t.strategy.to_json()["pipelines"][0]["micro_batch_size"] == 4
    while not t.done:
        t.step()
    try:
        t.switch_to(same)
    except hspmd.Error as e:
        assert "has trained its 3 steps already" in str(e), str(e)
    else:
        raise AssertionError("switch_to after the last step was accepted")
    t.finish()
    switches = read_log(log)[1]
    assert [(r["step"], r["algorithm"]) for r in switches] == [(1, "naive")], switches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--mpirun", default="")
    a = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "corpus.bin")
        corpus = sorted(glob.glob(os.path.join(ROOT, "data", "corpus", "*.txt")))
        subprocess.run([a.hspmd, "tokenize", "--model", MODEL, "--output", data, *corpus], check=True,
                       capture_output=True)
        one_process_errors(data)
        if not a.mpirun:
            print("ok: switch_to errors in one process (no MPI: the 4-rank comparison skipped)")
            return
        mpirun = [a.mpirun, "--oversubscribe", "--allow-run-as-root", "-np", "4", "-x", "PYTHONPATH"]
        cli_log = os.path.join(d, "cli.jsonl")
        subprocess.run(mpirun + [a.hspmd, "train", "--model", MODEL, "--data", data, *FLAGS, "--strategy", FIRST,
                                 "--switch", f"3:{SECOND}", "--log", cli_log], check=True, env=env)
        for extra, what in (([], "switch_to(file)"), (["--compiled"], "switch_to(compile_plan(...))")):
            py_log = os.path.join(d, "py.jsonl")
            subprocess.run(mpirun + [sys.executable, EXAMPLE, "--data", data, "--strategy", FIRST, "--to", SECOND,
                                     "--switch-at", "3", "--log", py_log, *extra],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            compare(cli_log, py_log, what)
    print("ok: Trainer.switch_to == hspmd train --switch 3:B on 4 ranks (file and compiled plan); errors in one line")


if __name__ == "__main__":
    main()
