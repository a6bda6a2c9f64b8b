"""Keras's progress line, character for character:

    Epoch 1/12
    938/938 [==============================] - 23s 25ms/step - loss: 0.2154 - accuracy: 0.9368

``verbose=1``: the bar (redrawn in place on a terminal or in a notebook, at most
every ``REFRESH_S`` seconds, because each redraw reads the metrics from the
device); ``verbose=2``: one line per epoch; ``verbose=0``: silent.

A data set of unknown length (``fit(ds.repeat())`` with no ``steps_per_epoch``,
which Keras runs for ever) shows Keras's ``N/Unknown`` with the step count growing:
redrawn like the bar, and where output is not redrawn (a log file, a captured
stream) as a new line every ``UNKNOWN_LOG_S`` seconds, so the run never looks stuck.
"""
import math
import sys
import time

BAR_WIDTH = 30          # Keras's bar width
REFRESH_S = 0.5         # redraw interval: each redraw synchronises the devices
UNKNOWN_LOG_S = 10.0    # unknown length, output not redrawn: a progress line this often


def _dynamic():
    """True on a terminal or in a running Jupyter kernel, where '\r' redraws the line.

    (Only a running kernel counts: merely importing ipykernel — as nbclient does in a
    test process — must not turn captured output into redrawn lines.)
    """
    if hasattr(sys.stdout, "isatty") and sys.stdout.isatty():
        return True
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def format_metrics(metrics):
    parts = []
    for name, value in metrics.items():
        parts.append(f" - {name}: {value:.4f}" if abs(value) > 1e-3 else f" - {name}: {value:.4e}")
    return "".join(parts)


def format_time_per_step(seconds):
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.0f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


def bar(current, target):
    """``938/938 [==============================]`` (``target`` None: unknown length)."""
    if target is None:
        return f"{current:7d}/Unknown"
    digits = int(math.log10(target)) + 1 if target > 0 else 1
    text = f"{current:{digits}d}/{target} ["
    prog_width = int(BAR_WIDTH * current / target) if target else BAR_WIDTH
    if prog_width > 0:
        text += "=" * (prog_width - 1)
        text += ">" if current < target else "="
    text += "." * (BAR_WIDTH - prog_width) + "]"
    return text


class Progbar:
    def __init__(self, target, verbose=1):
        self.target, self.verbose = target, verbose
        self.start = time.perf_counter()
        self.last_draw = 0.0
        self.dynamic = _dynamic()

    def wants_update(self, current):
        """Whether to read metrics now (a device sync): dynamic bars every REFRESH_S; an
        epoch of unknown length also every UNKNOWN_LOG_S where nothing is redrawn."""
        if self.verbose != 1 or current == self.target:
            return False
        since = time.perf_counter() - self.last_draw
        if self.dynamic:
            return since >= REFRESH_S
        return self.target is None and since >= UNKNOWN_LOG_S

    def update(self, current, metrics):
        self.last_draw = time.perf_counter()
        elapsed = self.last_draw - self.start
        if self.target is None:       # Keras: elapsed time and time per step, no ETA
            per_step = format_time_per_step(elapsed / current if current else 0)
            line = f"{bar(current, None)} - {elapsed:.0f}s {per_step}{format_metrics(metrics)}"
        else:
            eta = elapsed / current * (self.target - current) if current else 0
            line = f"{bar(current, self.target)} - ETA: {eta:.0f}s{format_metrics(metrics)}"
        sys.stdout.write(("\r" if self.dynamic else "") + line + ("" if self.dynamic else "\n"))
        sys.stdout.flush()

    def finish(self, current, metrics):
        elapsed = time.perf_counter() - self.start
        per_step = format_time_per_step(elapsed / current if current else 0)
        if self.verbose == 1:
            line = f"{bar(current, self.target)} - {elapsed:.0f}s {per_step}{format_metrics(metrics)}"
            sys.stdout.write(("\r" if self.dynamic else "") + line + "\n")
        elif self.verbose == 2:
            total = self.target if self.target is not None else current
            sys.stdout.write(f"{total}/{total} - {elapsed:.0f}s{format_metrics(metrics)} - "
                             f"{elapsed:.0f}s/epoch - {per_step}\n")
        sys.stdout.flush()
        return elapsed
