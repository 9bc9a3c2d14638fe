"""The overlapped gradient synchronization (--overlap, docs/comm.md) trains
exactly the model the synchronization after the schedule does: for plans of
every kind that synchronizes gradients (data parallelism with and without
ZeRO, TP with its replicated norms, data-parallel groups of different TP
degrees, heterogeneous pipelines, tied embeddings across stages, context
parallelism, bf16 gradient reduction, an idle rank), `--overlap` and
`--no-overlap` give bit-identical losses, gradient norms and final weights;
the gradients really went to the communication thread during the backward
(`grad_sync_overlapped`), the bytes moved still equal the resolver's
prediction, and the exposed synchronization (`grad_sync_s`) is reported.
The two flags together, and --overlap under the emulated clock, are refused
in one line."""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from equivalence_test import (BF16_CASES, CASES, MODEL, TIED_CASES, records, run)  # noqa: E402

DEFAULT_CASES = ("dp4_zero,dp2_tp2,asym7_tp421_zero,hetero_pp_tp,c2_like7_zero,tied_tp1_to_cp2tp2,"
                 "cp2_tp2,bf16g_hetero_pp_tp,idle_rank")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default=DEFAULT_CASES)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hspmd_overlap_")
    model = os.path.join(tmp, "model.json")
    json.dump(MODEL, open(model, "w"))
    tied = os.path.join(tmp, "tied.json")
    json.dump({**MODEL, "tie_word_embeddings": True}, open(tied, "w"))
    data = os.path.join(tmp, "data.bin")
    import random
    import struct
    rng = random.Random(11)
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(64)) for _ in range(8192)))
    failures = []
    for name in args.cases.split(","):
        if name in TIED_CASES:
            world, strategy, extra, mpath = *TIED_CASES[name], [], tied
        elif name in BF16_CASES:
            world, strategy = BF16_CASES[name]
            extra = ["--precision", "bf16"] + (["--grad-reduce-dtype", "bf16"] if name.startswith("bf16g") else [])
            mpath = model
        else:
            world, strategy, extra, mpath = *CASES[name], [], model
        spath = os.path.join(tmp, name + ".json")
        json.dump(strategy, open(spath, "w"))
        out = {}
        for mode in ("overlap", "no-overlap"):
            log = os.path.join(tmp, f"{name}.{mode}.jsonl")
            weights = os.path.join(tmp, f"{name}.{mode}.safetensors")
            cmd = [args.hspmd, "train", "--model", mpath, "--data", data, "--steps", "4", "--lr", "3e-3",
                   "--seq-len", "16", "--threads", "1", "--quiet", "--device", args.device, "--strategy", spath,
                   "--nproc", str(world), "--log", log, "--save", weights, "--" + mode] + extra
            rc, err = run(cmd)
            if rc and ("no CUDA device" in err or "no CUDA backend" in err):
                print("SKIP: " + err.strip())
                sys.exit(77)
            if rc:
                failures.append(f"{name} --{mode}: exit {rc}: {err.strip()[-400:]}")
                break
            out[mode] = (records(log), open(weights, "rb").read())
        if len(out) < 2:
            continue
        (on, w_on), (off, w_off) = out["overlap"], out["no-overlap"]
        same = ([r["loss"] for r in on] == [r["loss"] for r in off] and
                [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off] and w_on == w_off)
        handed = [sum(r.get("grad_sync_overlapped", [0])) for r in on]
        handed_off = [sum(r.get("grad_sync_overlapped", [0])) for r in off]
        bytes_ok = all(r["reshard_bytes_sent"] == r["predicted_reshard_bytes"] for r in on + off)
        sync_ok = all(len(r["grad_sync_s"]) == world and min(r["grad_sync_s"]) >= 0 for r in on + off)
        exposed = lambda rs: max(max(r["grad_sync_s"]) for r in rs[1:])  # step 0 makes the groups
        ok = same and min(handed) > 0 and max(handed_off) == 0 and bytes_ok and sync_ok
        print(f"{name:22s} world {world}: {'bit-identical' if same else 'DIFFERENT'}, "
              f"{min(handed)} gradients handed over during the last backward, bytes "
              f"{'= predicted' if bytes_ok else '!= predicted'}, exposed sync (max rank, steps 1-3) "
              f"{exposed(on) * 1e3:.2f} ms overlapped vs {exposed(off) * 1e3:.2f} ms after "
              f"{'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(name)
    # Bad flags: one line each, before any work.
    base = [args.hspmd, "train", "--model", model, "--data", data, "--steps", "1", "--seq-len", "16",
            "--quiet", "--device", args.device]
    for flags, want in ((["--overlap", "--no-overlap"], "--overlap or --no-overlap, not both"),
                        (["--overlap", "--cluster", os.path.join(tmp, "none.json")], "emulated clock")):
        rc, err = run(base + flags)
        lines = err.strip().splitlines()
        ok = rc != 0 and len(lines) == 1 and want in lines[0]
        print(f"{' '.join(flags[:2]):22s} -> {lines[-1] if lines else '(nothing)'} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(" ".join(flags))
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))
    print("all ok")


if __name__ == "__main__":
    main()
