"""Errors with TensorFlow's names (``tf.errors``), so ``except`` clauses port over.

Every message says what was wrong, what was expected and what to do.
"""


class ResourceExhaustedError(MemoryError):
    """A device ran out of memory (its ``memory_limit`` or the card itself).

    TensorFlow raises ``tf.errors.ResourceExhaustedError`` ("OOM when allocating
    tensor ..."); ours names the device, its limit, what was in use and the request.
    """


class InvalidArgumentError(ValueError):
    """An op got arguments it cannot work with (mixed devices, shapes...)."""


class DeadlineExceededError(RuntimeError):
    """Something waited longer than its deadline (TensorFlow's ``tf.errors.DeadlineExceededError``):
    here, a replica at a merge point whose peers never came."""


class OutOfRangeError(IndexError):
    """An iterator has no more elements (TensorFlow's ``tf.errors.OutOfRangeError``):
    ``get_next()`` of a distributed dataset's iterator past its end."""


class DataLossError(ValueError):
    """A file we read is damaged: cut short, a bit flipped, emptied (TensorFlow's
    ``tf.errors.DataLossError``, which its checkpoint reader raises for a corrupted file).

    Raised for a damaged ``tf.train.Checkpoint`` file (``checkpoint.py``), ``.keras``
    archive or archive member (``keras/file_safety.py``); the message names the file (and
    the member), says what is wrong and what to do. Nothing loaded from the file is kept:
    the model is as it was. A ``ValueError``, as the other errors of a file we cannot use
    (a foreign file, another model's weights), so ``except ValueError`` catches them all.
    """
