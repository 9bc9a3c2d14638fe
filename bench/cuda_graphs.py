#!/usr/bin/env python3
"""The training step replayed as a CUDA graph against the same step run op
by op (docs/cuda.md, "CUDA graphs"), side by side in one run: `hspmd train
--device cuda --precision bf16` with and without `--cuda-graphs`,
alternating, --repeats times each, at a few shapes from host-bound (a small
model: thousands of short kernels, the host's launches the limit) to the
benchmark's width. Per shape: each mode's median step time over the
replayed steps (steps 3 on: 0 and 1 run op by op in both modes, 2 is
captured), the time per step over the wall span of those steps (from the
records' unix_time stamps: the host's work between steps included), the
ratios, and whether both modes trained the same losses bit for bit.

usage: bench/cuda_graphs.py [--hspmd build/src/cli/hspmd] [--shapes tiny,mid,wide] [--steps 13] [--repeats 2]
       bench/cuda_graphs.py --smoke    # on the CPU: the harness, and --cuda-graphs refused there in one line

Exits 77 without a CUDA device (CTest: skipped), 1 when a run fails or the
modes' losses differ.
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (hidden, layers, heads, kv heads, ffn, vocab, seq, batch)
SHAPES = {
    "tiny": (256, 2, 4, 2, 704, 4096, 128, 2),        # host-bound: the launches are the step
    "mid": (2048, 2, 32, 4, 5632, 32000, 512, 1),     # TinyLlama's width, a short sequence
    "wide": (2048, 2, 32, 4, 5632, 32000, 4096, 4),   # the benchmark's shape, 2 layers
}
FIRST_REPLAYED = 3  # steps 0 and 1 run op by op, 2 is captured


def config(shape):
    h, layers, heads, kv, ffn, vocab, seq, _ = shape
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": max(seq, 2048), "tie_word_embeddings": False, "eos_token_id": 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build", "src", "cli", "hspmd"))
    ap.add_argument("--shapes", default="tiny,mid,wide", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per run")
    ap.add_argument("--smoke", action="store_true", help="the harness on the CPU (the suite's smoke test)")
    a = ap.parse_args()
    if a.smoke:
        a.device, a.shapes, a.steps, a.repeats = "cpu", "tiny", FIRST_REPLAYED + 2, 1
    if a.steps < FIRST_REPLAYED + 2:
        sys.exit(f"bench/cuda_graphs.py: --steps must be at least {FIRST_REPLAYED + 2}")
    on_gpu = a.device.startswith("cuda")
    failed = []
    with tempfile.TemporaryDirectory(prefix="cuda_graphs-") as tmp:
        for name in a.shapes.split(","):
            if name not in SHAPES:
                sys.exit(f"bench/cuda_graphs.py: unknown shape {name!r} (known: {', '.join(SHAPES)})")
            shape = SHAPES[name]
            seq, batch, vocab = shape[6], shape[7], shape[5]
            if a.smoke:
                seq, batch = 16, 2
            model = os.path.join(tmp, name + ".json")
            json.dump(config(shape), open(model, "w"))
            data = os.path.join(tmp, name + ".bin")
            n = (a.steps + 1) * batch * (seq + 1)
            with open(data, "wb") as f:
                f.write(b"".join(struct.pack("<I", 1 + (i * 7919) % (vocab - 1)) for i in range(n)))
            base = [a.hspmd, "train", "--model", model, "--data", data, "--seq-len", str(seq), "--global-batch",
                    str(batch), "--steps", str(a.steps), "--precision", "bf16", "--lr", "3e-4", "--device", a.device,
                    "--quiet"] + (["--threads", "1"] if not on_gpu else [])
            if not on_gpu:
                # The flag is a GPU's: on the CPU it is refused in one line
                # naming it, before any step; the harness then times the CPU
                # against itself.
                p = subprocess.run(base + ["--cuda-graphs"], capture_output=True, text=True, timeout=a.timeout)
                lines = p.stderr.strip().splitlines()
                ok = p.returncode != 0 and len(lines) == 1 and "--cuda-graphs needs a CUDA device" in lines[0]
                print(f"RESULT probe=cuda_graphs case={name}_refused_on_cpu status={'PASS' if ok else 'FAIL'}")
                if not ok:
                    print(p.stderr)
                    failed.append(name + "_refused")
            times = {"eager": [], "graphs": []}
            spans = {"eager": [], "graphs": []}
            losses = {}
            for rep in range(a.repeats):
                for mode in ("eager", "graphs"):
                    log = os.path.join(tmp, f"{name}_{mode}_{rep}.jsonl")
                    extra = ["--cuda-graphs"] if mode == "graphs" and on_gpu else []
                    p = subprocess.run(base + ["--log", log] + extra, capture_output=True, text=True,
                                       timeout=a.timeout)
                    if p.returncode:
                        if "no CUDA device" in p.stderr or "no CUDA backend" in p.stderr:
                            print("RESULT probe=cuda_graphs case=device status=SKIP (" + p.stderr.strip() + ")")
                            return 77
                        print(p.stderr)
                        failed.append(f"{name}_{mode}")
                        continue
                    recs = [json.loads(l) for l in open(log) if '"loss"' in l]
                    kinds = [r.get("cuda_graph", "") for r in recs]
                    if extra and kinds[FIRST_REPLAYED:] != ["replayed"] * (a.steps - FIRST_REPLAYED):
                        note = [l for l in p.stderr.splitlines() if "note" in l]
                        print(f"{name}: the steps were not replayed: {kinds} {note}")
                        failed.append(f"{name}_{mode}_kinds")
                    timed = recs[FIRST_REPLAYED:]
                    times[mode] += [r["step_time_s"] for r in timed]
                    spans[mode].append((timed[-1]["unix_time"] - recs[FIRST_REPLAYED - 1]["unix_time"]) / len(timed))
                    losses.setdefault(mode, [r["loss"] for r in recs])
            if not times["eager"] or not times["graphs"]:
                continue
            same = losses.get("eager") == losses.get("graphs")
            if not same:
                failed.append(f"{name}_losses")
            e, g = statistics.median(times["eager"]), statistics.median(times["graphs"])
            se, sg = statistics.median(spans["eager"]), statistics.median(spans["graphs"])
            second = "replayed" if on_gpu else "op by op again (the CPU has no graphs)"
            print(f"{name:5s} (hidden {shape[0]}, {shape[1]} layers, S {seq} x B {batch}): op by op {1e3 * e:.3f} ms, "
                  f"{second} {1e3 * g:.3f} ms a step (records' medians, {e / g:.2f}x); per step over the span "
                  f"{1e3 * se:.3f} against {1e3 * sg:.3f} ms ({se / sg:.2f}x); losses bit for bit: {same}")
            print(f"RESULT probe=cuda_graphs case={name} eager_ms={1e3 * e:.4f} graphs_ms={1e3 * g:.4f} "
                  f"speedup={e / g:.3f} span_eager_ms={1e3 * se:.4f} span_graphs_ms={1e3 * sg:.4f} "
                  f"span_speedup={se / sg:.3f} bit_for_bit={int(same)} status={'PASS' if same else 'FAIL'}")
    if failed:
        print("cuda_graphs: failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
