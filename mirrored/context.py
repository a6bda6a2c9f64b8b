"""Which strategy and which replica the current thread is in.

TensorFlow keeps a per-thread stack of (strategy, replica context) pairs:
``strategy.scope()`` pushes (strategy, None) — the *cross-replica* context —
and each replica thread of ``strategy.run`` pushes (strategy, ReplicaContext).
``merge_call`` pushes (strategy, None) again while the merge function runs.
This module is that stack, nothing more; ``strategy.py`` defines the public
functions (``get_strategy``, ``get_replica_context``...) over it.
"""
import threading

_local = threading.local()


def stack():
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def push(strategy, replica_context):
    stack().append((strategy, replica_context))


def pop():
    stack().pop()


def top():
    """(strategy, replica_context) of the innermost entry, or (None, None)."""
    s = stack()
    return s[-1] if s else (None, None)


def set_stack(entries):
    """Give a replica thread its own stack (it starts empty in a new thread)."""
    _local.stack = list(entries)
