"""hspmd.Trainer: the training loop of `hspmd train`, one step at a time."""
import contextlib
import json
import os
import sys
import threading
import time

from . import _core, _supervision


def _path_arg(value, what, expected="a path (str or os.PathLike)"):
    """`value` as a path string; hspmd.Error naming `what` when it is none
    (os.fspath's TypeError names no argument)."""
    if isinstance(value, (str, bytes, os.PathLike)):
        try:
            path = os.fspath(value)
        except TypeError:
            path = None
        if isinstance(path, (str, bytes)):
            return os.fsdecode(path)
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise _core.Error(f"[train] {what}={shown}: must be {expected}, got {type(value).__name__}")


class Trainer:
    """Trains `model` on the token file `data` under `strategy` (a Strategy,
    its dict or file; None: a world of one with global_batch and
    micro_batches, as `hspmd train` without --strategy).

    The other keyword arguments are the flags of `hspmd train`, dashes as
    underscores, with its defaults: seq_len and steps are required; lr,
    lr_schedule, warmup_steps, min_lr, weight_decay, beta1, beta2, eps,
    clip_grad, seed, init, save, save_dtype, log, checkpoint, save_every,
    resume, threads, precision, grad_reduce_dtype, pack_documents, ... The
    same flags give the same losses as the command line, bit for bit.

    Under mpirun every rank runs the script and makes the same Trainer calls
    in the same order (they are collective). Setup errors raise hspmd.Error
    on every rank; an error inside a step on a world of several ranks prints
    one line and ends the job (as the command line does: the other ranks
    would wait forever)."""

    def __init__(self, model, strategy, data, *, optimizer="adamw", precision="fp32", device="cpu", **flags):
        from . import _model_of, _strategy_of, world
        self._calls = threading.Lock()  # guards _owner, _call, _depth: the thread in a call (_exclusive)
        self._owner, self._call, self._depth = None, None, 0
        self.model = _model_of(model)
        self.strategy = None if strategy is None else _strategy_of(strategy)
        self.world = world()
        self._flags = dict(flags, model=self.model.path, data=data, optimizer=optimizer,
                           precision=precision, device=device)
        if self.world.rank != 0:
            self._flags["progress"] = False
        self._start(self._flags)

    def _start(self, flags):
        options = _core.TrainOptions(flags)
        if self.strategy is None:
            if self.world.size > 1:
                raise _core.Error(f"[options] this is one of {self.world.size} MPI ranks but no strategy was given: "
                                  "each rank would train alone and write the same files")
            options = options.single_process()
        else:
            options.set_strategy(self.strategy._native)
        run = _core.TrainingRun(options, self.world)
        self._run = run  # the old run (load_checkpoint) is dropped here, not before
        self._finished = False
        self.records = []

    @property
    def rank(self):
        return self.world.rank

    @property
    def done(self):
        """Whether every step up to `steps` has been trained."""
        return self._run.done

    @property
    def next_step(self):
        return self._run.next_step

    @contextlib.contextmanager
    def _exclusive(self, call):
        """One thread in the Trainer's calls at a time (they release the GIL
        while they work): another thread's call is refused with hspmd.Error
        before it touches the run, and the call in progress goes on. The
        same thread may nest calls (train() calls step())."""
        me = threading.get_ident()
        with self._calls:
            if self._owner not in (None, me):
                raise _core.Error(f"[train] Trainer.{call}: another thread is in {self._call} of this Trainer; a "
                                  "Trainer's calls run one at a time (wait for that call, or give each thread its "
                                  "own Trainer)")
            if self._owner is None:
                self._owner, self._call = me, call
            self._depth += 1
        try:
            yield
        finally:
            with self._calls:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = self._call = None

    def _check_open(self, call):
        if self._finished:
            raise _core.Error(f"[train] Trainer.{call}: called after finish(), which wrote the run's save= and "
                              "trace=; a finished Trainer trains, switches and loads no more (make a new Trainer)")

    def step(self):
        """Trains the next step; returns its record, the object the command
        line's --log gets for the step (loss, grad_norm, lr, tokens, ...,
        unix_time). hspmd.Error after finish(), and while another thread is
        in a call of this Trainer."""
        with self._exclusive("step()"):
            self._check_open("step()")
            try:
                record = json.loads(self._run.step())
            except _core.Error as e:
                self._abort_others(e)
                raise
            record["unix_time"] = time.time()
            _supervision.step_done(record["step"])
            self.records.append(record)
            return record

    def train(self):
        """Trains the remaining steps, then finish(); returns their records.
        hspmd.Error after finish()."""
        with self._exclusive("train()"):
            self._check_open("train()")
            out = []
            while not self.done:
                out.append(self.step())
            self.finish()
            return out

    def finish(self):
        """Waits for the last checkpoint and writes `save` and `trace`. Once:
        later calls do nothing, and step(), train(), switch_to(),
        load_state_dict() and load_checkpoint() raise hspmd.Error (what
        finish wrote stays the run's result); state_dict() and
        save_checkpoint() still read the finished run."""
        with self._exclusive("finish()"):
            if not self._finished:
                self._finished = True
                try:
                    self._run.finish()
                except _core.Error as e:
                    self._abort_others(e)
                    raise

    def state_dict(self):
        """{Hugging Face name: float32 numpy array}: the full weights (the fp32
        masters under bf16 precision), the same on every rank. Collective."""
        with self._exclusive("state_dict()"):
            return self._run.parameters()

    def switch_to(self, target):
        """Moves the run to another strategy or plan before the next step,
        as `hspmd train --switch STEP:FILE` does at that step (the same
        switch algorithm, switch_algorithm= and switch_bucket_mb=, and the
        same {"event": "switch"} record in the log). `target`: a Strategy,
        its dict, a Plan from compile_plan (for this world), or the path of
        a strategy or plan JSON. The global batch must stay the same. A bad
        target raises hspmd.Error on every rank and the run goes on under
        its plan. Collective."""
        with self._exclusive("switch_to()"):
            self._switch_to(target)

    def _switch_to(self, target):
        from . import Plan, Strategy, _strategy_of
        self._check_open("switch_to()")
        strategy = plan = None
        if isinstance(target, Plan):
            plan, source = target, "the compiled plan"
        elif isinstance(target, (Strategy, dict)):
            strategy, source = _strategy_of(target), "the strategy"
        else:
            source = _path_arg(target, "Trainer.switch_to(): target",
                               "a Strategy, its dict, a Plan, or the path of a strategy or plan JSON")
        self._run.switch_to(strategy._native if strategy else None, plan._native if plan else None, source)
        # load_checkpoint continues under the plan in force
        if strategy is not None:
            self.strategy = strategy
        elif plan is not None and plan.strategy is not None:
            self.strategy = plan.strategy
        else:
            try:
                self.strategy = Strategy.from_json(source)
            except _core.Error:  # a plan file: its strategy
                self.strategy = Plan.from_json(source).strategy

    def load_state_dict(self, weights):
        """Replaces the weights with `weights`, {Hugging Face name: float32
        numpy array} of the full tensors (every rank gives the same; each
        keeps its slices), as state_dict() returns them. Checked as init=
        is: every parameter present with its shape, no other name, float32,
        finite; hspmd.Error naming the tensor otherwise (nothing changed).
        The Adam moments restart at zero; the step count (lr schedule, Adam's
        bias correction) and the data position go on. Before the first step
        this is the run init= with these weights would train. Collective.
        hspmd.Error after finish()."""
        self._check_open("load_state_dict()")
        self._run.load_parameters(dict(weights), "load_state_dict")

    def save_checkpoint(self, directory):
        """Writes the training state (weights, masters, Adam moments, step,
        data cursor) as a committed checkpoint in `directory` (docs/checkpoint.md).
        A directory holding another run's committed checkpoint is refused
        with hspmd.Error (nothing written): a run writes over its own
        checkpoints and the one it resumed only, or over checkpoint= with
        overwrite_checkpoint=True. Collective."""
        directory = _path_arg(directory, "Trainer.save_checkpoint(): directory")
        with self._exclusive("save_checkpoint()"):
            self._run.save_checkpoint(directory)

    def load_checkpoint(self, directory):
        """Continues from the checkpoint in `directory` (under this trainer's
        strategy, whatever the checkpoint's was): the next step is the
        checkpoint's. Collective. A checkpoint that cannot be loaded raises
        hspmd.Error and the Trainer goes on with its run as it was.
        hspmd.Error after finish()."""
        directory = _path_arg(directory, "Trainer.load_checkpoint(): directory")
        with self._exclusive("load_checkpoint()"):
            self._check_open("load_checkpoint()")
            flags = dict(self._flags, resume=directory)
            # The old run's pending background checkpoint is committed first
            # (it may be the one loaded); the old run is dropped only once the
            # new one stands, so a failed load leaves the Trainer as it was.
            self._run.wait_for_checkpoint()
            self._start(flags)
            self._flags = flags

    def _abort_others(self, error):
        if self.world.size > 1:
            if _supervision.claim_report():  # under `hspmd launch`: the job's first error only
                sys.stderr.write(f"hspmd: error: rank {self.world.rank}: {error}\n")
                sys.stderr.flush()
            self.world.abort(1)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.finish()
        return False
