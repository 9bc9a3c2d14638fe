"""A rank's side of the `hspmd launch` supervision (src/cli/launcher.h,
RankSupervision): under the launcher (HSPMD_JOB_DIR and HSPMD_LAUNCHER_PID
set), a daemon thread ticks this rank's heartbeat slot and ends the rank when
the launcher is gone; Trainer steps record progress for the watchdog
(--timeout); the first failing rank claims the job's one error message.
Without the launcher, nothing happens."""
import mmap
import os
import select
import struct
import sys
import threading
import time

_SLOT = struct.Struct("<qqqq")  # pid, alive_ns (monotonic), steps (last finished + 1), step_ns
_active = None


def _now_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class _Supervision:
    def __init__(self, rank):
        self.rank = rank
        self.dir = os.environ["HSPMD_JOB_DIR"]
        self.launcher = int(os.environ["HSPMD_LAUNCHER_PID"])
        self.map = None
        try:
            with open(os.path.join(self.dir, "heartbeat"), "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if size >= _SLOT.size * (rank + 1):
                    self.map = mmap.mmap(f.fileno(), size)
        except OSError:
            pass
        try:  # the FIFO reports a hang-up only for a writer that leaves after this open
            self.fifo = os.open(os.path.join(self.dir, "alive"), os.O_RDONLY | os.O_NONBLOCK)
            os.kill(self.launcher, 0)
        except OSError:
            self._launcher_gone()
        self._write(0, os.getpid())
        self._write(1, _now_ns())
        threading.Thread(target=self._watch, name="hspmd-supervision", daemon=True).start()

    def _write(self, field, value):
        if self.map is not None:
            at = _SLOT.size * self.rank + 8 * field
            self.map[at:at + 8] = struct.pack("<q", value)

    def step_done(self, step):
        self._write(3, _now_ns())
        self._write(2, step + 1)

    def _watch(self):
        poller = select.poll()
        poller.register(self.fifo, select.POLLIN)
        tick = 0
        while True:
            for _, events in poller.poll(200):
                if events & (select.POLLHUP | select.POLLERR):
                    self._launcher_gone()
            if tick % 5 == 0:
                try:
                    os.kill(self.launcher, 0)
                except ProcessLookupError:
                    self._launcher_gone()
                except OSError:
                    pass
            self._write(1, _now_ns())
            tick += 1

    def _launcher_gone(self):
        if claim_report():
            sys.stderr.write(f"hspmd: error: rank {self.rank}: the launcher (pid {self.launcher}) is gone; "
                             "ending this rank\n")
            sys.stderr.flush()
        os._exit(1)


def start(rank):
    """Starts the supervision of this rank when it runs under the launcher."""
    global _active
    if _active is None and os.environ.get("HSPMD_JOB_DIR") and os.environ.get("HSPMD_LAUNCHER_PID"):
        _active = _Supervision(rank)
        sys.excepthook = _excepthook


def step_done(step):
    if _active is not None:
        _active.step_done(step)


def claim_report():
    """Whether this rank prints its failure: under the launcher, only the
    first failing rank of the job does (the launcher then adds nothing)."""
    directory = os.environ.get("HSPMD_JOB_DIR")
    if not directory:
        return True
    try:
        os.close(os.open(os.path.join(directory, "report"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except OSError:
        return False


def _excepthook(kind, value, tb):
    """An uncaught exception under the launcher: printed by the first failing
    rank only; an hspmd.Error as its one line."""
    if not claim_report():
        return
    from . import _core
    if isinstance(value, _core.Error):
        sys.stderr.write(f"hspmd: error: rank {_active.rank}: {value}\n")
    else:
        sys.__excepthook__(kind, value, tb)
