#!/usr/bin/env python3
"""A plan switch in the middle of training: the tiny Llama trains on 4 ranks
under the asymmetric tiny_hetero_4.json (a TP2+TP1 pipeline beside a TP1
pipeline), then at step --switch-at moves online, without a restart, to
tiny_dp2_tp2_4.json (two TP2 pipelines): the weights and Adam moments are
resharded to the new plan (docs/switching.md) and training goes on.

    PYTHONPATH=build/python mpirun -np 4 python3 examples/python/switch_plans.py --data out/corpus.bin

The same flags give the losses of
    hspmd train --strategy tiny_hetero_4.json --switch 3:tiny_dp2_tp2_4.json ...
bit for bit (tests/python/trainer_switch_test.py). --to also takes a plan
JSON (hspmd plan compile); --compiled switches to a plan compiled here."""
import argparse
import json
import os

import hspmd

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(HERE, "..", "tiny-llama", "config.json"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--strategy", default=os.path.join(HERE, "tiny_hetero_4.json"), help="the first strategy")
    ap.add_argument("--to", default=os.path.join(HERE, "tiny_dp2_tp2_4.json"), help="the strategy (or plan) after")
    ap.add_argument("--switch-at", type=int, default=3, help="the first step under --to")
    ap.add_argument("--compiled", action="store_true", help="switch to hspmd.compile_plan(--to), not the file")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log", help="the run's JSONL log (step and switch records), as hspmd train --log")
    ap.add_argument("--records", help="write the step records here (JSONL, rank 0)")
    a = ap.parse_args()

    model = hspmd.models.from_hf(a.model)
    trainer = hspmd.Trainer(model, a.strategy, a.data, seq_len=a.seq_len, steps=a.steps, lr=3e-3,
                            lr_schedule="cosine", warmup_steps=2, weight_decay=0.1, clip_grad=1.0, seed=0,
                            threads=a.threads, log=a.log)
    records = []
    while not trainer.done:
        if trainer.next_step == a.switch_at:
            target = a.to
            if a.compiled:
                target = hspmd.compile_plan(model, hspmd.Strategy.from_json(a.to), trainer.world.size,
                                            seq_len=a.seq_len)
            trainer.switch_to(target)
            if trainer.rank == 0:
                print(f"switched to {trainer.strategy.description}")
        r = trainer.step()
        records.append(r)
        if trainer.rank == 0:
            print(f"step {r['step']}: loss {r['loss']:.6f}, grad norm {r['grad_norm']:.4f}")
    trainer.finish()
    if trainer.rank == 0 and a.records:
        with open(a.records, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
