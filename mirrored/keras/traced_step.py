"""``fit`` running Keras's step (a model's own ``train_step``, or Keras 3's default one for a model
the fused step cannot run) as a ``@tf.function``, as Keras's TensorFlow trainer wraps it::

    train_function = tf.function(lambda shares: strategy.run(model.train_step, args=(shares,)))

The first batch of each input signature (its shares' shapes and dtypes) runs the step's Python
under a recording (``mirrored/program``): the forward, the tape's backward, the all-reduce and the
update are written down as entries, and the metrics' ``update_state`` as host work. Every later
batch of that signature copies its shares into the recording's input slots and replays the
entries: no Python of the step, the layers or the tape. ``compile(run_eagerly=True)`` runs the
Python every batch instead (Keras's switch).

What a replay cannot give again: a host value read while tracing. The step's returned dict
usually holds ``metric.result()`` values (keras.io's guide returns ``{m.name: m.result() for m in
self.metrics}``); here, as in Keras (``_get_metrics_result_or_logs``), those are read from the
metrics after each replay, the metrics having been updated by the replay's host entries. So
inside this trace ``result()`` refuses nothing (``Recording.results_read_after``). A step that
returns some other host value read while tracing (a number it computed with NumPy) runs eagerly
from its second batch on, as ``@tf.function`` would return the stale number otherwise. Tensors
it returns (a replica's loss) are the replay's own outputs.

Python side effects of the step (a ``print``, a list it appends to) happen when it traces, as
with Keras's ``tf.function``: use ``tf.print`` for every batch.

Neighbours: ``custom_step.py`` (``run_step``, the logs), ``mirrored/traced_function.py``
(``function``), ``metrics.py`` (``result`` inside the trace).
"""
import threading

from mirrored import nest
from mirrored.program import recording
from mirrored.tensor import HostTensor
from mirrored.traced_function import function
from mirrored.values import DistributedValues


class TracedStep:
    """One model's step as a traced function of the replicas' shares (module docstring)."""

    def __init__(self, model, step):
        self.strategy = model.distribute_strategy
        self.step = step                         # what each replica runs on its share
        self.function = function(self._body)
        self.read_after = {}                     # key -> its value when traced (custom_step.logs reads it again)
        self.eager = False                       # a returned host value no metric gives again
        self._local = threading.local()          # what this thread's trace found

    def _body(self, shares):
        """The traced body (its Python runs when a signature is new): the step on every
        replica; the dict's host values (a metric's result read now) kept out of what a
        replay returns, and kept here for the call that traced."""
        active = recording.active()              # None: the function runs this call eagerly
        if active is not None:
            active.results_read_after = True
        result = self.strategy.run(self.step, args=(shares,))
        if not isinstance(result, dict):
            self._local.traced = ({}, result)
            return result
        flat = flatten(result)
        host = {key: value for key, value in flat.items() if read_on_host(value)}
        self._local.traced = (host, flat)
        return {key: value for key, value in flat.items() if key not in host}

    def __call__(self, shares, metric_names):
        """The step on ``shares``: its result, a dict's host values put back as they were when
        traced, for ``custom_step.logs`` to read again from the metrics (``metric_names()``:
        the names it can read, ``custom_step.metric_results``' keys)."""
        self._local.traced = None
        out = self.function(shares)
        traced, self._local.traced = self._local.traced, None
        if traced is not None:                   # this call traced: its Python ran
            host, first = traced
            if set(host) - set(metric_names()):  # a host value no metric gives again
                self.eager = True
                return first
            self.read_after.update(host)
        if not self.read_after or not isinstance(out, dict):
            return out
        return dict(out, **self.read_after)


def flatten(logs):
    """Keras's ``pythonify_logs``: nested dicts flattened, keys sorted."""
    out = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            out.update(flatten(value))
        else:
            out[key] = value
    return out


def read_on_host(value):
    """True when every replica's ``value`` is a host value (what a metric's ``result()`` gives:
    a ``HostTensor``, a ``TraceTimeValue`` while tracing)."""
    parts = value.values if isinstance(value, DistributedValues) else nest.flatten(value)
    return all(isinstance(part, HostTensor) for part in parts)
