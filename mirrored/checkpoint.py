"""``mirrored.train``: ``Checkpoint``, ``CheckpointManager``, ``latest_checkpoint`` (TensorFlow's
``tf.train`` names, as the custom-training tutorial uses them).

    checkpoint = mirrored.train.Checkpoint(optimizer=optimizer, model=model)
    path = checkpoint.save(os.path.join(checkpoint_dir, "ckpt"))     # ".../ckpt-1"
    checkpoint.restore(mirrored.train.latest_checkpoint(checkpoint_dir))

What a checkpoint holds, and the format. TensorFlow writes a ``.index`` and a
``.data-*`` file per checkpoint; here one NumPy ``.npz`` file per checkpoint,
``<prefix>-<n>.npz`` (``save``) or ``<prefix>.npz`` (``write``), with one array per entry:

    save_counter                 int64: how many times ``save`` was called
    model:<key>/input_shape      one example's shape (an unbuilt model is built from it on
                                 restore, once the weights it implies are the file's)
    model:<key>/<i>              the model's weights in Keras's order (``get_weights``)
    optimizer:<key>/<i>          Keras 3's ``optimizer.variables``: iteration, learning_rate,
                                 then each weight's slots (Adam's m and v), from
                                 ``Optimizer.keras_variables``
    variable:<key>               a ``mirrored.Variable``'s value

``<key>`` is the keyword the object was given to ``Checkpoint``. Restoring writes the
values back bit for bit (float32 in, float32 out) to every replica's copy, so training
resumes exactly where it stopped. In the same directory the text file ``checkpoint``
names the latest checkpoint and the ones kept (TensorFlow's format of that file), which
``latest_checkpoint(dir)`` reads. Every file is written to a temporary name and renamed
into place (``os.replace``): a crash never leaves a half-written checkpoint or a state
file that names a missing one; files get ``0666 & ~umask``, as ``open()`` gives. Under
``MultiWorkerMirroredStrategy`` only the chief writes. A damaged checkpoint (cut short, a
bit flipped, emptied) raises ``mirrored.errors.DataLossError`` naming the file, as
TensorFlow does, and restores nothing.

Differences from TensorFlow: objects are matched by their keyword (not by TensorFlow's
object graph), and a model that is not built yet is built on restore from the shape the
file records (TensorFlow defers the restore until the variables exist; the result is the same).
That shape is checked first: the weights it would give the model are worked out with
nothing allocated (``keras/weight_shapes.py``) and must be the file's arrays, shape for
shape, else restore raises and the model stays unbuilt (a few bytes recording an input of
(100000, 100000, 1) in front of ``Flatten`` would otherwise make a gigantic kernel).
Neighbours: ``keras/saving.py`` (``model.save``'s ``.keras`` files), ``keras/file_safety.py``
(reading archive members; damage named), ``keras/weight_shapes.py`` (a model's weights
from shapes alone), ``keras/optimizers.py``.
"""
import io
import math
import os
import re
import tempfile
import zipfile

import numpy as np

from mirrored.keras import weight_shapes
from mirrored.keras.file_safety import FLOAT_KINDS, damaged, read_member, write_error
from mirrored.keras.models import Sequential
from mirrored.keras.optimizers import Optimizer
from mirrored.keras.saving import NEW_FILE_MODE, current_umask
from mirrored.values import Variable

STATE_FILE = "checkpoint"        # TensorFlow's name for the directory's list of checkpoints
_SUFFIX = ".npz"


def _write_atomically(path, data):
    """``data`` (bytes) to ``path`` via a temporary file in the same folder, fsync, rename.
    The file gets ``0666 & ~umask``, as ``open()`` and the Keras files give theirs (mkstemp
    makes it 0600: another user's serving job could not read the checkpoints). A failed
    write (a full disk, a file-size limit) raises an ``OSError`` naming ``path``; the file
    there before is intact."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}-{os.getpid()}-")
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), NEW_FILE_MODE & ~current_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(err, OSError):
            raise write_error(err, path) from err
        raise


def _read_arrays(file):
    """{name: array} of the checkpoint ``file`` (an ``.npz``: a zip archive of ``.npy``
    members), as ``np.load`` gives them, but every failure named: a cut-short, emptied or
    bit-flipped file raises ``DataLossError`` naming it (``file_safety.read_member`` reads
    each member, CRC checked), and each ``.npy`` header must declare exactly the bytes its
    member holds before the array is made (a flipped bit in a shape cannot make us allocate
    gigabytes; ``np.load`` allocates what the header says first)."""
    try:
        zf = zipfile.ZipFile(file)
    except MemoryError:
        raise
    except Exception as err:        # BadZipFile, EOFError, a header that does not parse...
        what = ("it is empty (0 bytes)" if os.path.getsize(file) == 0 else
                f"it is not a complete zip archive ({type(err).__name__}: {err})")
        raise damaged(file, what, "checkpoint") from err
    with zf:
        return {name[:-len(".npy")]: _npy(read_member(zf, name, file, "checkpoint"), file, name)
                for name in zf.namelist()}


def _npy(data, file, name):
    """The array in ``data``, the bytes of member ``name`` (``np.lib.format``'s ``.npy``)."""
    stream = io.BytesIO(data)
    try:
        if not name.endswith(".npy"):
            raise ValueError("a checkpoint's members are .npy arrays")
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, _, dtype = read_header(stream)
        declared, held = math.prod(shape) * dtype.itemsize, len(data) - stream.tell()
        if dtype.hasobject or declared != held:
            raise ValueError(f"its header declares {shape} {dtype} ({declared:,} bytes), it holds {held:,}")
        stream.seek(0)                                # read_array reads the header again
        return np.lib.format.read_array(stream, allow_pickle=False)
    except MemoryError:
        raise
    except Exception as err:
        raise damaged(file, f"its member '{name}' is not an array ({type(err).__name__}: {err})",
                      "checkpoint") from err


def _read_state(directory):
    """(latest, [kept, oldest first]) from ``directory``'s state file, as written paths."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        return None, []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    latest = re.search(r'^model_checkpoint_path: "(.*)"$', text, re.M)
    kept = re.findall(r'^all_model_checkpoint_paths: "(.*)"$', text, re.M)
    return (latest.group(1) if latest else None), kept


def _write_state(directory, latest, kept):
    lines = [f'model_checkpoint_path: "{latest}"'] + [f'all_model_checkpoint_paths: "{p}"' for p in kept]
    _write_atomically(os.path.join(directory, STATE_FILE), ("\n".join(lines) + "\n").encode())


def _absolute(directory, name):
    return name if os.path.isabs(name) else os.path.join(directory, name)


def latest_checkpoint(checkpoint_dir, latest_filename=None):
    """The path of the newest checkpoint in ``checkpoint_dir`` (as ``save`` returned it), or
    ``None`` when there is none (TensorFlow's ``tf.train.latest_checkpoint``)."""
    latest, _ = _read_state(checkpoint_dir)
    if latest is None:
        return None
    path = _absolute(checkpoint_dir, latest)
    return path if os.path.exists(path + _SUFFIX) else None


class _Counter:
    """``checkpoint.save_counter``: reads like a scalar variable."""

    def __init__(self):
        self.value = 0

    def numpy(self):
        return np.int64(self.value)

    def __int__(self):
        return self.value

    def __repr__(self):
        return f"<tf.Variable 'save_counter:0' shape=() dtype=int64, numpy={self.value}>"


class CheckpointLoadStatus:
    """What ``restore`` returns; the assertions pass when every object was restored."""

    def __init__(self, missing=()):
        self._missing = list(missing)

    def assert_consumed(self):
        if self._missing:
            raise AssertionError(f"objects not found in the checkpoint: {self._missing}")
        return self

    assert_existing_objects_matched = assert_consumed

    def expect_partial(self):
        return self

    def assert_nontrivial_match(self):
        return self


class Checkpoint:
    """Models, optimizers and variables to save and restore together (``tf.train.Checkpoint``)."""

    def __init__(self, root=None, **kwargs):
        if root is not None:
            kwargs = dict(kwargs, root=root)
        for key, obj in kwargs.items():
            if not isinstance(obj, (Sequential, Optimizer, Variable)):
                raise TypeError(f"Checkpoint({key}=...): can keep a mirrored.keras model, an "
                                f"optimizer or a mirrored.Variable here, got {type(obj).__name__}.")
        self._objects = dict(kwargs)
        self.save_counter = _Counter()

    def __getattr__(self, name):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"this Checkpoint has no object {name!r}; it holds {sorted(objects)}.")

    # -- what goes in the file
    def _model_for(self, key):
        models = [o for o in self._objects.values() if isinstance(o, Sequential)]
        if len(models) != 1:
            raise ValueError(f"Checkpoint: the optimizer {key!r} is saved with the model it trains; "
                             f"give the Checkpoint exactly one model (it has {len(models)}).")
        return models[0]

    def _arrays(self):
        arrays = {"save_counter": np.int64(self.save_counter.value)}
        for key, obj in self._objects.items():
            if isinstance(obj, Sequential):
                if not obj.built:
                    continue                          # nothing to save yet
                arrays[f"model:{key}/input_shape"] = np.asarray(obj.input_shape[1:], np.int64)
                for i, w in enumerate(obj.get_weights()):
                    arrays[f"model:{key}/{i}"] = w
            elif isinstance(obj, Variable):
                arrays[f"variable:{key}"] = obj.numpy()
        for key, obj in self._objects.items():
            if isinstance(obj, Optimizer):
                model = self._model_for(key)
                if model.built:
                    for i, v in enumerate(obj.keras_variables(model.step.pack)):
                        arrays[f"optimizer:{key}/{i}"] = v
                elif obj.schedule is not None:                # no rate variable: the count
                    arrays[f"optimizer:{key}/0"] = np.int64(obj.step_count)
                else:
                    arrays[f"optimizer:{key}/1"] = obj.learning_rate.numpy()
        return arrays

    def _should_write(self):
        for obj in self._objects.values():
            if isinstance(obj, Sequential):
                return obj.distribute_strategy.extended.should_checkpoint
        return True

    def write(self, file_prefix, options=None):
        """Write this checkpoint to ``file_prefix`` (no counter, no state file); returns the path."""
        if self._should_write():
            buf = io.BytesIO()
            np.savez(buf, **self._arrays())
            _write_atomically(file_prefix + _SUFFIX, buf.getvalue())
        return file_prefix

    def save(self, file_prefix, options=None):
        """``save_counter += 1``, write ``<file_prefix>-<save_counter>``, make it the directory's
        latest; returns that path (TensorFlow's ``Checkpoint.save``)."""
        self.save_counter.value += 1
        path = self.write(f"{file_prefix}-{self.save_counter.value}")
        if self._should_write():
            directory = os.path.dirname(os.path.abspath(path))
            _, kept = _read_state(directory)
            name = os.path.basename(path)
            _write_state(directory, name, [p for p in kept if p != name] + [name])
        return path

    # -- reading it back
    def read(self, save_path, options=None):
        return self.restore(save_path, options)

    def restore(self, save_path, options=None):
        """Put the values saved at ``save_path`` back into every object (all replicas' copies).
        ``None`` (no checkpoint yet, e.g. ``latest_checkpoint`` of an empty folder) restores
        nothing, as TensorFlow. Every value is checked before anything changes."""
        if save_path is None:
            return CheckpointLoadStatus()
        file = save_path + _SUFFIX
        if not os.path.exists(file):
            raise FileNotFoundError(f"no checkpoint at {save_path!r} (looked for {file}); pass a path "
                                    f"that save() returned, or mirrored.train.latest_checkpoint(dir).")
        arrays = _read_arrays(file)                   # DataLossError if damaged, naming the file
        if "save_counter" not in arrays:              # written first into every checkpoint
            raise damaged(file, f"it lacks save_counter, which every checkpoint holds (it has "
                          f"{sorted(arrays)[:8]})", "checkpoint")
        plan, missing = [], []
        for key, obj in self._objects.items():
            if isinstance(obj, Sequential):
                shape_key = f"model:{key}/input_shape"
                if shape_key not in arrays:
                    missing.append(key)
                    continue
                weights = _numbered(arrays, f"model:{key}/")
                if not obj.built:                     # built only once the file is found to fit
                    obj.build((None,) + _check_planned(key, obj, arrays[shape_key], weights, file))
                _check_weights(key, obj, weights, file)
                plan.append((obj.set_weights, weights))
            elif isinstance(obj, Variable):
                value = arrays.get(f"variable:{key}")
                if value is None:
                    missing.append(key)
                    continue
                if value.shape != tuple(obj.shape):
                    raise ValueError(f"checkpoint {save_path!r}: variable {key!r} has shape {value.shape} "
                                     f"there and {tuple(obj.shape)} here.")
                plan.append((obj.assign, value))
        for key, obj in self._objects.items():
            if isinstance(obj, Optimizer):
                values = _numbered(arrays, f"optimizer:{key}/")
                if not values and f"optimizer:{key}/1" not in arrays:
                    missing.append(key)
                    continue
                model = self._model_for(key)
                plan.append((_optimizer_setter(obj, model, values, arrays.get(f"optimizer:{key}/1"), file), None))
        for apply, value in plan:                     # everything checked: now change the objects
            apply() if value is None else apply(value)
        self.save_counter.value = int(arrays["save_counter"])
        return CheckpointLoadStatus(missing)


def _numbered(arrays, prefix):
    out, i = [], 0
    while f"{prefix}{i}" in arrays:
        out.append(arrays[f"{prefix}{i}"])
        i += 1
    return out


def _check_weights(key, model, weights, file):
    shapes = [tuple(v.shape) for v in model.weights]
    got = [w.shape for w in weights]
    if got != shapes:
        raise ValueError(f"checkpoint {file}: model {key!r} has weights of shapes {shapes}, the file "
                         f"{got}: it was saved from another architecture.")


def _check_planned(key, model, input_shape, weights, file):
    """Before the unbuilt ``model`` is built from the file's ``input_shape`` (an array): the
    weights that shape gives it, worked out with nothing allocated
    (``keras/weight_shapes.py``), must be the file's ``weights`` (arrays already read, so
    bounded by the file's bytes), shape for shape, floats; else ``ValueError``, and the model
    stays unbuilt. A layer of the user's own (its weights unknown until it is built) ends
    the exact comparison; the weights of the known layers after it must still fit in what
    the file holds beyond it. Returns the shape to build for (one example's)."""
    what = f"checkpoint {file}: model {key!r}"
    shape = weight_shapes.example_shape(input_shape.tolist(), f"{what}, its recorded input_shape")
    if model.input_shape is not None and tuple(model.input_shape[1:]) != shape:
        raise ValueError(f"{what} takes examples of shape {tuple(model.input_shape[1:])}, the file records "
                         f"{shape}: it was saved from another architecture. Nothing was built.")
    try:
        plan = weight_shapes.of_chain(model.layers, shape)
    except ValueError as err:
        raise ValueError(f"{what}: the file records examples of shape {shape}, which this model's layers do "
                         f"not take ({err}); it was saved from another architecture. Nothing was "
                         f"built.") from err
    cut = next((i for i, (_, shapes) in enumerate(plan) if shapes is None), len(plan))   # the first unknown
    known = [s for _, shapes in plan[:cut] for _, s in shapes]
    later = [s for _, shapes in plan[cut + 1:] if shapes for _, s in shapes]
    got = [tuple(w.shape) for w in weights]
    unknown = cut < len(plan)
    if unknown:
        fits = got[:len(known)] == known and \
            sum(math.prod(s) for s in later) <= sum(w.size for w in weights[len(known):])
    else:
        fits = got == known
    bad = [f"{i}: {w.dtype}" for i, w in enumerate(weights) if w.dtype.kind not in FLOAT_KINDS]
    if not fits or bad:
        found = f"arrays of dtypes {bad}" if fits else f"weights of shapes {got}"
        raise ValueError(f"{what}, built for the examples of shape {shape} the file records, would have "
                         f"weights of shapes {known}{' and more' if unknown else ''}; the file holds {found}: "
                         f"it was saved from another architecture (or changed). Nothing was built: "
                         f"restore it into the model that saved it.")
    return shape


def _optimizer_setter(opt, model, values, lr, file):
    """A function that restores ``opt``'s state: checked now (``Optimizer.keras_variables_setter``
    refuses a wrong count or shape before anything changes), applied later."""
    if values:
        try:
            if len(values) < opt.keras_head:
                raise ValueError(f"optimizer {opt.name}: {len(values)} variable, expected the iteration "
                                 f"and the learning rate at least")
            return opt.keras_variables_setter(model.step.pack, values)
        except ValueError as err:
            raise ValueError(f"checkpoint {file}: {err}") from err

    def set_rate():                                   # only the rate was saved
        opt.learning_rate = float(lr)
    return set_rate


class CheckpointManager:
    """Numbered checkpoints in ``directory``, keeping the newest ``max_to_keep``
    (``tf.train.CheckpointManager``). ``save()`` writes the new one, then records it in
    the state file, then deletes the oldest beyond ``max_to_keep``: at every moment the
    state file names only checkpoints that exist."""

    def __init__(self, checkpoint, directory, max_to_keep, keep_checkpoint_every_n_hours=None,
                 checkpoint_name="ckpt", step_counter=None, checkpoint_interval=None,
                 init_fn=None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"CheckpointManager needs a mirrored.train.Checkpoint, got {checkpoint!r}.")
        if max_to_keep is not None and (int(max_to_keep) != max_to_keep or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive integer or None (keep all), got {max_to_keep!r}.")
        self._checkpoint = checkpoint
        self.directory = directory
        self._max_to_keep = max_to_keep
        self._prefix = os.path.join(directory, checkpoint_name)
        _, kept = _read_state(directory)
        self._kept = [_absolute(directory, p) for p in kept if os.path.exists(_absolute(directory, p) + _SUFFIX)]

    @property
    def checkpoints(self):
        """The kept checkpoints' paths, oldest first."""
        return list(self._kept)

    @property
    def latest_checkpoint(self):
        return self._kept[-1] if self._kept else None

    def save(self, checkpoint_number=None, check_interval=True, options=None):
        if checkpoint_number is not None:
            self._checkpoint.save_counter.value = int(checkpoint_number) - 1
        path = self._checkpoint.save(self._prefix)
        if not self._checkpoint._should_write():
            return path
        self._kept = [p for p in self._kept if p != path] + [path]
        doomed = []
        if self._max_to_keep is not None and len(self._kept) > self._max_to_keep:
            doomed, self._kept = self._kept[:-self._max_to_keep], self._kept[-self._max_to_keep:]
        _write_state(self.directory, os.path.basename(path), [os.path.basename(p) for p in self._kept])
        for old in doomed:                            # after the state file stops naming them
            if os.path.exists(old + _SUFFIX):
                os.remove(old + _SUFFIX)
        return path

    def restore_or_initialize(self):
        if self.latest_checkpoint is not None:
            self._checkpoint.restore(self.latest_checkpoint)
            return self.latest_checkpoint
        return None
