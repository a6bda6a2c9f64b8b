"""What a file we load may not make us do: read outside it, allocate what it only declares,
or fail with an error that names nothing. Checked before any data is read.

``saving.py`` loads Keras 3's files (``.weights.h5``: HDF5; ``.keras``: a zip archive that
holds one) and ``mirrored/checkpoint.py`` its checkpoints (``.npz``: a zip archive of ``.npy``
members). A file may come from anywhere (a course's shared folder, a download, a classmate),
so the loaders treat it as hostile. Three rules; Keras 3's loader has the first two
(keras/src/saving/saving_lib.py: ``safe_get_h5_group``, ``safe_get_h5_dataset``,
``_safe_zip_read``), and the refusals use its words ("Not allowed: H5 file with ...").

1. **Nothing outside the file.** HDF5 can point elsewhere: an *external link* (a group or
   dataset of another HDF5 file), *external storage* (a dataset whose bytes are read from
   any file on the host: ``/etc/passwd`` loaded as a kernel), a *virtual dataset* (assembled
   from other files' datasets), and a *soft link* (another path of the same file, under a
   second name: it makes one array two layers' weights). ``refuse_links`` walks every link
   of the file without following any (h5py's ``visititems_links``: HDF5's ``H5Lvisit``, which
   descends through hard links only) and refuses each of these by name.

2. **Nothing allocated that the model does not justify.** A dataset's shape is only a
   declaration: a 20 KB file can declare a chunked, compressed 74.5 GiB dataset that was
   never written (reading it makes 74.5 GiB of zeros). ``check_dataset`` compares each
   dataset's shape and dtype with the model's variable before ``read_dataset`` reads it, so
   what is read is at most the model's own size. Where the model itself comes from the
   file (``load_model`` builds what config.json describes; a checkpoint records the input
   shape an unbuilt model is built for), the model's weights are worked out first with
   nothing allocated (``weight_shapes.py``), must be the file's datasets, and those must
   store the bytes they declare (``check_stored``): a file justifies only the weights it
   holds. A zip member declares its size too:
   ``read_member`` refuses one that claims far more than it stores (Keras's rule against
   decompression bombs), and an attribute we read must be small (``read_attribute``).

3. **A damaged file is named.** A cut-short, bit-flipped or emptied archive member raised a
   bare ``zlib.error``, ``BadZipFile: Bad CRC-32`` or ``EOFError``; ``read_member`` raises
   ``mirrored.errors.DataLossError`` (TensorFlow's type for a corrupted file) naming the file
   and the member. ``write_error`` does the same for a save that fails (a full disk, a
   file-size limit): an ``OSError`` that names the file and says the old one is intact.

Neighbours: ``saving.py`` (the formats; calls these before reading), ``mirrored/checkpoint.py``
(``.npz`` checkpoints: ``read_member`` for each array), ``mirrored/errors.py``.
"""
import math

import numpy as np

from mirrored.errors import DataLossError

#: A zip member declaring more than this many bytes (Keras: 4 GiB; ours is lower because a
#: genuine member is stored, ratio 1, or compressed a few times, never 100 times)...
ZIP_BOMB_FLOOR_BYTES = 1 << 26        # 64 MiB
#: ...must store at least 1/ZIP_MAX_EXPANSION of them (deflate reaches ~1032:1; Keras: 100).
ZIP_MAX_EXPANSION = 100
#: An attribute we read (a layer's training state: a seed, one count per replica) is tiny.
ATTRIBUTE_MAX_BYTES = 1 << 16         # 64 KiB
#: dtype kinds a weights file's arrays may have: floats for weights and optimizer slots,
#: integers too for the optimizer's iteration count.
FLOAT_KINDS, NUMBER_KINDS = "f", "fiu"


class Refused(ValueError):
    """A file refused by one of our checks: it points outside itself, or does not hold what
    the model takes. (``saving.py`` lets these through as they are; any other failure while
    h5py reads a file, whatever its type, is damage and is named as such.)"""


def _hint():
    return ("A weights file must hold its own arrays and nothing else (Keras 3 refuses such files too): "
            "save the weights again, with model.save_weights or model.save, from the model that has them.")


# -- HDF5: links, external storage, virtual datasets ------------------------------------------
def refuse_links(h5file, filepath):
    """Walk every link of the open HDF5 file ``h5file`` without following any; raise
    ``ValueError`` naming the first soft link, external link, dataset with external storage or
    virtual dataset (and where it points). Reads no data. ``filepath`` names the file.
    ``visit`` returns the refusal (or an error) rather than raising it: h5py's visit stops
    at the first value that is not None and returns it."""
    import h5py

    def visit(name, link):
        try:
            return refusal_of(name, link)
        except Exception as err:      # a damaged object header: raised after the walk
            return err

    def refusal_of(name, link):
        kind = type(link).__name__
        if isinstance(link, h5py.SoftLink):
            where = f" -> '{link.path}'"
        elif isinstance(link, h5py.ExternalLink):
            where = f" -> file '{link.filename}', path '{link.path}'"
        elif not isinstance(link, h5py.HardLink):
            where = " (a user-defined link)"
        else:
            obj = h5file[name]                 # a hard link: an object of this file
            if not isinstance(obj, h5py.Dataset):
                return None
            if obj.external:
                kind, where = "external Dataset", f" (its bytes are read from {obj.external})"
            elif obj.is_virtual:
                kind, where = "virtual Dataset", " (assembled from other datasets, maybe other files)"
            else:
                return None
        return f"Not allowed: H5 file with {kind}: {filepath} has one at '/{name}'{where}. " + _hint()
    refusal = h5file.visititems_links(visit)      # stops at the first non-None return
    if isinstance(refusal, Exception):            # (an exception raised inside h5py's visit
        raise refusal                             # comes out as a SystemError)
    if refusal is not None:
        raise Refused(refusal)


def check_dataset(obj, shape, kinds, filepath, what):
    """``obj`` (from an HDF5 group) is a dataset of ``shape`` whose dtype's kind is in
    ``kinds``; else ``ValueError`` naming ``what`` and both shapes. Reads no data, so a
    dataset that declares a huge shape is refused before anything is allocated."""
    import h5py
    if not isinstance(obj, h5py.Dataset):
        found = "nothing" if obj is None else f"a {type(obj).__name__}"
        raise Refused(f"{filepath}: {what} should be a dataset of shape {tuple(shape)}, the file has "
                         f"{found} there: it is not a Keras weights file of this model.")
    if obj.shape != tuple(shape):
        declared = math.prod(obj.shape or ()) * obj.dtype.itemsize
        raise Refused(f"{filepath}: {what} has shape {tuple(shape)} in this model, the file declares "
                         f"{obj.shape} ({declared:,} bytes): nothing was read. Build the same model as "
                         f"the one saved.")
    if obj.dtype.kind not in kinds or obj.dtype.fields is not None:
        raise Refused(f"{filepath}: {what} has dtype {obj.dtype} in the file; a Keras weights file "
                         f"holds {'floats' if kinds == FLOAT_KINDS else 'numbers'} there.")
    return obj


def read_dataset(obj):
    """The checked dataset's array (float32 weights stay float32)."""
    return np.asarray(obj[()])


def read_attribute(attrs, name, filepath, path):
    """``attrs[name]`` after checking its declared size (``ATTRIBUTE_MAX_BYTES``)."""
    info = attrs.get_id(name)
    declared = math.prod(info.shape or ()) * info.dtype.itemsize
    if declared > ATTRIBUTE_MAX_BYTES:
        raise Refused(f"Not allowed: H5 attribute '{name}' of '/{path}' in {filepath} declares "
                         f"{declared:,} bytes (a layer's training state is a few bytes).")
    return np.asarray(attrs[name])


def declares_too_much(declared, stored):
    """True when ``declared`` bytes are more than ``stored`` bytes can justify: over
    ``ZIP_BOMB_FLOOR_BYTES`` and over ``ZIP_MAX_EXPANSION`` times what is stored."""
    return declared > ZIP_BOMB_FLOOR_BYTES and declared > ZIP_MAX_EXPANSION * stored


def check_stored(datasets, filepath, declared=None):
    """The weights a model built from a file's config will have must be stored in that file,
    not only declared: the ``datasets`` (checked ones, no data read) must store (HDF5's
    ``get_storage_size``: the bytes written for them, compressed or not) enough bytes for
    ``declared`` (default: what their shapes declare; ``declares_too_much`` is the rule).
    A 20 KB file whose config says ``Dense(units=2**31)`` and whose kernel is a chunked
    dataset never written is refused here, before the model is built. Reads no data."""
    import h5py
    datasets = [d for d in datasets if isinstance(d, h5py.Dataset)]
    stored = sum(d.id.get_storage_size() for d in datasets)
    if declared is None:
        declared = sum(math.prod(d.shape or ()) * d.dtype.itemsize for d in datasets)
    if declares_too_much(declared, stored):
        raise Refused(f"Not allowed: {filepath} describes a model whose weights take {declared:,} bytes, and "
                      f"stores {stored:,} bytes of weights: refusing to build it (a file justifies only "
                      f"the weights it holds). Nothing was built. " + _hint())


# -- zip archives: declared sizes, damaged members ----------------------------------------------
def read_member(zf, name, filepath, what="archive"):
    """The bytes of member ``name`` of the open ``zipfile.ZipFile`` ``zf``: its declared size
    checked first (``ZIP_BOMB_FLOOR_BYTES``, ``ZIP_MAX_EXPANSION``), its CRC checked as it is
    read (zipfile does), and any failure to read it, which can only be damage (a cut-short
    or bit-flipped file: ``zlib.error``, ``BadZipFile``, ``EOFError``, an unknown compression
    method, an encryption flag...), raised as ``DataLossError`` naming the file and member.
    ``what``: the kind of file, for the message."""
    info = zf.getinfo(name)
    if declares_too_much(info.file_size, info.compress_size):
        raise Refused(f"Not allowed: ZIP member '{name}' of {filepath} declares {info.file_size:,} bytes "
                         f"but only {info.compress_size:,} are stored; refusing to load a potential "
                         f"decompression bomb.")
    try:
        with zf.open(info) as f:
            return f.read()
    except MemoryError:
        raise
    except Exception as err:      # every other failure to read stored bytes is a damaged file
        raise damaged(filepath, f"its member '{name}' cannot be read ({type(err).__name__}: {err})",
                      what) from err


def damaged(filepath, what_is_wrong, what="file"):
    """The ``DataLossError`` for a damaged ``filepath`` (a ``what``: "archive", "checkpoint")."""
    return DataLossError(f"{filepath} is damaged: {what_is_wrong}. The {what} was cut short, emptied or "
                         f"changed after it was written; nothing was loaded from it. Use an earlier copy "
                         f"or save it again.")


# -- writing: a failed save names its file --------------------------------------------------------
def write_error(err, filepath):
    """The ``OSError`` to raise when writing ``filepath`` failed with ``err`` (a full disk:
    ENOSPC; a file-size limit: EFBIG): the same errno, hence the same subclass
    (``PermissionError``...), a message naming the file and saying the old one is intact."""
    reason = err.strerror or str(err)
    msg = (f"could not save {filepath}: {reason}. Nothing was replaced: the file there before, if any, "
           f"is intact. Free some space (or raise the file-size limit) and save again.")
    return OSError(err.errno, msg) if err.errno else OSError(msg)
