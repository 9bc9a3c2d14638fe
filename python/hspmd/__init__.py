"""hspmd from Python (docs/python.md): annotations, models, strategies, plans
and training, over the same C++ code as the `hspmd` command line.

Every error of hspmd arrives as hspmd.Error, with the command line's one-line
message."""
import atexit
import json
import os
import tempfile
import time

from . import _core
from . import models
from ._core import (DUP, PARTIAL, DS, DeviceGroup, Annotation, Error, InternalError,  # noqa: F401
                    ModelConfig, AnnotationPlan, deduce)

Error.__module__ = InternalError.__module__ = __name__  # printed as hspmd.Error


# ---- annotations ----

class DSUnion(list):
    """One DS per subgroup, and the hetero dim: -1 (DUP) every subgroup holds
    the whole tensor, -2 (PARTIAL) the subgroups' tensors sum to it, d >= 0
    the tensor is cut along dim d into hsize parts (part_weights: their
    proportions, equal when empty)."""

    def __init__(self, states, hetero_dim=DUP, part_weights=()):
        super().__init__(states)
        self.hetero_dim = hetero_dim
        self.part_weights = list(part_weights)

    @property
    def hsize(self):
        return len(self)

    def __repr__(self):
        return f"DSUnion({list.__repr__(self)}, hetero_dim={self.hetero_dim})"


class DGUnion(list):
    """One DeviceGroup per subgroup."""

    def __init__(self, groups):
        super().__init__(g if isinstance(g, DeviceGroup) else DeviceGroup(g) for g in groups)

    @property
    def hsize(self):
        return len(self)

    def __repr__(self):
        return f"DGUnion({list.__repr__(self)})"


def annotation(dg_union, ds_union):
    """The Annotation of a tensor laid out as ds_union over dg_union."""
    hetero_dim = getattr(ds_union, "hetero_dim", DUP)
    return Annotation(list(dg_union), list(ds_union), hetero_dim, getattr(ds_union, "part_weights", []))


# ---- strategies and plans ----

class Strategy:
    """A parallel strategy (docs/strategy.md): pipelines of stages, each stage
    a set of ranks (tensor parallel) over a range of layers."""

    def __init__(self, native):
        self._native = native

    @staticmethod
    def from_json(value):
        """From a dict, JSON text or a file path; raises hspmd.Error for a bad strategy."""
        _check_json_source(value, "Strategy.from_json(): value", "a dict, JSON text or a strategy file's path")
        if isinstance(value, dict):
            return Strategy(_core.Strategy.from_json(json.dumps(value)))
        if isinstance(value, os.PathLike) or (isinstance(value, str) and os.path.exists(value)):
            return Strategy(_core.Strategy.load(os.fspath(value)))
        return Strategy(_core.Strategy.from_json(value))

    def to_json(self):
        """The strategy as a dict (what the JSON file holds)."""
        return json.loads(self._native.to_json())

    @property
    def global_batch(self):
        return self._native.global_batch

    @property
    def ranks(self):
        return self._native.ranks

    @property
    def world_size(self):
        return max(self.ranks) + 1

    @property
    def description(self):
        return self._native.description

    @property
    def expert_parallel(self):
        """Experts split over groups of this many token slots (docs/moe.md); 1: none."""
        return self._native.expert_parallel

    def __eq__(self, other):
        return isinstance(other, Strategy) and self._native == other._native

    def __repr__(self):
        return f"Strategy({json.dumps(self.to_json())})"


def _check_json_source(value, what, expected):
    """hspmd.Error naming `what` for a value that is neither a dict, text,
    bytes nor a path (pybind11's TypeError names no argument)."""
    if not isinstance(value, (dict, str, bytes, os.PathLike)):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise Error(f"[python] {what}={shown}: must be {expected}, got {type(value).__name__}")


def _temp_json(directory, name, value):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))
    return path


def _model_of(model):
    return model if isinstance(model, models.Model) else models.from_hf(model)


def _strategy_of(strategy):
    return strategy if isinstance(strategy, Strategy) else Strategy.from_json(strategy)


class Plan:
    """An annotation plan: every tensor's annotation (docs/plan.md)."""

    def __init__(self, native):
        self._native = native

    @staticmethod
    def from_json(value):
        _check_json_source(value, "Plan.from_json(): value", "a dict, JSON text or a plan file's path")
        if isinstance(value, dict):
            return Plan(AnnotationPlan.from_json(json.dumps(value)))
        if isinstance(value, os.PathLike) or (isinstance(value, str) and os.path.exists(value)):
            return Plan(AnnotationPlan.load(os.fspath(value)))
        return Plan(AnnotationPlan.from_json(value))

    def to_json(self):
        return json.loads(self._native.to_json())

    @property
    def world_size(self):
        return self._native.world_size

    @property
    def tensors(self):
        """{tensor name: Annotation}"""
        return self._native.tensors

    @property
    def strategy(self):
        s = self._native.strategy
        return None if s is None else Strategy(s)

    def explain(self, rank=None, all=False, cluster=None, json_output=False):
        """What `hspmd plan explain` prints for this plan (for one rank, or all
        ranks when rank is None); a dict with json_output."""
        with tempfile.TemporaryDirectory(prefix="hspmd-plan-") as d:
            args = ["explain", _temp_json(d, "plan.json", self._native.to_json())]
            if rank is not None:
                args += ["--rank", str(rank)]
            if all:
                args.append("--all")
            if cluster is not None:
                args += ["--cluster", os.fspath(cluster)]
            if json_output:
                args.append("--json")
            out = _core.plan_cli(args)
        return json.loads(out) if json_output else out

    def __repr__(self):
        return f"Plan({len(self.tensors)} tensors over {self.world_size} ranks)"


def compile_plan(model, strategy, world, seq_len=0, precision="fp32", grad_reduce_dtype="fp32"):
    """Compiles `strategy` for `model` on `world` ranks into a Plan (what
    `hspmd plan compile` writes); raises hspmd.Error naming the broken rule."""
    m, s = _model_of(model), _strategy_of(strategy)
    return Plan(_core.compile_plan(m.config, s._native, world, seq_len, precision, grad_reduce_dtype))


def _flag_args(flags):
    args = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        args.append("--" + key.replace("_", "-"))
        if value is not True:
            args.append(",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
    return args


def plan_cost(model, strategy, cluster, seq_len=None, **flags):
    """The cost model's prediction for `strategy` on `cluster` (what `hspmd
    plan cost --json` prints), as a dict. flags: the command's other flags
    (profile=, lengths=, batch_tokens=, max_seq_len=, dispatch=)."""
    m, s = _model_of(model), _strategy_of(strategy)
    with tempfile.TemporaryDirectory(prefix="hspmd-cost-") as d:
        args = ["cost", "--model", m.path, "--strategy", _temp_json(d, "strategy.json", s._native.to_json()),
                "--cluster", os.fspath(cluster), "--json"]
        args += _flag_args(dict(flags, seq_len=seq_len))
        return json.loads(_core.plan_cli(args))


def plan_search(model, cluster, global_batch, seq_len, **flags):
    """Searches the best strategy (what `hspmd plan search --json` prints), as
    a dict; "strategy" holds the best as a Strategy. flags: the command's
    other flags (zero=True, schedule=, time_limit=, top=, tp=[1, 2], ...)."""
    m = _model_of(model)
    with tempfile.TemporaryDirectory(prefix="hspmd-search-") as d:
        out = os.path.join(d, "best.json")
        args = ["search", "--model", m.path, "--cluster", os.fspath(cluster), "--global-batch", str(global_batch),
                "--seq-len", str(seq_len), "--output", out, "--json"]
        result = json.loads(_core.plan_cli(args + _flag_args(flags)))
        result["strategy"] = Strategy.from_json(out)
    return result


# ---- training ----

_world = None


def world():
    """The process's world: MPI_COMM_WORLD under mpirun (MPI is initialized
    once, here, and finalized at exit), else a world of one."""
    global _world
    if _world is None:
        _world = _core.make_world()
        _supervision.start(_world.rank)  # under `hspmd launch`: heartbeat, one error message
    return _world


@atexit.register
def _release_world():
    global _world
    _world = None  # before MPI_Finalize (a C exit handler, after Python's)


from . import _supervision  # noqa: E402
from .trainer import Trainer  # noqa: E402,F401
