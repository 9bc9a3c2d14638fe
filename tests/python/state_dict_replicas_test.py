"""Trainer.load_state_dict under `hspmd launch`, each rank passing its own
arrays (issue 39 item 3): arrays that differ where two ranks hold the same
elements of a tensor under the plan are refused on every rank, in one line
naming the tensor and the two ranks, nothing loaded; arrays that differ only
where a rank holds nothing of the tensor are its own business and load.

 * 2 data-parallel ranks (two one-rank pipelines): rank 1's
   model.layers.1.mlp.down_proj.weight differs from rank 0's in one element:
   hspmd.Error on both ranks naming it, state_dict() as before. (It used to
   train each replica on its own weights, loss 5.9456, and state_dict()
   returned rank 0's copy on both.) The same arrays on both load and train as
   `hspmd train --nproc 2 --init` does, bit for bit.
 * 4 ranks under the asymmetric tiny_hetero_4.json (a TP2 stage on ranks 0-1
   and a TP1 stage on rank 2 beside a TP1 replica of the whole model on rank
   3; ZeRO-1): the holders of a slice are not "rank 0 and rank 1":
   - rank 3 differs at element [0, 0] of layer 0's q_proj (held by rank 3 and
     one of the TP2 ranks): refused, naming that TP2 rank and rank 3;
   - ranks 2 and 3 differ in layer 3's down_proj (ranks 0 and 1 hold none
     of layer 3 and get other values still): refused, naming ranks 2 and 3;
   - rank 2 gets other layer-0 weights (it holds none of layer 0) and rank 0
     another value at an element of q_proj that only its TP2 partner and rank
     3 hold: loaded, state_dict() is the common weights, and the run trains
     as `hspmd train --nproc 4 --init` does, bit for bit."""
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
HETERO = os.path.join(ROOT, "examples", "python", "tiny_hetero_4.json")
DP2 = {"description": "2 ranks: two data-parallel replicas of the whole model", "schedule": "1f1b",
       "pipelines": [{"micro_batch_size": 2, "micro_batches": 2, "stages": [{"ranks": [r], "layers": [0, 3]}]}
                     for r in (0, 1)]}
TRAIN = dict(seq_len=64, lr=3e-3, lr_schedule="cosine", warmup_steps=2, weight_decay=0.1, clip_grad=1.0, threads=1)
FLAGS = ["--seq-len", "64", "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "2", "--weight-decay",
         "0.1", "--clip-grad", "1.0", "--threads", "1", "--quiet"]
FIELDS = ("step", "loss", "grad_norm", "lr", "tokens")
Q0 = "model.layers.0.self_attn.q_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"
DOWN3 = "model.layers.3.mlp.down_proj.weight"


def same(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: names {sorted(set(a) ^ set(b))}"
    for name in a:
        assert numpy.array_equal(a[name], b[name]), f"{what}: {name} differs"


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def changed(weights, name, index, delta=1e-3):
    out = dict(weights)
    out[name] = weights[name].copy()
    out[name][index] += delta
    return out


def holds(plan, name, shape, rank, index):
    """Whether `rank` keeps element `index` of `name` (its parameter or ZeRO
    master box under `plan`)."""
    for layouts in (plan.tensors, plan._native.optimizer_states):
        if name in layouts:
            box = layouts[name].local_box(list(shape), rank=rank)
            if box and all(b <= i < e for i, b, e in zip(index, *box)):
                return True
    return False


def refused(trainer, weights, want, out):
    """load_state_dict(weights) must raise hspmd.Error containing `want` (one
    line) and leave the weights as they were; the message goes to `out`."""
    import hspmd
    before = trainer.state_dict()
    try:
        trainer.load_state_dict(weights)
    except hspmd.Error as e:
        msg = str(e)
        assert want in msg and "\n" not in msg, f"rank {trainer.rank}: expected '{want}' in: {msg}"
    else:
        raise AssertionError(f"rank {trainer.rank}: accepted weights that differ between holders ({want})")
    same(trainer.state_dict(), before, f"rank {trainer.rank}: after the refused load ({want})")
    out.append(msg)


def worker(a):
    import hspmd
    weights = dict(numpy.load(a.weights))
    world = hspmd.world()
    rank = world.rank
    messages = []
    if a.worker == "dp":
        t = hspmd.Trainer(MODEL, DP2, a.data, steps=3, seed=1, log=a.log, **TRAIN)
        mine = changed(weights, DOWN1, (3, 5)) if rank == 1 else weights
        refused(t, mine, f"{DOWN1} differs between ranks 0 and 1", messages)
    else:
        model = hspmd.models.from_hf(MODEL)
        strategy = hspmd.Strategy.from_json(HETERO)
        plan = hspmd.compile_plan(model, strategy, 4, seq_len=64)
        shape = weights[Q0].shape
        t = hspmd.Trainer(model, strategy, a.data, steps=3, seed=1, log=a.log, **TRAIN)
        # Element [0, 0] of layer 0's q_proj: rank 3 and a TP2 rank hold it.
        tp = [r for r in (0, 1) if holds(plan, Q0, shape, r, (0, 0))]
        assert holds(plan, Q0, shape, 3, (0, 0)) and tp and not holds(plan, Q0, shape, 2, (0, 0)), tp
        refused(t, changed(weights, Q0, (0, 0)) if rank == 3 else weights,
                f"{Q0} differs between ranks {tp[0]} and 3", messages)
        # Layer 3: ranks 2 and 3 hold it, 0 and 1 none (their values there are ignored).
        for r in range(4):
            assert holds(plan, DOWN3, weights[DOWN3].shape, r, (0, 0)) == (r >= 2), r
        mine = {0: changed(weights, DOWN3, (0, 0), 5.0), 1: changed(weights, DOWN3, (0, 0), -5.0),
                2: weights, 3: changed(weights, DOWN3, (7, 9))}[rank]
        refused(t, mine, f"{DOWN3} differs between ranks 2 and 3", messages)
        # Differences only where a rank holds nothing: loaded.
        alone = [i for i in ((0, 0), (shape[0] - 1, shape[1] - 1), (shape[0] - 1, 0), (0, shape[1] - 1))
                 if not holds(plan, Q0, shape, 0, i)]
        assert alone, "rank 0 holds all of q_proj's corners"
        mine = weights
        if rank == 0:
            mine = changed(weights, Q0, alone[0], 1.0)
        elif rank == 2:
            mine = dict(weights, **{k: v + 1.0 for k, v in weights.items() if ".layers.0." in k})
        t.load_state_dict(mine)
        same(t.state_dict(), weights, f"rank {rank}: after loading arrays that differ only where unheld")
    if a.worker == "dp":
        t.load_state_dict(weights)
        same(t.state_dict(), weights, f"rank {rank}: after load_state_dict")
    t.train()
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump(messages, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--worker", choices=("dp", "hetero"))
    ap.add_argument("--data")
    ap.add_argument("--weights")
    ap.add_argument("--log")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    import hspmd
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "corpus.bin")
        corpus = sorted(glob.glob(os.path.join(ROOT, "data", "corpus", "*.txt")))
        subprocess.run([a.hspmd, "tokenize", "--model", MODEL, "--output", data, *corpus], check=True,
                       capture_output=True)
        weights = hspmd.Trainer(MODEL, None, data, steps=1, seed=5, global_batch=8, micro_batches=2,
                                **TRAIN).state_dict()
        npz, init = os.path.join(d, "w.npz"), os.path.join(d, "w.safetensors")
        numpy.savez(npz, **weights)
        write_safetensors(init, weights)
        dp2 = os.path.join(d, "dp2.json")
        with open(dp2, "w") as f:
            json.dump(DP2, f)
        for part, n, strategy in (("dp", 2, dp2), ("hetero", 4, HETERO)):
            log, cli_log, out = (os.path.join(d, f"{part}.{k}") for k in ("jsonl", "cli.jsonl", "out"))
            p = subprocess.run([a.hspmd, "launch", "--nproc", str(n), "--python", a.python, "--timeout", "120",
                                os.path.abspath(__file__), "--worker", part, "--data", data, "--weights", npz,
                                "--log", log, "--out", out], env=env, capture_output=True, text=True)
            assert p.returncode == 0, f"{part}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
            messages = []
            for r in range(n):
                with open(f"{out}.{r}.json") as f:
                    messages.append(json.load(f))
            assert all(m == messages[0] for m in messages), f"{part}: the ranks' errors differ: {messages}"
            subprocess.run([a.hspmd, "train", "--nproc", str(n), "--model", MODEL, "--data", data, *FLAGS,
                            "--steps", "3", "--seed", "1", "--init", init, "--strategy", strategy, "--log", cli_log],
                           check=True, env=env)
            got, want = records(log), records(cli_log)
            assert len(want) == len(got) == 3, (part, len(want), len(got))
            for w, g in zip(want, got):
                for k in FIELDS:
                    assert w[k] == g[k], f"{part}: step {w['step']}: {k} {g[k]!r} after load_state_dict, " \
                                         f"{w[k]!r} with --init"
            print(f"{part}: {n} ranks refused: " + " | ".join(messages[0]))
    print("ok: arrays that differ between a slice's holders refused on every rank naming the tensor; "
          "the same arrays (or differences where a rank holds nothing) load and train as --init")


if __name__ == "__main__":
    main()
