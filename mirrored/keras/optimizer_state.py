"""What Keras saves of an optimizer: its ``variables`` in Keras 3's order (iteration,
learning rate, the slots of each weight), as ``model.save``, ``save_weights`` and
``tf.train.Checkpoint`` write and read them (``OptimizerState``, the base class of
``optimizers.Optimizer``). The update itself (``optimizers.py``) needs none of this.

Neighbours: ``optimizers.py`` (SGD, Adam: the update), ``saving.py`` and
``mirrored/checkpoint.py`` (the files).
"""
import numpy as np


class OptimizerState:
    """An optimizer's state in Keras's terms (the module docstring). Uses the optimizer's
    step count, slots and ``_slot_buffers`` (``optimizers.Optimizer``)."""

    def _pack_slots(self, pack, r):
        return self._slots.get(("pack", id(pack), r))

    def keras_variable_count(self, pack, built=None):
        """``len(optimizer.variables)`` in Keras for a model whose parameters are ``pack``:
        iteration and learning_rate, plus the slots once built (``built``: count them as if
        built; None: as they are now)."""
        if built is None:
            built = self._pack_slots(pack, 0) is not None
        return 2 + (len(self.slot_names) * len(pack.variables) if built else 0)

    def keras_variables(self, pack):
        """Keras 3's ``optimizer.variables`` as NumPy, in its order: iteration (int64),
        learning_rate (float32), then for each trainable variable its slots (Adam: m, v;
        SGD with momentum: the velocity), read from the first replica (all replicas agree)."""
        out = [np.int64(self._step), self.learning_rate.numpy()]
        slots = self._pack_slots(pack, 0)
        if slots is None:
            return out
        dev = pack.devices[0]
        flats = [dev.to_numpy(s) for s in slots]                  # (total,) each
        for off, size, shape in zip(pack.offsets, pack.sizes, pack.shapes):
            out.extend(flat[off:off + size].reshape(shape) for flat in flats)
        return out

    def keras_variables_setter(self, pack, values):
        """The inverse of ``keras_variables``, in two halves: check ``values`` (of a count the
        caller checked) against this optimizer and ``pack``, changing nothing, and return
        the function that sets them: the step counter, the learning rate, and every
        replica's slots (created if need be). ``keras/saving.py`` checks the whole file
        before it calls it.

        ``values`` holds only the iteration and the learning rate when the optimizer that
        wrote them had not taken a step yet (Keras saves no slots then): those two are set
        and the slots left as they are. (Reading slots that were not there raised an
        IndexError after the weights had been loaded: ``load_weights`` between two
        compiled, never-trained models with Adam.)"""
        step = int(np.asarray(values[0]))
        lr = np.float32(np.asarray(values[1]))
        k = len(self.slot_names)
        flats = None
        if k and len(values) > 2:
            if len(values) != 2 + k * len(pack.variables):
                raise ValueError(f"optimizer {self.name}: {len(values)} variables, expected 2 or "
                                 f"{2 + k * len(pack.variables)} (iteration, learning rate, {k} slot(s) for "
                                 f"each of {len(pack.variables)} variables).")
            flats = [np.empty(pack.total, np.float32) for _ in range(k)]
            for i, (off, size, shape) in enumerate(zip(pack.offsets, pack.sizes, pack.shapes)):
                for j in range(k):
                    value = np.asarray(values[2 + i * k + j], np.float32)
                    if value.shape != tuple(shape):
                        raise ValueError(f"optimizer slot {self.slot_names[j]} of {pack.variables[i].name}: "
                                         f"shape {value.shape} in the file, {tuple(shape)} in the model.")
                    flats[j][off:off + size] = value.reshape(-1)

        def apply():
            if flats is not None:                  # the slots first: the one part that may fail
                for r, dev in enumerate(pack.devices):
                    with dev.activate():
                        for buf, flat in zip(self._slot_buffers(("pack", id(pack), r), dev, pack.params[r]),
                                             flats):
                            dev.upload_into(buf, flat)
            self._step = step
            if lr != self.learning_rate.numpy():     # Keras keeps it as float32: the same float32
                self.learning_rate = float(lr)          # keeps this exact float (the same updates)
        return apply
