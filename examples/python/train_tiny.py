#!/usr/bin/env python3
"""The tiny Llama (examples/tiny-llama/config.json) trained from Python under
an asymmetric strategy: on 4 ranks a pipeline of a TP2 stage and a TP1 stage
beside a TP1 pipeline of the whole model (tiny_hetero_4.json), or alone in
one process without --strategy.

    PYTHONPATH=build/python mpirun -np 4 python3 examples/python/train_tiny.py \\
        --data out/corpus.bin --strategy examples/python/tiny_hetero_4.json
    PYTHONPATH=build/python python3 examples/python/train_tiny.py --data out/corpus.bin

(out/corpus.bin: `hspmd tokenize`, see examples/train_tiny.sh.) The flags
below are `hspmd train`'s; the same flags give the command line's losses,
bit for bit (tests/python/trainer_matches_cli_test.py)."""
import argparse
import json
import os

import hspmd

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(HERE, "..", "tiny-llama", "config.json"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--strategy", help="strategy JSON; none: one process")
    ap.add_argument("--global-batch", type=int, default=8, help="without --strategy")
    ap.add_argument("--micro-batches", type=int, default=2, help="without --strategy")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--overlap", action="store_true",
                    help="synchronize gradients during the last backward (a communication thread; docs/comm.md)")
    ap.add_argument("--records", help="write the step records here (JSONL, rank 0)")
    ap.add_argument("--checkpoint", help="write a training checkpoint here after the last step")
    ap.add_argument("--weights", help="write the final weights here (numpy .npz, Hugging Face names; rank 0)")
    a = ap.parse_args()

    model = hspmd.models.from_hf(a.model)
    strategy = hspmd.Strategy.from_json(a.strategy) if a.strategy else None
    batch = {} if strategy else {"global_batch": a.global_batch, "micro_batches": a.micro_batches}
    trainer = hspmd.Trainer(model, strategy, a.data, optimizer="adamw", precision="fp32", device="cpu",
                            seq_len=a.seq_len, steps=a.steps, lr=3e-3, lr_schedule="cosine", warmup_steps=2,
                            weight_decay=0.1, clip_grad=1.0, seed=0, threads=a.threads, overlap=a.overlap, **batch)
    if trainer.rank == 0 and strategy:
        print(hspmd.compile_plan(model, strategy, trainer.world.size, seq_len=a.seq_len).explain(rank=0)
              .split("\n\n")[0])
    records = []
    while not trainer.done:
        r = trainer.step()
        records.append(r)
        if trainer.rank == 0:
            print(f"step {r['step']}: loss {r['loss']:.6f}, grad norm {r['grad_norm']:.4f}, lr {r['lr']:.2e}")
    if a.checkpoint:
        trainer.save_checkpoint(a.checkpoint)
    trainer.finish()
    weights = trainer.state_dict()
    if trainer.rank == 0:
        print(f"{len(weights)} tensors, e.g. model.norm.weight mean {weights['model.norm.weight'].mean():.6f}")
        if a.weights:
            import numpy
            numpy.savez(a.weights, **weights)
        if a.records:
            with open(a.records, "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
