"""Saving and loading in Keras 3's file formats, atomically.

Two formats, Keras 3's, so that a model trained here loads in TensorFlow/Keras and back:

``model.save_weights("w.weights.h5")`` / ``load_weights``: an HDF5 file (h5py) laid out as
Keras 3's ``saving_lib.save_weights_only`` writes it (keras/src/saving/saving_lib.py,
``H5IOStore``)::

    /vars                       group, attrs name=<model name>         (a Sequential has no own variables)
    /layers/<key>/vars/<i>      dataset i of layer <key>: Keras's variable order (kernel, then bias)
    /layers/<key>/vars          attrs name=<layer name>; empty for a layer without weights (Flatten)
    /optimizer/vars/<i>         when compiled: 0 = iteration (int64), 1 = learning_rate (float32),
                                then each trainable variable's slots in turn
                                (Adam: momentum, velocity; SGD with momentum: momentum)

``<key>`` is NOT the layer's name (names differ from run to run): it is the layer class in
snake case, numbered per model in order, as Keras's ``_save_container_state`` does:
``conv2d``, ``max_pooling2d``, ``flatten``, ``dense``, ``dense_1``, ... A functional model's
input layer has a group too (``layers/input_layer/vars``, empty). The paths are those of
Keras's walk, which goes into models used as layers (``layers/sequential/layers/dense/vars``),
a subclassed model's attributes (``head/vars``) and a layer's sublayers: ``weights_layout.py``.
Reading follows Keras's ``load_weights``: the model is walked, each layer reads its
group (a missing group is an empty one), the count and shapes must match, and the
optimizer's variables are restored only when the model's optimizer already has as many
(Keras warns and skips otherwise).

``model.save("m.keras")`` / ``models.load_model("m.keras")``: Keras 3's zip archive,
``metadata.json``, ``config.json`` (the model's architecture and compile arguments, in
Keras's ``serialize_keras_object`` shape) and ``model.weights.h5`` (the layout above,
optimizer included, plus the layers' training state): training resumes exactly where it
stopped, bit for bit, dropout masks included.

The training state (``Layer.training_state``: a Dropout's seed and per-replica mask
counters) is written, in the archive only, as HDF5 attributes of the layer's group::

    /layers/<key>/vars          attrs mirrored_seed=<uint64>, mirrored_steps=<int64 (replicas,)>

Keras 3 (3.15 checked) keeps its Dropout's SeedGenerator state in neither file: its
layer groups hold the layer's variables only, so a Keras model loaded from a .keras file
restarts its counters, and its ``save_weights`` / ``load_weights`` neither write nor touch
them. A dataset there would break Keras's load (it counts a layer's datasets), an extra
archive member would make it open an assets store, but attributes other than ``name`` it
never reads: so our state goes there, and our files stay Keras's. ``save_weights`` /
``load_weights`` leave it out, as Keras's do; a Keras file (no such attributes) loads
with fresh counters, as in Keras.

Every file is written to a hidden temporary file beside the target (``.weights-<pid>-*``,
``.keras-<pid>-*``), flushed to disk and renamed into place (``os.replace``): a failed or
killed save leaves any previous file intact. A save into a folder first removes the
temporaries that a killed save (``kill -9``) left there: those of processes no longer alive.
Loading a truncated, empty or foreign file names the file and says what is wrong.
Before any array is read, ``file_safety.py`` checks that nothing in the file points outside
it (links, external storage, virtual datasets: refused, as Keras 3 refuses them) and that
every dataset has its variable's shape and dtype (a file cannot make us allocate what the
model does not hold); a damaged archive member raises ``mirrored.errors.DataLossError``.
``load_model`` builds the model the config describes only once the weights that config
implies (``weight_shapes.py``, nothing allocated) are found in the file, stored
(``_check_before_build``): a few bytes of config cannot make us build a huge layer.

Neighbours: ``model_api.py`` (``model.save``/``save_weights``/``load_weights``),
``weights_layout.py`` (where each weight goes: Keras 3's walk of the model),
``file_safety.py`` (what a file we load may not make us do),
``functional_config.py`` (a functional model's config),
``optimizer_state.py`` (``keras_variables``: the optimizer's state in Keras's order),
``layers.py`` (the layers rebuilt from a config; ``get_config``: each layer's config; ``initializers.py``: the initialisers' names).
"""
import contextlib
import datetime
import functools
import inspect
import io
import json
import math
import os
import tempfile
import time
import warnings
import zipfile

import numpy as np

from mirrored import nest
from mirrored.keras import compile_utils, file_safety, functional_config, initializers, weight_shapes
from mirrored.keras import layers as L
from mirrored.keras import losses as _losses
from mirrored.keras import metrics as _metrics
from mirrored.keras import optimizers as _optimizers
from mirrored.keras import optimizers_more  # noqa: F401 (RMSprop, Adagrad, AdamW in optimizers.NAMES)
from mirrored.keras import schedules
from mirrored.keras.optimizer_state import BASE_ARGUMENTS
from mirrored.keras.weights_layout import (  # noqa: F401 (MODEL_CLASSES, register_model_class: models.py's)
    MODEL_CLASSES, all_reached, earlier_entries, earlier_variables, group_name, is_container, layer_key,
    planned_entries, register_model_class, variables_of, weight_entries)

WEIGHTS_SUFFIX = ".weights.h5"
MODEL_SUFFIX = ".keras"
ARCHIVE_WEIGHTS = "model.weights.h5"          # inside a .keras archive (Keras's _VARS_FNAME_H5)
STATE_PREFIX = "mirrored_"   # a layer group's attributes holding its training state (docstring)
TEMP_PREFIXES = {WEIGHTS_SUFFIX: ".weights-", MODEL_SUFFIX: ".keras-"}
LEGACY_STALE_S = 3600    # temporaries named without a pid (older versions): stale after an hour
KERAS_VERSION = "3.0.0"  # the format version written into metadata.json


def _h5py():
    try:
        import h5py
    except ImportError as err:   # pragma: no cover - h5py is a dependency
        raise ImportError("saving in Keras's formats needs h5py: python -m pip install h5py") from err
    return h5py


# -- atomic writes, and the temporaries of killed saves ---------------------------------------
def _pid_of(name, prefix):
    """The writer's pid in a temporary's name ``<prefix><pid>-<random>.tmp``, else None."""
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() and "-" in name[len(prefix):] else None


def _alive(pid):
    if pid == os.getpid():
        return True                  # a save in progress in another thread of this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                  # someone else's live process
    return True


def clean_stale_temporaries(folder):
    """Remove the temporaries of saves killed before their rename (ours only: hidden files
    named ``.weights-<pid>-*`` / ``.keras-<pid>-*`` whose process has ended; unnamed ones,
    from older versions, once an hour old). Returns the names removed."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        prefix = next((p for p in TEMP_PREFIXES.values() if name.startswith(p)), None)
        if prefix is None:
            continue
        path = os.path.join(folder, name)
        pid = _pid_of(name, prefix)
        try:
            stale = (not _alive(pid)) if pid is not None else \
                time.time() - os.path.getmtime(path) > LEGACY_STALE_S
            if stale and os.path.isfile(path):
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass                     # gone already, or not ours to remove
    return removed


def _atomic_write(filepath, suffix, write):
    """``write(tmp_path)`` then fsync and rename onto ``filepath``; nothing half-written.

    The file gets the mode an ordinary ``open(filepath, "w")`` would give it, 0666 less
    the umask (0644 under the usual umask 022), as h5py and Keras give theirs: mkstemp
    makes its file 0600, which kept checkpoints from the user's other processes (a
    serving job). The mode is set on the temporary file, before the rename. A write that
    fails (a full disk, a file-size limit) raises an ``OSError`` naming ``filepath``
    (``file_safety.write_error``); the temporary is removed and the old file stays."""
    folder = os.path.dirname(os.path.abspath(filepath))
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        clean_stale_temporaries(folder)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIXES[suffix]}{os.getpid()}-", suffix=".tmp", dir=folder)
        os.close(fd)
        os.chmod(tmp, NEW_FILE_MODE & ~current_umask())
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, filepath)
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(err, OSError):
            raise file_safety.write_error(err, filepath) from err
        raise


#: The mode ``open()`` asks for when it creates a file; the umask then takes bits away.
NEW_FILE_MODE = 0o666


def current_umask():
    """This process's umask, read without changing it (Linux's /proc/self/status has it;
    elsewhere it is set and put back at once, as the standard library cannot read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _check_suffix(filepath, suffix, what):
    if not filepath.endswith(suffix):
        hint = (" (Keras 3's weights format; the whole model, with its optimizer, goes to "
                "model.save('name.keras'))" if suffix == WEIGHTS_SUFFIX else
                " (Keras 3's model format; weights alone: model.save_weights('name.weights.h5'))")
        raise ValueError(f"{what}: the file name must end in {suffix}{hint}, got {filepath!r}.")


# -- the HDF5 layout ------------------------------------------------------------------------------
def _write_h5(model, target, training_state=False):
    """Write ``model``'s weights (and its optimizer's state, when compiled) in Keras's layout
    to ``target`` (a path or a binary file object); ``training_state``: the layers' too, as
    attributes Keras ignores (a .keras archive; the docstring says why there).

    A path gets the file built in memory first and written in one ``write``, as ``save``
    does: h5py writing straight to a file that cannot grow (a full disk, a file-size limit)
    failed inside its close and, with h5py 3.16 and HDF5 2.0, could take the process down
    (SIGSEGV; issue 42). Plain bytes fail with an ordinary ``OSError``."""
    if isinstance(target, (str, os.PathLike)):
        buffer = io.BytesIO()
        _write_h5(model, buffer, training_state)
        with open(target, "wb") as f:
            f.write(buffer.getbuffer())
        return
    h5py = _h5py()
    with h5py.File(target, "w") as f:
        entries = weight_entries(model)
        all_reached(model, entries)                     # nothing left out of the file
        for path, obj, _ in entries:                     # nested models and sublayers walked into
            group = f.create_group(group_name(path))
            group.attrs["name"] = obj.name
            for i, w in enumerate(variables_of(obj)):         # Keras's: trainable, then not
                group.create_dataset(str(i), data=np.asarray(w.numpy(), np.float32))
            for name, value in ((obj.training_state() or {}).items() if training_state and path else ()):
                group.attrs[STATE_PREFIX + name] = value
        if model.optimizer is not None and model.built:
            group = f.create_group("optimizer/vars")
            group.attrs["name"] = model.optimizer.name
            for i, value in enumerate(model.optimizer.keras_variables(model.step.pack)):
                group.create_dataset(str(i), data=value)


def _not_weights(filepath, err):
    size = os.path.getsize(filepath) if isinstance(filepath, str) and os.path.exists(filepath) else None
    what = ("it is empty (0 bytes)" if size == 0 else
            f"it is truncated, damaged or not an HDF5 file ({type(err).__name__}: {err})")
    return ValueError(f"{filepath} is not a Keras weights file: {what}. Write one with "
                      f"model.save_weights('name.weights.h5') (or model.save('name.keras')).")


@contextlib.contextmanager
def _weights_file(source, filepath):
    """The open Keras 3 weights file ``source`` (a path or a file object; ``filepath`` names
    it in errors) once no link in it leads outside it (``file_safety.refuse_links``), as
    ``(file, {path: its "vars" group, or whatever stands there})`` (``_vars_groups``). Any
    failure of h5py inside, which can only be damage, is named as such (``_not_weights``);
    our refusals (``file_safety.Refused``) pass as they are."""
    h5py = _h5py()
    try:
        with h5py.File(source, "r") as f:
            file_safety.refuse_links(f, filepath)
            if not any(isinstance(f.get(name), h5py.Group) for name in ("layers", LEGACY_LAYERS, "vars")):
                raise file_safety.Refused(f"{filepath} has no 'layers' group: it is an HDF5 file but not a "
                                          f"Keras 3 weights file (top-level groups: {sorted(f.keys())}).")
            yield f, _vars_groups(f, h5py)
    except (file_safety.Refused, MemoryError, NotImplementedError):     # ours: they say what is wrong
        raise
    except Exception as err:      # h5py on a damaged file: OSError, KeyError, ValueError, TypeError...
        raise _not_weights(filepath, err) from err


#: Keras 3.0's name for the ``layers`` group (read as ``layers``).
LEGACY_LAYERS = "_layer_checkpoint_dependencies"


def _vars_groups(f, h5py):
    """{path: what stands at ``<path>/vars``} for every ``vars`` in the file but the
    optimizer's (``weight_entries``' paths: "" for the model's own), whatever the nesting.
    No data read."""
    found = {}

    def visit(name, obj):
        parts = name.split("/")
        if parts[-1] != "vars" or parts[0] == "optimizer" or "vars" in parts[:-1]:
            return
        if parts[0] == LEGACY_LAYERS:
            parts[0] = "layers"
        found["/".join(parts[:-1])] = obj
    f.visititems(visit)
    return found


def _read_h5(source, filepath, model, force=False, training_state=False):
    """Read a Keras 3 weights file for ``model``, checking everything before reading any
    data (``file_safety.py`` says why): no link leads outside the file, then every dataset
    the model will take has the shape and dtype of its variable, then the arrays are read.
    ``source``: a path or a file object; ``filepath`` names it in errors; ``force``: as
    ``_check_optimizer``; ``training_state``: read the layers' too (a .keras archive).

    Returns (the weights in ``model.set_weights``'s order, the optimizer's values or None,
    {layer path: training state}). Changes nothing: the caller sets them."""
    h5py = _h5py()
    with _weights_file(source, filepath) as (f, groups):
        entries, variables = weight_entries(model), lambda path, obj: variables_of(obj)
        try:
            per_layer = _check_layers(entries, groups, filepath)
        except file_safety.Refused as keras_layout:
            entries, variables = earlier_entries(model), earlier_variables
            try:                                          # a file of an earlier version of ours
                per_layer = _check_layers(entries, groups, filepath)
            except file_safety.Refused:
                raise keras_layout from None
        by_variable = {id(v): d for (path, obj, _), datasets in zip(entries, per_layer)
                       for v, d in zip(variables(path, obj), datasets)}
        weights = [by_variable[id(v)] for v in all_reached(model, entries, variables)]   # set_weights's order
        opt = f.get("optimizer")
        opt = _check_optimizer(model, opt.get("vars") if isinstance(opt, h5py.Group) else None,
                               filepath, force)
        arrays = [file_safety.read_dataset(d) for d in weights]
        values = None if opt is None else [file_safety.read_dataset(d) for d in opt]
        states = {}
        for key, group in (groups.items() if training_state else ()):
            names = [n for n in (group.attrs if isinstance(group, h5py.Group) else ()) if n.startswith(STATE_PREFIX)]
            if names:                             # the names only, so far: read_attribute checks sizes
                states[key] = {n[len(STATE_PREFIX):]: file_safety.read_attribute(
                    group.attrs, n, filepath, group_name(key)) for n in names}
    return arrays, values, states


def _check_layers(entries, groups, filepath):
    """The datasets that each entry takes, a list per entry, from ``groups`` ({path: what
    stands at ``<path>/vars``}, ``_vars_groups``), each checked against its variable; no
    data read. ``entries``: ``[(path, object, [(variable name, shape)])]`` (``weight_entries``):
    the weights of a built model, or those a config will give it (``weight_shapes.py``)."""
    h5py = _h5py()
    per_layer = []
    for path, obj, want in entries:
        where, key = group_name(path), layer_key(path)
        what = f"layer {key!r} ({type(obj).__name__} {obj.name!r})" if path else "the model's own"
        group = groups.get(path)
        if group is not None and not isinstance(group, h5py.Group):
            raise file_safety.Refused(f"{filepath}: {where!r} is a {type(group).__name__}, not a group: it is "
                                      f"not a Keras 3 weights file.")
        have = len(group) if group is not None else 0
        if have != len(want):
            nested = (" Keras 3 keeps the weights of a model used as a layer in its layers' groups "
                      f"({path}/layers/<key>/vars); a file that has them in the model's own group was "
                      f"written by an earlier version of this library: load it there and save it again."
                      if is_container(obj) and path else "")
            raise file_safety.Refused(f"{filepath}: {what} has {len(want)} weight arrays in this model, the "
                                      f"file has {have} in {where!r} (the file's weight groups: "
                                      f"{sorted(group_name(k) for k in groups)}). Build the same model as the "
                                      f"one saved." + nested)
        per_layer.append([file_safety.check_dataset(group.get(str(i)), shape, file_safety.FLOAT_KINDS, filepath,
                                                    f"{name} (layer {key!r})") for i, (name, shape) in enumerate(want)])
    paths = {path for path, _, _ in entries}
    extra = sorted(group_name(k) for k, g in groups.items()
                   if k not in paths and isinstance(g, h5py.Group) and len(g))
    if extra:
        raise file_safety.Refused(f"{filepath} holds weights for layers this model does not have: {extra} "
                                  f"(the model's: {sorted(group_name(p) for p in paths)}).")
    return per_layer


def _check_before_build(plan, source, filepath, nested=False):
    """Before ``load_model`` builds the model a config describes: the file's weights
    (``source``) must be exactly the weights ``plan`` says that model will have
    (``[(layer, [(name, shape)] or None)]``, ``weight_shapes.py``; nothing allocated yet;
    models used as layers in it are built already, each checked by this before its build),
    and the file must store the bytes they declare (``file_safety.check_stored``). Where the
    weights are unknown before the build (``None``: a subclassed model, rebuilt by its own
    ``from_config``), the layers' least possible size (``weight_shapes.minimum_count``) is
    held to the bytes the file stores. ``nested``: ``plan`` is a model used as a layer, whose
    place in the file is not known yet: what it declares is held to the bytes the whole file
    stores (the exact check follows, the outer model's). Raises ``file_safety.Refused``; reads
    no data."""
    h5py = _h5py()
    with _weights_file(source, filepath) as (_, groups):
        stored = [d for g in groups.values() if isinstance(g, h5py.Group) for d in g.values()]
        itemsize = np.dtype(np.float32).itemsize
        if nested:
            declared = sum(math.prod(shape) for _, want in plan for _, shape in (want or ()))
            least = sum(weight_shapes.minimum_count(layer) for layer, want in plan if want is None)
            file_safety.check_stored(stored, filepath, (declared + least) * itemsize)
            return
        entries = planned_entries(plan)
        if all(want is not None for _, _, want in entries):
            file_safety.check_stored([d for ds in _check_layers(entries, groups, filepath) for d in ds], filepath)
            return
        least = sum(weight_shapes.minimum_count(layer) for layer, _ in plan) * itemsize
        file_safety.check_stored(stored, filepath, least)


def _check_optimizer(model, group, filepath, force):
    """The optimizer's datasets to restore, checked (no data read), as Keras's
    ``Optimizer.load_own_variables`` decides: when the counts agree; else it warns and
    skips (returns None). ``force`` (load_model): count the slots as built, as Keras's
    ``compile_from_config`` builds the optimizer before the weights are read."""
    opt = model.optimizer
    if opt is None or group is None or not model.built:
        return None
    pack = model.step.pack
    have = opt.keras_variable_count(pack, built=True if force else None)
    if len(group) != have:
        warnings.warn(f"Skipping variable loading for optimizer '{opt.name}', because it has {have} "
                      f"variables whereas the saved optimizer has {len(group)} variables (in {filepath})."
                      + (" This is likely because the optimizer has not been called/built yet."
                         if have == opt.keras_head else ""), stacklevel=4 if force else 6)
        return None
    slots = [(f"optimizer slot {opt.slot_names[j]} of {pack.variables[i].name}", pack.shapes[i])
             for i, j in opt.keras_slot_order(pack)]
    head = [("optimizer iteration", ()), ("optimizer learning_rate", ())][:opt.keras_head]
    wanted = head + slots[:have - len(head)]
    return [file_safety.check_dataset(group.get(str(i)), shape,
                                      file_safety.NUMBER_KINDS if i < len(head) else file_safety.FLOAT_KINDS,
                                      filepath, what) for i, (what, shape) in enumerate(wanted)]


def _restore_optimizer(model, values):
    """The function that restores the optimizer's ``values`` (checked by ``_check_optimizer``;
    a no-op when there are none), built now so that it checks before anything changes."""
    if values is None:
        return lambda: None
    return model.optimizer.keras_variables_setter(model.step.pack, values)


# -- save_weights / load_weights ----------------------------------------------------------------
def _savable(model, filepath, overwrite, suffix, what):
    """The checks before ``save_weights`` / ``save`` write anything: the file name's suffix,
    ``overwrite``, a built model. Returns the path as a string."""
    filepath = os.fspath(filepath)
    _check_suffix(filepath, suffix, what)
    if not overwrite and os.path.exists(filepath):
        raise FileExistsError(f"{filepath} exists and overwrite=False.")
    if not model.built:
        raise ValueError("You are saving a model that has not yet been built: give the first layer an "
                         "input_shape, or call fit() or build() first.")
    return filepath


def save_weights(model, filepath, overwrite=True):
    """Write ``model``'s weights to exactly ``filepath`` (``*.weights.h5``), atomically."""
    filepath = _savable(model, filepath, overwrite, WEIGHTS_SUFFIX, "save_weights")
    _atomic_write(filepath, WEIGHTS_SUFFIX, lambda tmp: _write_h5(model, tmp))


def load_weights(model, filepath):
    """Read a ``*.weights.h5`` (or the weights of a ``*.keras``) file into ``model``."""
    filepath = os.fspath(filepath)
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"no weights file at {filepath}; save one with "
                                f"model.save_weights('name.weights.h5').")
    if filepath.endswith(MODEL_SUFFIX):
        with _archive(filepath) as zf:
            source = io.BytesIO(file_safety.read_member(zf, ARCHIVE_WEIGHTS, filepath))
    else:
        _check_suffix(filepath, WEIGHTS_SUFFIX, "load_weights")
        source = filepath
    if not model.built:      # the file is checked against the model's shapes: it needs them
        raise ValueError("You are loading weights into a model that has not yet been built: give the "
                         "first layer an input_shape, or call fit() or build() first.")
    # a .keras archive's training state is not read: Keras's load_weights leaves it alone too
    arrays, values, _ = _read_h5(source, filepath, model)
    restore = _restore_optimizer(model, values)       # checked before anything changes
    model.set_weights(arrays)
    restore()


# -- model.save / load_model ---------------------------------------------------------------------
@contextlib.contextmanager
def _archive(filepath):
    try:
        zf = zipfile.ZipFile(filepath, "r")
    except MemoryError:
        raise
    except Exception as err:      # BadZipFile, EOFError, OSError; NotImplementedError for a flipped version byte
        size = os.path.getsize(filepath)
        what = ("it is empty (0 bytes)" if size == 0 else
                f"it is truncated, damaged or not a zip archive ({type(err).__name__}: {err})")
        raise ValueError(f"{filepath} is not a Keras model file: {what}. Write one with "
                         f"model.save('name.keras').") from err
    with zf:
        missing = {"config.json", ARCHIVE_WEIGHTS} - set(zf.namelist())
        if missing:
            raise ValueError(f"{filepath} is a zip archive but not a Keras model file: it lacks "
                             f"{sorted(missing)}.")
        yield zf      # its members are read with file_safety.read_member: damage is named there


def save_model(model, filepath, overwrite=True):
    """``model.save("m.keras")``: architecture, weights and optimizer state, atomically."""
    filepath = _savable(model, filepath, overwrite, MODEL_SUFFIX, "save")
    config = json.dumps(model_config(model))
    metadata = json.dumps({"keras_version": KERAS_VERSION,
                           "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S")})
    weights = io.BytesIO()
    _write_h5(model, weights, training_state=True)

    def write(tmp):
        with zipfile.ZipFile(tmp, "w") as zf:
            zf.writestr("metadata.json", metadata)
            zf.writestr("config.json", config)
            zf.writestr(ARCHIVE_WEIGHTS, weights.getvalue())
    _atomic_write(filepath, MODEL_SUFFIX, write)


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True):
    """``keras.models.load_model("m.keras")``: the model, built under the strategy in scope,
    compiled as it was (unless ``compile=False``), with its weights and optimizer state."""
    filepath = os.fspath(filepath)
    _check_suffix(filepath, MODEL_SUFFIX, "load_model")
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"no model file at {filepath}; save one with model.save('name.keras').")
    with _archive(filepath) as zf:
        config = file_safety.read_member(zf, "config.json", filepath)
        weights = file_safety.read_member(zf, ARCHIVE_WEIGHTS, filepath)
    try:
        config = json.loads(config)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{filepath}: config.json is not valid JSON ({err}).") from err
    # what the config describes is checked against the weights the file stores before it is
    # built (a few bytes of config can declare a huge layer); then the weights against the
    # model built, before any is read
    model = model_from_config(config, custom_objects, before_build=lambda plan, nested=False: _check_before_build(
        plan, io.BytesIO(weights), filepath, nested))
    if compile and config.get("compile_config"):
        compile_from_config(model, config["compile_config"])
    arrays, values, states = _read_h5(io.BytesIO(weights), filepath, model, force=True, training_state=True)
    restore = _restore_optimizer(model, values)
    model.set_weights(arrays)
    restore()
    for path, layer, _ in weight_entries(model):                     # a model of our own: an error
        if path in states:                                           # leaves nobody a half-set one
            layer.set_training_state(states[path], f"{filepath} (layer {layer_key(path)!r})")
    return model


# -- configs (Keras's serialize_keras_object shape) ----------------------------------------------
def _ser(module, class_name, config):
    return {"module": module, "class_name": class_name, "config": config, "registered_name": None}


def _layer_entry(layer):
    if type(layer).__name__ in ("Sequential", "Functional") and MODEL_CLASSES.get(type(layer).__name__) is type(layer):
        entry = model_config(layer)                      # a model used as a layer: its own config, as Keras
        entry.pop("compile_config", None)
        return entry
    return _ser("keras.layers", type(layer).__name__, layer.get_config())


def model_config(model):
    """What Keras 3 writes to a .keras archive's config.json: a Sequential's, a functional
    model's (``functional_config.py``), or a subclassed model's own ``get_config``."""
    kind = type(model).__name__
    if MODEL_CLASSES.get(kind) is not type(model):                    # a subclassed model
        config = subclassed_config(model)
    elif kind == "Functional":
        config = functional_config.functional_config(model, _layer_entry)
    else:
        layers = [_ser("keras.layers", "InputLayer",
                       {"batch_shape": list(model.input_shape), "dtype": "float32", "sparse": False,
                        "name": "input_layer"})]
        layers += [_layer_entry(l) for l in model.layers]
        config = _ser("keras", "Sequential", {"name": model.name, "trainable": model.trainable, "dtype": "float32",
                                              "layers": layers})
        config["build_config"] = {"input_shape": list(model.input_shape)}
    config["compile_config"] = compile_config(model)
    return config


def compile_config(model):
    """Keras 3's compile config of ``model`` (``model.get_compile_config()``, a .keras file's
    ``compile_config``): the arguments of its ``compile``; None if it was never compiled."""
    if model.optimizer is None or model.loss is None or not hasattr(model.optimizer, "get_config"):
        return None                 # never compiled, or a train_step of its own with no loss/optimizer
    loss, weights = model.loss, None
    metrics = [name for name in model.metrics_names[1:] if name in _metrics.BY_NAME]
    if isinstance(loss, compile_utils.CompileLoss):       # several outputs: the arguments as given
        loss, weights = nest.map_structure(_loss_entry, loss.user_loss), loss.user_weights
        given = [m.user_metrics for m in model.metrics if isinstance(m, compile_utils.OutputMetrics)]
        metrics = given[0] if given and all(isinstance(m, str) for m in nest.flatten(given[0])) else None
    else:
        loss = _loss_entry(loss)
    return {
        "optimizer": _ser("keras.optimizers", type(model.optimizer).__name__, model.optimizer.get_config()),
        "loss": loss, "loss_weights": weights, "metrics": metrics, "weighted_metrics": None,
        "run_eagerly": model.run_eagerly, "steps_per_execution": model.steps_per_execution,
        "jit_compile": False}


def _loss_entry(loss):
    """One loss of a compile config: a name as given, or the loss object's serialised config."""
    if loss is None or isinstance(loss, str):
        return loss
    return _ser("keras.losses", type(loss).__name__, dict(loss.get_config(), **(
        {"ignore_class": None} if type(loss).__name__ == "SparseCategoricalCrossentropy" else {})))


def _kwargs_for(cls, config, what):
    """The entries of a Keras config that ``cls`` takes (Keras's other keys, such as
    ``trainable``, ``dtype`` or regularizers left at None, have no counterpart here)."""
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in config.items() if k in params and k != "self"}
    for key in ("kernel_initializer", "bias_initializer"):
        spec = kwargs.get(key)
        if isinstance(spec, dict) or spec is None:
            name = L.snake_case(spec["class_name"]) if isinstance(spec, dict) else None
            if name in initializers.INITIALIZERS:
                kwargs[key] = name
            else:
                kwargs.pop(key, None)    # unknown initializer: the default (the file has the weights)
    ignored = {k: v for k, v in config.items() if k not in params and v not in (None, False, [], {})
               and k not in ("name", "trainable", "dtype", "data_format", "dilation_rate", "groups",
                             "batch_shape", "sparse", "batch_input_shape", "use_bias")}
    for k in list(ignored):
        if k.endswith(("regularizer", "constraint")) or k in ("lora_rank", "noise_shape", "input_shape"):
            raise NotImplementedError(f"{what}: {k}={ignored[k]!r} is not supported here.")
    return kwargs


def _input_from_config(spec):
    cfg = spec["config"]
    shape = cfg.get("batch_shape") or cfg.get("batch_input_shape")
    return L.Input(shape=tuple(shape[1:]), name=cfg.get("name"))


def _layer_from_config(spec, custom_objects=None, before_build=None):
    """A new layer from its entry in a model's config: the layers this library has, or a
    class of the user's own passed in ``custom_objects`` (rebuilt by its ``from_config``:
    code is never read from the file, only the arguments its ``get_config`` wrote)."""
    name, cfg = spec["class_name"], dict(spec["config"])
    custom = (custom_objects or {}).get(name)
    if custom is not None:
        layer = custom.from_config(cfg)
        if cfg.get("batch_input_shape") and getattr(layer, "input_shape_arg", None) is None:
            layer.input_shape_arg = tuple(cfg["batch_input_shape"][1:])
        return layer
    if name in ("Sequential", "Functional") and isinstance(cfg.get("layers"), list):
        nested = None if before_build is None else functools.partial(before_build, nested=True)
        return model_from_config(spec, custom_objects, nested)    # a model used as a layer (issue 49)
    cls = getattr(L, name, None) if name in L.SUPPORTED else None
    if cls is None:
        raise NotImplementedError(f"layer {name!r} is not implemented here; the layers are "
                                  f"{', '.join(L.SUPPORTED)}; a layer of your own loads when you pass "
                                  f"its class: load_model(path, custom_objects={{{name!r}: {name}}}).")
    kwargs = _kwargs_for(cls, cfg, f"{name} {cfg.get('name')!r}")
    if cfg.get("batch_input_shape"):
        kwargs["input_shape"] = tuple(cfg["batch_input_shape"][1:])
    layer = cls(**kwargs)
    layer.trainable = cfg.get("trainable", True) is not False    # a frozen layer stays frozen
    return layer


def subclassed_config(model):
    """Keras 3's rule for a subclassed model: its config is its own ``get_config`` (the
    arguments of its ``__init__``); without one it cannot be saved whole."""
    name = type(model).__name__
    if type(model).get_config is MODEL_CLASSES["Model"].get_config:
        raise NotImplementedError(
            f"model.save of the subclassed model {name}: it has no get_config(), so its architecture "
            f"cannot be written (Keras 3's rule). Define get_config(self) returning the arguments of "
            f"its __init__ (and load with custom_objects={{'{name}': {name}}}), or save the weights "
            f"alone: model.save_weights('name.weights.h5').")
    config = {"module": type(model).__module__, "class_name": name, "config": model.get_config(),
              "registered_name": name}
    config["build_config"] = {"input_shape": list(model.input_shape)}
    return config


def model_from_config(config, custom_objects=None, before_build=None):
    """A model from Keras's config: Sequential, Functional, or a subclass named in
    ``custom_objects`` (rebuilt by its ``from_config``).

    ``before_build(plan)``, when given, is called once the layers exist and before any is
    built (no weight allocated): ``plan`` is ``[(layer, [(variable name, shape)])]`` in the
    model's order, the weights the config gives it (``weight_shapes.py``), or, for a
    subclassed model, ``[(layer, None)]`` for its layers so far (their weights are unknown
    until it is built). ``load_model`` checks there that the file holds those weights. A model
    used as a layer is made (and built) before its container: its own ``before_build`` is
    this one with ``nested=True`` (``before_build(plan, nested=True)``)."""
    kind = config.get("class_name")
    custom = (custom_objects or {}).get(kind)
    build = config.get("build_config") or {}
    if custom is not None:
        model = custom.from_config(config["config"])
        if not model.built and build.get("input_shape"):
            if before_build is not None:
                before_build([(layer, None) for layer in model.layers])
            model.build(tuple(build["input_shape"]))
        return model
    if functional_config.is_functional(config):
        made = {}                       # one layer per entry, for the plan and for the model

        def make_layer(entry):
            key = id(entry)
            if key not in made:
                made[key] = _layer_from_config(entry, custom_objects, before_build)
            return made[key]
        if before_build is not None:
            before_build(weight_shapes.of_functional(config, make_layer, _input_from_config))
        return functional_config.functional_from_config(
            config, make_layer, _input_from_config,
            lambda inputs, outputs, name: MODEL_CLASSES["Functional"](inputs, outputs, name=name))
    Sequential = MODEL_CLASSES.get(kind) if kind == "Sequential" else None
    if Sequential is None:
        raise NotImplementedError(f"the file holds a model of class {kind!r}: Sequential and functional "
                                  f"models load here, and a subclassed one given in custom_objects "
                                  f"(load_model(path, custom_objects={{{kind!r}: {kind}}})).")
    inner = config["config"]
    model = Sequential(name=inner.get("name"))        # not built until every layer is added
    for spec in inner["layers"]:
        model.add(_input_from_config(spec) if spec["class_name"] == "InputLayer"
                  else _layer_from_config(spec, custom_objects, before_build))
    shape = model.input_shape or build.get("input_shape")
    if shape and before_build is not None:
        before_build(weight_shapes.of_chain(model.layers, weight_shapes.example_shape(
            shape, f"the config of Sequential {model.name!r}")))
    if shape:
        model.build(tuple(shape))
    return model


def compile_from_config(model, compile_config):
    opt = compile_config["optimizer"]
    if isinstance(opt, dict):
        classes = {c.__name__: c for c in _optimizers.NAMES.values()}     # Adam, SGD, RMSprop, ...
        cls = classes.get(opt["class_name"])
        if cls is None:
            raise NotImplementedError(f"optimizer {opt['class_name']!r} is not implemented; {sorted(classes)} are.")
        kwargs = _kwargs_for(cls, opt["config"], opt["class_name"])
        if isinstance(kwargs.get("learning_rate"), dict):                  # a serialized schedule
            kwargs["learning_rate"] = schedules.deserialize(kwargs["learning_rate"])
        base = {k: v for k, v in opt["config"].items() if k in BASE_ARGUMENTS and k not in kwargs}
        opt = cls(**kwargs, **base)       # the base arguments checked there (NOT_IMPLEMENTED: defaults only)
    loss = compile_config["loss"]
    if isinstance(loss, (list, dict)) and not (isinstance(loss, dict) and "class_name" in loss):
        loss = {k: _loss_from_entry(v) for k, v in loss.items()} if isinstance(loss, dict) else \
            [_loss_from_entry(v) for v in loss]                      # one per output (compile_utils.py)
    else:
        loss = _loss_from_entry(loss)
    model.compile(optimizer=opt, loss=loss, metrics=compile_config.get("metrics") or None,
                  loss_weights=compile_config.get("loss_weights"),
                  run_eagerly=bool(compile_config.get("run_eagerly")),
                  steps_per_execution=compile_config.get("steps_per_execution"))   # checked there


def _loss_from_entry(loss):
    """A loss from one entry of a compile config: a name, or a serialised loss object."""
    if isinstance(loss, dict):
        cls = {"SparseCategoricalCrossentropy": _losses.SparseCategoricalCrossentropy,
               "MeanSquaredError": _losses.MeanSquaredError,
               "BinaryCrossentropy": _losses.BinaryCrossentropy,
               "CategoricalCrossentropy": _losses.CategoricalCrossentropy}.get(loss["class_name"])
        if cls is None:
            raise NotImplementedError(f"loss {loss['class_name']!r} is not implemented here.")
        keys = ("from_logits", "reduction", "name") + (
            ("label_smoothing",) if cls is _losses.CategoricalCrossentropy else ())
        loss = cls(**{k: v for k, v in loss["config"].items() if k in keys and (k != "from_logits" or
                                                                               cls is not _losses.MeanSquaredError)})
    return loss
