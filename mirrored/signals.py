"""Ctrl-C at a safe moment: ``deferred_interrupt()`` holds SIGINT back around a section
that must happen entirely or not at all, and delivers it when the section ends.

Why. Step 4 of a training step updates every replica's copy of the weights, one
device after the other (``keras/optimizers.py``, ``Optimizer.update_buffers``). Python
runs a signal's handler between any two bytecodes of the main thread, so a Ctrl-C that
lands between device 0's update and device 1's would leave the copies different for
ever after: the one thing MirroredStrategy promises they never are. Inside
``deferred_interrupt()`` a SIGINT is only noted; when the block ends, the handler that
was in force runs (Python's own raises ``KeyboardInterrupt``), so the step is done on
every copy and then the program stops. TensorFlow gets the same effect for free: its
step is one call into C++, and Python sees the signal when that call returns.

What it does not do:

* Other threads. Python delivers signals to the main thread only, and only there can a
  handler be installed (``signal.signal``); elsewhere the block runs as it is. Replica
  threads (``mirrored_run.py``) never see a ``KeyboardInterrupt``; their caller, on the
  main thread, does, and ``mirrored_run.py`` makes that caller stop them cleanly.
* Long sections. A deferred Ctrl-C waits for the block to end, so the blocks are kept
  short: the update launches (microseconds on a GPU, one pass over the weights on a CPU).

Sections nest (the outermost one installs the handler and delivers the signal).

Neighbours: ``keras/optimizers.py`` (the update it guards), ``mirrored_run.py``
(the replica threads' hand-offs), ``graphs.py`` (a step replayed as one graph).
"""
import contextlib
import signal
import threading

_depth = 0          # how many deferred sections the main thread is inside


@contextlib.contextmanager
def deferred_interrupt():
    """Run the block with SIGINT held back; deliver it (once) when the block ends."""
    global _depth
    if threading.current_thread() is not threading.main_thread() or _depth:
        yield                      # another thread (no signals here), or an outer section defers
        return
    caught = []                    # (signum, frame) of the SIGINT that arrived during the block

    def note(signum, frame):
        caught.append((signum, frame))

    if signal.getsignal(signal.SIGINT) is None:   # installed outside Python: cannot be put back
        yield
        return
    previous = signal.signal(signal.SIGINT, note)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        signal.signal(signal.SIGINT, previous)
        if caught:
            deliver(previous, *caught[0])


def deliver(handler, signum, frame):
    """Do now what ``handler`` (the one in force before the block) would have done."""
    if callable(handler):
        handler(signum, frame)     # Python's default_int_handler raises KeyboardInterrupt
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)    # the default action: the process stops
    # SIG_IGN: ignored, as it would have been
