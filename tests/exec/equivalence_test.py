"""Every plan trains the same model: `hspmd train --strategy S --nproc N` on
the same data and initial weights gives the single-process losses (1e-5
relative per step) and final weights (1e-4 normalized max error); with --init the
loaded full tensors are sharded into the plan.

Adam's eps is 1e-5 here: with eps 1e-8 an element whose gradient is at the
level of f32 reduction-order noise still moves by about lr, so the weights
of any two summation orders drift apart by ~lr where the loss does not
(measured: 2e-4 at eps 1e-6 and lr 1e-2; 2e-7 at eps 1e-3). HSPMD_EQ_EPS
overrides it."""
import argparse
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile

MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64,
         "eos_token_id": 0}


def pipeline(mbs, micro, stages, recompute=False):
    return {"micro_batch_size": mbs, "micro_batches": micro,
            "stages": [{"ranks": r, "layers": l, **({"cp": c} if c > 1 else {}),
                        **({"recompute": True} if recompute else {})} for r, l, c in stages]}


# A scaled-down copy of the paper's elastic C2 table (appendix C; a pipeline
# of TP4 stages beside one of TP4 ... TP2, TP1 stages): stages TP2/TP2 beside
# TP2/TP1/TP1 with uneven layer ranges and micro-batch counts (the TP2 -> TP1
# boundary is a BSR). Those stages need 8 ranks; "c2_like7" is the 7-rank
# variant TP2/TP2 beside TP1/TP1/TP1.
def c2_like(zero, seven=False):
    short = ([([4], [0, 1], 1), ([5], [2, 2], 1), ([6], [3, 3], 1)] if seven else
             [([4, 5], [0, 1], 1), ([6], [2, 2], 1), ([7], [3, 3], 1)])
    return (7 if seven else 8, {"zero": zero, "schedule": "1f1b", "pipelines": [
        pipeline(1, 5, [([0, 1], [0, 1], 1), ([2, 3], [2, 3], 1)]),
        pipeline(1, 3, short)]})


# name -> (world size, strategy); every strategy has a global batch of 8.
CASES = {
    "dp4": (4, {"pipelines": [pipeline(1, 2, [([r], [0, 3], 1)]) for r in range(4)]}),
    "dp4_zero": (4, {"zero": True, "pipelines": [pipeline(2, 1, [([r], [0, 3], 1)]) for r in range(4)]}),
    "pp2": (2, {"pipelines": [pipeline(2, 4, [([0], [0, 0], 1), ([1], [1, 3], 1)])]}),
    "asym_pp_dp_zero": (4, {"zero": True, "pipelines": [
        pipeline(3, 2, [([0], [0, 1], 1), ([1], [2, 3], 1)]),
        pipeline(1, 2, [([2], [0, 2], 1), ([3], [3, 3], 1)])]}),
    "tp4": (4, {"pipelines": [pipeline(2, 4, [([0, 1, 2, 3], [0, 3], 1)])]}),
    "dp2_tp2": (4, {"pipelines": [pipeline(2, 2, [([0, 1], [0, 3], 1)]),
                                  pipeline(2, 2, [([2, 3], [0, 3], 1)])]}),
    # Seven ranks: three data-parallel groups with TP 4, 2 and 1 and different
    # micro-batch sizes (split-all-reduce across TP degrees) ...
    "asym7_tp421": (7, {"pipelines": [pipeline(2, 2, [([0, 1, 2, 3], [0, 3], 1)]),
                                      pipeline(1, 2, [([4, 5], [0, 3], 1)]),
                                      pipeline(2, 1, [([6], [0, 3], 1)])]}),
    # ... and with ZeRO-1 (split-reduce-scatter / split-all-gather).
    "asym7_tp421_zero": (7, {"zero": True, "pipelines": [
        pipeline(2, 2, [([0, 1, 2, 3], [0, 3], 1)]),
        pipeline(1, 2, [([4, 5], [0, 3], 1)]),
        pipeline(2, 1, [([6], [0, 3], 1)])]}),
    # Pipelines of different shapes: TP2 then TP1 stages next to a TP1 pipeline.
    "hetero_pp_tp": (4, {"pipelines": [pipeline(2, 2, [([0, 1], [0, 1], 1), ([2], [2, 3], 1)]),
                                       pipeline(2, 2, [([3], [0, 3], 1)])]}),
    "pp4_gpipe": (4, {"schedule": "gpipe", "pipelines": [pipeline(1, 8, [
        ([0], [0, 0], 1), ([1], [1, 1], 1), ([2], [2, 2], 1), ([3], [3, 3], 1)])]}),
    "pp4_1f1b": (4, {"schedule": "1f1b", "pipelines": [pipeline(2, 4, [
        ([0], [0, 0], 1), ([1], [1, 1], 1), ([2], [2, 2], 1), ([3], [3, 3], 1)])]}),
    # Two pipelines x PP=2 with different micro-batch counts, GPipe.
    "2pp2_gpipe": (4, {"schedule": "gpipe", "pipelines": [
        pipeline(1, 6, [([0], [0, 1], 1), ([1], [2, 3], 1)]),
        pipeline(1, 2, [([2], [0, 2], 1), ([3], [3, 3], 1)])]}),
    "c2_like": c2_like(False),
    "c2_like_zero": c2_like(True),
    "c2_like7_zero": c2_like(True, seven=True),
    # Context parallelism (ring attention inside the attention op), alone and
    # under tensor parallelism, and a CP stage feeding a TP stage.
    "cp2": (2, {"pipelines": [pipeline(2, 4, [([0, 1], [0, 3], 2)])]}),
    "cp2_tp2": (4, {"pipelines": [pipeline(2, 4, [([0, 1, 2, 3], [0, 3], 2)])]}),
    # Activation recomputation on every stage of heterogeneous pipelines.
    "hetero_pp_tp_recompute": (4, {"pipelines": [
        pipeline(2, 2, [([0, 1], [0, 1], 1), ([2], [2, 3], 1)], recompute=True),
        pipeline(2, 2, [([3], [0, 3], 1)], recompute=True)]}),
    "idle_rank": (3, {"pipelines": [pipeline(4, 1, [([0], [0, 3], 1)]),
                                    pipeline(2, 2, [([2], [0, 3], 1)])]}),
}


# Packed documents (--pack-documents): variable-length documents packed into
# samples of at most seq_len tokens; every micro-batch is as long as its
# longest sample (rounded up to the pipeline's cp x tp granularity), so the
# pipelines run micro-batches of different lengths through one executable
# graph. name -> (world size, strategy).
PACKED_CASES = {
    "packed_dp2_tp2": CASES["dp2_tp2"],
    "packed_2pp2_gpipe": CASES["2pp2_gpipe"],
    "packed_cp2": CASES["cp2"],
    "packed_cp2_tp2": CASES["cp2_tp2"],
    # A CP x TP stage then a TP stage, beside a plain pipeline of other
    # micro-batch sizes, with ZeRO-1 and recomputation on the CP stage.
    "packed_cp_hetero_zero": (7, {"zero": True, "pipelines": [
        {"micro_batch_size": 2, "micro_batches": 2, "stages": [
            {"ranks": [0, 1, 2, 3], "layers": [0, 1], "cp": 2, "recompute": True},
            {"ranks": [4, 5], "layers": [2, 3]}]},
        pipeline(1, 4, [([6], [0, 3], 1)])]}),
}


# Tied embeddings (the LM head is the embedding): its gradient travels back
# from the last stage to the first, where context parallelism makes the
# embedding's own gradient a partial sum over the cp ranks.
TIED_CASES = {
    "tied_cp2tp2_to_cp2tp1": (6, {"pipelines": [pipeline(2, 4, [([0, 1, 2, 3], [0, 1], 2), ([4, 5], [2, 3], 2)])]}),
    "tied_tp1_to_cp2tp2": (5, {"pipelines": [pipeline(2, 4, [([0], [0, 1], 1), ([1, 2, 3, 4], [2, 3], 2)])]}),
    "tied_cp_hetero_zero": PACKED_CASES["packed_cp_hetero_zero"],
}


# A vocabulary of 66 that tensor parallelism of 4 does not divide: the plan
# pads it to 68 (zero rows, masked logits) and saves the 66 real rows.
VOCAB66_CASES = {
    "vocab66_tp4_hetero_zero": (7, {"zero": True, "pipelines": [
        pipeline(2, 2, [([0, 1, 2, 3], [0, 3], 1)]),
        pipeline(2, 2, [([4, 5], [0, 1], 1), ([6], [2, 3], 1)])]}),
    "vocab66_cp2_tp4": (8, {"pipelines": [pipeline(2, 4, [([0, 1, 2, 3, 4, 5, 6, 7], [0, 3], 2)])]}),
}


# Mixed precision (--precision bf16, docs/precision.md): every plan equals the
# single-process bf16 run. Without tensor parallelism every value is rounded
# at the same points as in one process, but the GEMMs' f32 sums run in another
# order for other micro-batch sizes, and a value that moves by one f32 ulp
# across a bf16 rounding boundary moves by one bf16 ulp; Adam amplifies that.
# How far depends on the CPU's GEMM path (oneDNN's bf16 kernels give the
# same sums at most micro-batch sizes; OpenBLAS's sgemm under emulated bf16
# reorders them, its AVX2 kernels the most), so the weights' tolerance is
# measured here: 1.5x the largest distance of one process at 1, 2 and 8
# micro-batches from the reference's 4 (the same roundings in other orders;
# it saturates near 2 x steps x lr, an element whose every Adam step flipped),
# at least 2e-2, and it must stay under the f32-bf16 distance (a plan that
# skipped bf16's roundings lands that far). The loss: 1e-4. (Measured
# distances, weights: oneDNN bf16 on an AMD EPYC 2e-4 to 4.6e-3, the plan
# 3e-6; emulated with OpenBLAS's AVX2 kernels 6e-3 to 3e-2, the plan 2.9e-2;
# the f32-bf16 distance 6.9e-2.) With it,
# bf16-level ones: the tensor-parallel partial sums are rounded to
# bf16 before they are reduced (one process rounds their sum), so the loss
# may differ by 2e-3 and the weights by 1.5x the distance between the f32
# and bf16 single-process runs (Adam turns tiny gradient differences into
# full-size updates, so any two roundings drift apart that far). "bf16g_"
# cases also reduce the gradients in bf16.
BF16_CASES = {
    "bf16_asym_pp_dp_zero": CASES["asym_pp_dp_zero"],  # no TP: the same roundings as one process
    "bf16_dp2_tp2_zero": (4, {"zero": True, "pipelines": CASES["dp2_tp2"][1]["pipelines"]}),
    "bf16g_hetero_pp_tp": CASES["hetero_pp_tp"],
    "bf16_asym7_tp421_zero": CASES["asym7_tp421_zero"],
    "bf16_cp2_tp2": CASES["cp2_tp2"],
    "bf16g_asym_pp_dp_zero": CASES["asym_pp_dp_zero"],
    # "bf16io_": the graph a GPU with cuDNN's attention builds (docs/cuda.md:
    # attention's output, dq, dk, dv and dO in bf16), here on CPUs through
    # HSPMD_ATTENTION_IO=bf16: ring attention's bf16 gradients, TP, PP.
    "bf16io_asym_pp_dp_zero": CASES["asym_pp_dp_zero"],
    "bf16io_cp2_tp2": CASES["cp2_tp2"],
    "bf16io_hetero_pp_tp": CASES["hetero_pp_tp"],
}
BF16_SAME_ROUNDING = {"bf16_asym_pp_dp_zero", "bf16io_asym_pp_dp_zero"}


# Other model families (docs/models.md): Qwen2's q/k/v biases are split like
# their projections' rows under TP (and their gradients synchronized like any
# parameter's); Mistral's sliding window (5 tokens of 16) crosses the zigzag
# chunks of context parallelism and the packed documents' boundaries.
QWEN2_CASES = {
    "qwen2_tp4": CASES["tp4"],
    "qwen2_cp2_tp2": CASES["cp2_tp2"],
    "qwen2_asym7_tp421_zero": CASES["asym7_tp421_zero"],
    "qwen2_hetero_pp_tp": CASES["hetero_pp_tp"],
}
MISTRAL_CASES = {
    "mistral_cp2": CASES["cp2"],
    "mistral_cp2_tp2": CASES["cp2_tp2"],
    "mistral_c2_like_zero": CASES["c2_like_zero"],
}
MISTRAL_PACKED_CASES = {
    "mistralpacked_cp_hetero_zero": PACKED_CASES["packed_cp_hetero_zero"],
}
# Mixture-of-experts families (docs/moe.md): experts replicated over a
# stage's TP ranks, every token split (data parallel pipelines, the sequence
# under CP) routed on its own rank; the auxiliary loss over the whole global
# batch (its statistics summed over micro-batches, stages and pipelines).
# Their single-process references run only when a case of theirs is chosen.
MIXTRAL_CASES = {
    "mixtral_dp4": CASES["dp4"],
    "mixtral_asym_pp_dp_zero": CASES["asym_pp_dp_zero"],
    "mixtral_cp2_tp2": CASES["cp2_tp2"],
    "mixtral_c2_like_zero": CASES["c2_like_zero"],
}


def ep(n, case):
    """A case's strategy with expert parallelism n (docs/moe.md)."""
    world, strategy = case
    return world, {**strategy, "expert_parallel": n}


def placed(case, placement):
    """A case's strategy with an expert placement (docs/moe.md)."""
    world, strategy = case
    return world, {**strategy, "expert_placement": placement}


# Expert parallelism: each sparse layer's experts split over groups of token
# slots (a slot: the tp ranks of one cp chunk of one pipeline's stage), the
# tokens moved to their experts' owners and back every micro-batch.
MIXTRAL_CASES.update({
    "mixtral_ep2_dp2": ep(2, (2, {"pipelines": [pipeline(2, 2, [([r], [0, 3], 1)]) for r in range(2)]})),
    "mixtral_ep4_dp4_zero": ep(4, CASES["dp4_zero"]),
    "mixtral_ep2_dp4": ep(2, CASES["dp4"]),
    "mixtral_ep2_pp2_dp2": ep(2, (4, {"pipelines": [pipeline(2, 2, [([2 * p], [0, 1], 1), ([2 * p + 1], [2, 3], 1)])
                                                    for p in range(2)]})),
    "mixtral_ep2_cp2_tp2": ep(2, CASES["cp2_tp2"]),
    # One slow pipeline (a third of the samples, one stage) beside a
    # two-stage one: their stages differ, so the schedule is GPipe's.
    "mixtral_ep2_asym_gpipe": ep(2, (3, {"schedule": "gpipe", "pipelines": [
        pipeline(3, 2, [([0], [0, 1], 1), ([1], [2, 3], 1)]), pipeline(1, 2, [([2], [0, 3], 1)])]})),
    # Replicated experts ([6/12]): expert 1 on both members of each group,
    # its tokens split between them; then a hot expert 0 on three of four
    # members in layers 0-1 (the others keep the default), with ZeRO.
    "mixtral_ep2_replicas_dp4": placed(ep(2, CASES["dp4"]), [{"layers": [0, 3], "experts": [[0], [0, 1], [1], [1]]}]),
    "mixtral_ep4_hot_zero": placed(ep(4, CASES["dp4_zero"]),
                                   [{"layers": [0, 1], "experts": [[0, 1, 2], [3], [3], [3]]}]),
})
QWEN2MOE_CASES = {
    "qwen2moe_dp2_tp2": CASES["dp2_tp2"],
    "qwen2moe_hetero_pp_tp": CASES["hetero_pp_tp"],
    "qwen2moe_asym7_tp421_zero": CASES["asym7_tp421_zero"],
    "qwen2moe_ep2_dp2_tp2": ep(2, CASES["dp2_tp2"]),
    # A TP2 slot and a TP1 slot in one group, ZeRO over the groups' copies.
    "qwen2moe_ep2_tp21_zero": ep(2, (3, {"zero": True, "pipelines": [
        pipeline(2, 2, [([0, 1], [0, 3], 1)]), pipeline(2, 2, [([2], [0, 3], 1)])]})),
    # Asymmetric: a TP2 slot (3 samples of 8) and three TP1 slots; the hot
    # expert replicated on the three TP1 members, the rest on the TP2 one.
    "qwen2moe_ep4_asym_replicas": placed(ep(4, (5, {"pipelines": [
        pipeline(3, 1, [([0, 1], [0, 3], 1)])] + [pipeline(b, 1, [([r], [0, 3], 1)]) for r, b in ((2, 2), (3, 2), (4, 1))]})),
        [{"layers": [0, 3], "experts": [[1, 2, 3], [0], [0], [0]]}]),
    # Replicas of unlike sizes: expert 0 on the TP2 slot and a TP1 slot, with ZeRO.
    "qwen2moe_ep4_mixed_replicas_zero": placed(ep(4, (5, {"zero": True, "pipelines": [
        pipeline(3, 1, [([0, 1], [0, 3], 1)])] + [pipeline(b, 1, [([r], [0, 3], 1)]) for r, b in ((2, 2), (3, 2), (4, 1))]})),
        [{"layers": [0, 3], "experts": [[0, 1], [2], [3], [1, 2]]}]),
}
# Packed documents under CP x TP with recomputation and ZeRO (without the
# auxiliary loss: a plan's padding would enter its statistics; refused).
MIXTRAL_PACKED_CASES = {
    "mixtralpacked_cp_hetero_zero": PACKED_CASES["packed_cp_hetero_zero"],
    # Expert parallelism over packed documents: the plan's padded rows are
    # routed and exchanged too.
    "mixtralpacked_ep2_dp2_tp2": ep(2, CASES["dp2_tp2"]),
}
MOE_MODES = {"mixtral": MIXTRAL_CASES, "qwen2moe": QWEN2MOE_CASES, "mixtralpacked": MIXTRAL_PACKED_CASES}
FAMILY_MODES = {"qwen2": QWEN2_CASES, "mistral": MISTRAL_CASES, "mistralpacked": MISTRAL_PACKED_CASES, **MOE_MODES}


def random_strategy(rng, max_world=8, layers=4, kv_heads=4, global_batch=8):
    """A random valid strategy of at most max_world ranks: 1-3 pipelines
    sharing the global batch in random proportions and micro-batch sizes,
    1-4 stages each with random layer cuts, tp in {1, 2, 4} (dividing the KV
    heads), cp in {1, 2}, recomputation, ZeRO-1 and the schedule drawn at
    random. Returns (world, strategy)."""
    while True:
        shares, left = [], global_batch
        pipes = rng.choice([1, 2, 2, 3])
        for p in range(pipes - 1):
            shares.append(rng.randint(1, left - (pipes - 1 - p)))
            left -= shares[-1]
        shares.append(left)
        pipelines, rank = [], 0
        for share in shares:
            mbs = rng.choice([d for d in (1, 2, 4) if share % d == 0])
            n = rng.randint(1, layers)
            bounds = [0] + sorted(rng.sample(range(1, layers), n - 1)) + [layers]
            stages = []
            for s in range(n):
                cp, tp = rng.choice([1, 1, 2]), rng.choice([t for t in (1, 2, 4) if kv_heads % t == 0])
                stage = {"ranks": list(range(rank, rank + cp * tp)), "layers": [bounds[s], bounds[s + 1] - 1]}
                if cp > 1:
                    stage["cp"] = cp
                if rng.random() < 0.3:
                    stage["recompute"] = True
                stages.append(stage)
                rank += cp * tp
            pipelines.append({"micro_batch_size": mbs, "micro_batches": share // mbs, "stages": stages})
        if rank <= max_world:
            return rank, {"schedule": rng.choice(["1f1b", "gpipe"]), "zero": rng.random() < 0.4,
                          "pipelines": pipelines}


def packed_tokens(rng, n):
    """Documents of 1 to 24 tokens (ids 1..63), each ending in eos 0."""
    out = []
    while len(out) < n:
        out += [rng.randrange(1, 64) for _ in range(rng.randrange(0, 24))] + [0]
    return out


CLUSTER_CATALOG = {"gpu": {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100,
                           "inter_node_gbps": 25}}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        b, e = meta["data_offsets"]
        out[name] = struct.unpack("<%df" % ((e - b) // 4), data[b:e])
    return out


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def losses(path):
    return [r["loss"] for r in records(path)]


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=None if env is None else {**os.environ, **env})
    return r.returncode, r.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--cases", default=",".join(list(CASES) + list(PACKED_CASES) + list(TIED_CASES) +
                                                list(VOCAB66_CASES) + list(BF16_CASES) + list(QWEN2_CASES) +
                                                list(MISTRAL_CASES) + list(MISTRAL_PACKED_CASES)))
    ap.add_argument("--random", type=int, default=6,
                    help="also this many random strategies (random_strategy) on fixed, packed, tied or "
                         "vocab-66 data")
    ap.add_argument("--seed", type=int, default=2026, help="seed of the random strategies")
    ap.add_argument("--device", default="cpu",
                    help="hspmd train --device for every run, the single-process references included "
                         "(cuda: the plans on one GPU, docs/cuda.md)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hspmd_equiv_")
    model = os.path.join(tmp, "model.json")
    json.dump(MODEL, open(model, "w"))
    rng = random.Random(7)
    data = os.path.join(tmp, "data.bin")
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(64)) for _ in range(8192)))
    base = [args.hspmd, "train", "--model", model, "--data", data, "--steps", "5", "--lr", "3e-3",
            "--eps", os.environ.get("HSPMD_EQ_EPS", "1e-5"), "--weight-decay", "0.1", "--clip-grad", "0.5", "--threads", "1",
            "--quiet", "--device", args.device]
    common = base + ["--seq-len", "16"]
    base_w = os.path.join(tmp, "fixed.safetensors")  # --init below loads it

    def model_variant(name, **fields):
        path = os.path.join(tmp, name + ".json")
        json.dump({**MODEL, **fields}, open(path, "w"))
        return [a if a != model else path for a in common]

    packed_data = os.path.join(tmp, "packed.bin")
    with open(packed_data, "wb") as f:
        f.write(b"".join(struct.pack("<I", t) for t in packed_tokens(rng, 4096)))
    # The command of each data / model mode; its single-process run is the reference.
    modes = {"fixed": common,
             "packed": [a if a != data else packed_data for a in common] + ["--pack-documents"],
             "tied": model_variant("tied", tie_word_embeddings=True),
             "vocab66": model_variant("vocab66", vocab_size=66),
             "bf16": common + ["--precision", "bf16"],
             "bf16g": common + ["--precision", "bf16", "--grad-reduce-dtype", "bf16"],
             "bf16io": ["env", "HSPMD_ATTENTION_IO=bf16"] + common + ["--precision", "bf16"],
             "qwen2": model_variant("qwen2", model_type="qwen2", tie_word_embeddings=True),
             "mistral": model_variant("mistral", model_type="mistral", sliding_window=5)}
    modes["mistralpacked"] = [a if a != data else packed_data for a in modes["mistral"]] + ["--pack-documents"]
    # Routers far enough from ties (initializer_range 0.1) that no reduction
    # order moves a token to another expert.
    moe = dict(initializer_range=0.1, output_router_logits=True, num_experts_per_tok=2)
    modes["mixtral"] = model_variant("mixtral", model_type="mixtral", num_local_experts=4, router_aux_loss_coef=0.02,
                                     **moe)
    modes["qwen2moe"] = model_variant("qwen2moe", model_type="qwen2_moe", num_experts=4, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=32, mlp_only_layers=[2], norm_topk_prob=False,
                                      router_aux_loss_coef=0.05, **moe)
    # Packed documents: without the auxiliary loss (whose statistics would
    # count the padding, which differs between plans: refused).
    modes["mixtralpacked"] = [a if a != data else packed_data
                              for a in model_variant("mixtralpacked", model_type="mixtral", num_local_experts=4,
                                                     initializer_range=0.1, num_experts_per_tok=2)] + \
        ["--pack-documents"]
    chosen = set(args.cases.split(","))
    for mode, cases in MOE_MODES.items():
        if not chosen & set(cases):
            del modes[mode]
    want = {}
    for mode, cmd in modes.items():
        log, weights = os.path.join(tmp, mode + ".jsonl"), os.path.join(tmp, mode + ".safetensors")
        rc, err = run(cmd + ["--global-batch", "8", "--micro-batches", "4", "--log", log, "--save", weights])
        if rc and ("no CUDA device" in err or "no CUDA backend" in err):
            print("SKIP: " + err.strip())  # a GPU run on a machine without one
            sys.exit(77)
        if rc:
            sys.exit(f"single-process {mode} run failed: " + err)
        want[mode] = (losses(log), read_safetensors(weights))
    want_loss = want["fixed"][0]
    failures = []
    # The initial weights (lr 1e-30: the updates are below f32's resolution),
    # to measure the bf16 runs' updates against their own size.
    init_w = os.path.join(tmp, "init.safetensors")
    init_cmd = list(common)
    init_cmd[init_cmd.index("--steps") + 1] = "1"
    init_cmd[init_cmd.index("--lr") + 1] = "1e-30"
    rc, err = run(init_cmd + ["--global-batch", "8", "--micro-batches", "4", "--save", init_w])
    if rc:
        sys.exit("initial-weights run failed: " + err)
    init = read_safetensors(init_w)

    def update_error(got_w, want_w):
        """The largest, over the weights, of ||got - want|| / ||want - init||:
        how far a plan's update of a tensor is from one process's, relative to
        the update itself. A tensor whose update was skipped or garbled reads
        about 1 or more."""
        worst = 0.0
        for t, ref in want_w.items():
            got, start = got_w.get(t, []), init.get(t, [])
            if len(got) != len(ref) or len(start) != len(ref):
                return float("inf")
            num = sum((y - x) ** 2 for x, y in zip(ref, got))
            den = sum((x - z) ** 2 for x, z in zip(ref, start))
            worst = max(worst, math.sqrt(num / den) if den > 0 else float("inf"))
        return worst

    def weights_error(got_w, want_w):
        werr, worst = 0.0, ""
        for t, ref in want_w.items():
            scale = max(max(abs(x) for x in ref), 1e-12)
            e = max(abs(x - y) for x, y in zip(ref, got_w.get(t, []))) / scale
            if len(got_w.get(t, [])) != len(ref):  # e.g. a padded vocabulary saved with its padding
                e = float("inf")
            if e > werr:
                werr, worst = e, t
        return werr, worst
    # bf16's own scale on the weights: Adam turns tiny gradient differences into
    # full-size updates, so two bf16 runs that round differently drift apart by
    # about as much as bf16 from f32; a plan's bf16 run must stay well inside that.
    bf16_noise = weights_error(want["bf16"][1], want["fixed"][1])[0]
    print(f"bf16 vs f32, one process: weights differ by {bf16_noise:.2e}")
    names = args.cases.split(",") if args.cases else []
    # The same roundings in other orders of the f32 sums (BF16_SAME_ROUNDING):
    # one process at other micro-batch counts, on this machine's GEMM path.
    same_rounding_tol = None
    if BF16_SAME_ROUNDING & set(names):
        order = []
        for micro in (1, 2, 8):
            w = os.path.join(tmp, f"bf16_mb{micro}.safetensors")
            rc, err = run(modes["bf16"] + ["--global-batch", "8", "--micro-batches", str(micro), "--save", w])
            if rc:
                sys.exit(f"single-process bf16 run at {micro} micro-batches failed: " + err)
            order.append(weights_error(read_safetensors(w), want["bf16"][1])[0])
        same_rounding_tol = max(2e-2, 1.5 * max(order))
        ok = same_rounding_tol < bf16_noise
        print(f"bf16 at 1, 2, 8 micro-batches vs 4, one process: weights differ by "
              f"{', '.join(f'{e:.2e}' for e in order)}; same-rounding plans' tolerance {same_rounding_tol:.2e} "
              f"(under the f32-bf16 distance {bf16_noise:.2e}) {'ok' if ok else 'FAIL'}")
        if not ok:  # a plan that computed in f32 would pass
            failures.append("bf16 same-rounding tolerance reaches the f32-bf16 distance")
    # HSPMD_ATTENTION_IO=bf16 builds the GPU's bf16 graph (attention's output
    # and gradients in bf16). Which graph the default bf16 run built, each
    # run's step records say ("attention_output": Precision::for_device): on a
    # device whose attention goes to cuDNN the default already is that graph,
    # so the two runs must be equal (the same graph on the same device); where
    # the default keeps attention's output in f32 (the CPU, cpu:1), the
    # roundings must take effect (a difference) and stay near (under 1e-2).
    def attention_output(mode):
        return {r.get("attention_output", "?") for r in records(os.path.join(tmp, mode + ".jsonl"))}
    io_rel = max(abs(a - b) / abs(a) for a, b in zip(want["bf16"][0], want["bf16io"][0]))
    default_io, forced_io = attention_output("bf16"), attention_output("bf16io")
    if forced_io != {"bf16"} or len(default_io) != 1:
        io_ok, expect = False, f"records say attention_output {sorted(default_io)} and {sorted(forced_io)} (HSPMD_ATTENTION_IO=bf16)"
    elif default_io == {"bf16"}:
        io_ok, expect = io_rel <= 1e-6, "the default graph has a bf16 output here: equal"
    else:
        io_ok, expect = 0 < io_rel < 1e-2, "the default graph has an f32 output here: a difference under 1e-2"
    print(f"bf16 attention io vs the default bf16 graph, one process: loss rel {io_rel:.2e} ({expect}) "
          f"{'ok' if io_ok else 'FAIL'}")
    if not io_ok:
        failures.append("bf16 attention io")
    pick = random.Random(args.seed)
    for k in range(args.random):  # plans nobody wrote by hand
        name = f"random{args.seed}_{k}"
        world, strategy = random_strategy(pick)
        mode = pick.choice(["fixed", "packed", "tied", "vocab66", "qwen2", "mistral"])
        {"fixed": CASES, "packed": PACKED_CASES, "tied": TIED_CASES, "vocab66": VOCAB66_CASES,
         **FAMILY_MODES}[mode][name] = (world, strategy)
        names.append(name)
    for name in names:
        family = [m for m, cases in FAMILY_MODES.items() if name in cases]
        mode = ("packed" if name in PACKED_CASES else "tied" if name in TIED_CASES else
                "vocab66" if name in VOCAB66_CASES else name.split("_")[0] if name in BF16_CASES else
                family[0] if family else "fixed")
        world, strategy = {"packed": PACKED_CASES, "tied": TIED_CASES, "vocab66": VOCAB66_CASES,
                           "bf16": BF16_CASES, "bf16g": BF16_CASES, "bf16io": BF16_CASES, "fixed": CASES,
                           **FAMILY_MODES}[mode][name]
        loss_tol, weight_tol = (1e-5, 1e-4)
        if mode.startswith("bf16"):
            loss_tol, weight_tol = ((1e-4, same_rounding_tol) if name in BF16_SAME_ROUNDING else
                                    (2e-3, 1.5 * bf16_noise))
        want_loss, want_w = want[mode]
        spath = os.path.join(tmp, name + ".json")
        json.dump(strategy, open(spath, "w"))
        log, weights = os.path.join(tmp, name + ".jsonl"), os.path.join(tmp, name + ".safetensors")
        rc, err = run(modes[mode] +
                      ["--strategy", spath, "--nproc", str(world), "--log", log, "--save", weights])
        if rc:
            failures.append(f"{name}: exit {rc}: {err.strip()[-400:]}" + (" " + json.dumps(strategy) if name.startswith("random") else ""))
            continue
        got = losses(log)
        rel = max(abs(a - b) / abs(a) for a, b in zip(want_loss, got))
        got_w = read_safetensors(weights)
        werr, worst = weights_error(got_w, want_w)
        # bf16 weights are compared loosely (bf16's own noise, up to ~9e-2 of a
        # weight that 5 steps move by ~1e-2), so the update of every tensor is
        # checked against its own size: within 0.15 of one process's update
        # (measured 1e-5 without TP, 7e-3 to 3.7e-2 with it); a tensor that was
        # not updated reads 1.
        uerr = update_error(got_w, want_w) if mode.startswith("bf16") else 0.0
        # Bytes each rank sent inside Reshards equal the resolver's prediction,
        # and inside ops (ring attention, vocab-parallel loss) the ops' own.
        bytes_ok = all(r["reshard_bytes_sent"] == r["predicted_reshard_bytes"] and
                       r["op_bytes_sent"] == r["predicted_op_bytes"] for r in records(log))
        # Expert parallelism: its token exchange, measured and as the resolver
        # predicted it from each step's routing counts, in every record; a
        # plan that places experts apart must exchange some.
        if "_ep" in name:
            bytes_ok = bytes_ok and all(r.get("expert_bytes_sent") == r.get("predicted_expert_bytes") and
                                        sum(r.get("expert_bytes_sent") or [0]) > 0 for r in records(log))
        # The exposed gradient synchronization, per rank, measured.
        sync_ok = all(len(r["grad_sync_s"]) == world and min(r["grad_sync_s"]) >= 0 for r in records(log))
        # A mixture of experts' records: the tokens each expert took per
        # layer and step, the same integers as one process's (and k per
        # token). Packed rows carry the plan's own padding, routed too.
        experts_ok = True
        if mode in MOE_MODES and not mode.endswith("packed"):
            tokens = [r.get("expert_tokens") for r in records(log)]
            want_tokens = [r.get("expert_tokens") for r in records(os.path.join(tmp, mode + ".jsonl"))]
            experts_ok = tokens == want_tokens and all(sum(layer) == 8 * 16 * 2 for step in tokens for layer in step)
        ok = (len(got) == len(want_loss) and rel <= loss_tol and werr <= weight_tol and
              set(got_w) == set(want_w) and bytes_ok and uerr <= 0.15 and sync_ok and experts_ok)
        print(f"{name:22s} world {world}: loss rel err {rel:.2e}, weights err {werr:.2e} "
              f"{f'update err {uerr:.2e} ' if mode.startswith('bf16') else ''}"
              f"(worst {worst}), bytes {'= predicted' if bytes_ok else '!= predicted'} "
              f"{'expert tokens != ' if not experts_ok else 'expert tokens = ' if mode in MOE_MODES else ''}"
              f"{'ok' if ok else 'FAIL'}")
        if not ok:  # a random plan is printed so that it can be replayed
            failures.append(name + (" " + json.dumps(strategy) if name.startswith("random") else ""))
    # bf16 activations and gradients travel in half the bytes.
    if "hetero_pp_tp" in names and "bf16g_hetero_pp_tp" in names:
        sent = {n: sum(sum(r["reshard_bytes_sent"]) for r in records(os.path.join(tmp, n + ".jsonl")))
                for n in ("hetero_pp_tp", "bf16g_hetero_pp_tp")}
        ok = sent["bf16g_hetero_pp_tp"] < 0.55 * sent["hetero_pp_tp"]
        print(f"{'bf16 reshard bytes':18s} {sent['bf16g_hetero_pp_tp']} vs f32 {sent['hetero_pp_tp']} "
              f"{'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append("bf16 reshard bytes")
    # Recomputation keeps fewer activations: the first stage of the TP2 -> TP1
    # pipeline (ranks 0, 1; 1F1B keeps two micro-batches there) peaks lower.
    if "hetero_pp_tp" in names and "hetero_pp_tp_recompute" in names:
        act = {n: max(max(r["peak_activation_bytes"][:2]) for r in records(os.path.join(tmp, n + ".jsonl")))
               for n in ("hetero_pp_tp", "hetero_pp_tp_recompute")}
        ok = act["hetero_pp_tp_recompute"] < act["hetero_pp_tp"]
        print(f"{'recompute memory':18s} first-stage activation peak {act['hetero_pp_tp']} -> "
              f"{act['hetero_pp_tp_recompute']} bytes {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append("recompute memory")
    # The dry run (plan explain) predicts the op-internal bytes the run sent:
    # per micro-batch, times the micro-batches of a step.
    if "cp2_tp2" in names:
        spath, ppath = os.path.join(tmp, "cp2_tp2.json"), os.path.join(tmp, "cp2_tp2.plan.json")
        rc, err = run([args.hspmd, "plan", "compile", "--model", model, "--strategy", spath,
                       "--world", "4", "--seq-len", "16", "-o", ppath])
        r = subprocess.run([args.hspmd, "plan", "explain", ppath, "--json"], capture_output=True, text=True)
        traffic = json.loads(r.stdout)["op_traffic"] if r.returncode == 0 and rc == 0 else []
        planned = [4 * sum(t["ranks"].get(str(k), {}).get("bytes_sent", 0) for t in traffic) for k in range(4)]
        sent = records(os.path.join(tmp, "cp2_tp2.jsonl"))[0]["op_bytes_sent"]
        ok = planned == sent and min(sent) > 0
        print(f"{'dry-run op bytes':18s} planned {planned} sent {sent} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append("dry-run op bytes")
    want_loss, want_w = want["fixed"]
    # --init loads full Hugging Face tensors and shards them into the plan.
    init_log = os.path.join(tmp, "init_single.jsonl")
    rc, err = run(common + ["--global-batch", "8", "--init", base_w, "--log", init_log])
    spath = os.path.join(tmp, "init.json")
    json.dump(CASES["asym7_tp421_zero"][1], open(spath, "w"))
    dist_log = os.path.join(tmp, "init_dist.jsonl")
    rc2, err2 = run(common + ["--strategy", spath, "--nproc", "7", "--init", base_w, "--log", dist_log])
    if rc or rc2:
        failures.append("init: " + (err or err2).strip()[-300:])
    else:
        rel = max(abs(a - b) / abs(a) for a, b in zip(losses(init_log), losses(dist_log)))
        ok = rel <= 1e-5 and losses(init_log)[0] != want_loss[0]
        print(f"{'init (7 ranks)':18s} loss rel err {rel:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append("init")
    # The emulated cluster (--cluster: virtual clocks, slowdowns) trains the
    # same model and reports its emulated step time and per-rank compute.
    cluster = os.path.join(tmp, "cluster.json")
    json.dump({"catalog": CLUSTER_CATALOG,
               "nodes": [{"type": "gpu", "ranks": [0, 1]},
                         {"type": "gpu", "ranks": [2, 3], "slowdown": 3.0}]}, open(cluster, "w"))
    # Pipelines with ZeRO (Reshard communication), and CP x TP (the ring
    # attention's and the vocab-parallel loss's communication inside ops,
    # billed through the clocked communicator), the second with packed
    # documents.
    # (The emulation is a CPU feature: not run with --device cuda.)
    for label, case, mode in ([("emulated cluster", "asym_pp_dp_zero", "fixed"),
                               ("emulated cp x tp", "cp2_tp2", "packed")] if args.device == "cpu" else []):
        spath = os.path.join(tmp, "emulated.json")
        json.dump(CASES[case][1], open(spath, "w"))
        elog = os.path.join(tmp, "emulated.jsonl")
        trace = os.path.join(tmp, "trace.json")
        rc, err = run(modes[mode] +
                      ["--strategy", spath, "--nproc", "4", "--cluster", cluster, "--log", elog,
                       "--trace", trace])
        if rc:
            failures.append(label + ": " + err.strip()[-300:])
            continue
        recs = records(elog)
        rel = max(abs(a - r["loss"]) / abs(a) for a, r in zip(want[mode][0], recs))
        ok = (rel <= 1e-5 and all(r["emulated_step_time_s"] > 0 and len(r["emulated_compute_s"]) == 4
                                  and min(r["emulated_compute_s"]) > 0 for r in recs))
        # The timeline: per rank its forward / backward spans and communication.
        events = json.load(open(trace))["traceEvents"]
        for rank in range(4):
            cats = {e.get("cat") for e in events if e["pid"] == rank}
            ok = ok and {"forward", "backward", "comm", "post"} <= cats
        ok = ok and not any(os.path.exists(trace + ".rank%d" % r) for r in range(4))
        print(f"{label:18s} loss rel err {rel:.2e}, emulated step "
              f"{recs[-1]['emulated_step_time_s']:.4f}s {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(label)
    # Wrong plans fail before training, with one line, on every rank count.
    spath = os.path.join(tmp, "wrong.json")
    json.dump(CASES["asym_pp_dp_zero"][1], open(spath, "w"))
    capped = os.path.join(tmp, "capped.json")  # rank 2's memory cap is 100 KiB
    json.dump({"catalog": CLUSTER_CATALOG,
               "nodes": [{"type": "gpu", "ranks": [0, 1]},
                         {"type": "gpu", "ranks": [2, 3], "memory_cap_gib": 0.0001}]}, open(capped, "w"))
    cp_path = os.path.join(tmp, "wrong_cp.json")
    json.dump(CASES["cp2_tp2"][1], open(cp_path, "w"))
    for extra, fragment in [(["--seq-len", "16", "--nproc", "2"], "outside the world of 2 ranks"),
                            (["--seq-len", "14", "--nproc", "4", "CP"],
                             "--seq-len 14 must be a multiple of 4"),
                            (["--seq-len", "16", "--nproc", "4", "--global-batch", "6"],
                             "differs from the strategy"),
                            (["--seq-len", "100", "--nproc", "4"], "max_position_embeddings"),
                            # ranks 2 and 3 share the capped node: the first to fail reports
                            (["--seq-len", "16", "--nproc", "4", "--cluster", capped],
                             ("rank 2: out of memory", "rank 3: out of memory"))][:5 if args.device == "cpu" else 4]:
        cmd = base + ["--strategy", cp_path if "CP" in extra else spath] + [a for a in extra if a != "CP"]
        rc, err = run(cmd)
        lines = [l for l in err.splitlines() if l.strip()]
        fragments = fragment if isinstance(fragment, tuple) else (fragment,)
        ok = (rc != 0 and len(lines) == 1 and any(f in lines[0] for f in fragments) and
              lines[0].startswith("hspmd: error:"))
        print(f"error case {' '.join(extra):36s} {'ok' if ok else 'FAIL: ' + repr(err[-300:])}")
        if not ok:
            failures.append("error case " + " ".join(extra))
    # A failing rank's line that mpirun loses as it tears the job down (seen
    # once under load: exit 1, nothing said) is printed by the launcher from
    # the rank's report claim: still exactly one line.
    if args.device == "cpu":
        rc, err = run(base + ["--strategy", spath, "--seq-len", "16", "--nproc", "4", "--cluster", capped],
                      env={"HSPMD_TEST_LOSE_ERROR_LINE": "1"})
        lines = [l for l in err.splitlines() if l.strip()]
        ok = rc != 0 and len(lines) == 1 and "out of memory" in lines[0] and lines[0].startswith("hspmd: error: rank")
        print(f"error line lost by mpirun, printed by the launcher {'ok' if ok else 'FAIL: ' + repr(err[-300:])}")
        if not ok:
            failures.append("lost error line")
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
