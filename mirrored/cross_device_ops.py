"""Cross-device reductions: how N replicas' values become one sum.

TensorFlow's boundary, kept: a ``CrossDeviceOps`` object's public methods
(``reduce``, ``batch_reduce``, ``broadcast``) validate their arguments, pack the
tensors, and then call ONE implementation hook,

    _sum_in_place(buffers, devices)

which receives one flat 1-D buffer per device (same size and dtype) and must
leave every buffer holding the elementwise sum over all devices. Everything
else — MEAN (sum, then divide by N), several tensors at once, copying a result
to other destinations — is done here, once, for every algorithm:

* ``ReductionToOneDevice``: copy every buffer to one device, add them there in
  replica order, copy the sum back to every device. Simple; the one device's
  links carry all the traffic. (TensorFlow's fallback when NCCL is missing.)
* ``RingAllReduce`` (ring all-reduce over peer memory): ``ring.py``, the file
  lab 03 opens.

Tensor fusion: ``batch_reduce`` packs all tensors of one dtype into a single
flat buffer per device and reduces that once (as Horovod and PyTorch DDP do):
one ring for all of a model's gradients instead of one per weight.

Bad input (a device listed twice, different shapes or dtypes on different
devices, an empty device list) is refused before anything runs, so no device is
ever left holding a partial sum.

Neighbours: ``ring.py`` (``RingAllReduce``, the default), ``collective_all_reduce.py``
(the same ring across workers), ``strategy.py`` (which calls these through
``strategy.extended``), ``distribute.py`` (the public names).
"""
import numpy as np

from mirrored import devices as _dev
from mirrored.tensor import Tensor
from mirrored.values import DistributedValues, Mirrored


class ReduceOp:
    """``ReduceOp.SUM`` / ``ReduceOp.MEAN``; the strings "SUM", "sum", "MEAN", "mean" work too."""

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation):
        name = getattr(aggregation, "name", str(aggregation))
        return ReduceOp.validate(name)

    @staticmethod
    def validate(op):
        name = getattr(op, "value", op)
        if isinstance(name, str) and name.upper() in ("SUM", "MEAN"):
            return name.upper()
        raise ValueError(f"{op!r} is not a reduce op: use mirrored.distribute.ReduceOp.SUM or "
                         f".MEAN (or the strings 'SUM' / 'MEAN').")


def _device_of(component, what):
    if not isinstance(component, Tensor):
        raise TypeError(f"{what}: expected a mirrored.Tensor on each replica, got "
                        f"{type(component).__name__} ({component!r:.60}). Only numeric tensors "
                        f"can be reduced across replicas.")
    if component.dtype.kind not in "fiu":
        raise TypeError(f"{what}: cannot reduce tensors of dtype {component.dtype}; only numbers add up.")
    return component.dev


def check_distinct(devices, what, why="each replica needs its own device"):
    """Refuse a device list that names one device twice (the one duplicate check)."""
    names = [d.name for d in devices]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"{what}: device {dup} is listed twice; {why}.")


def validate_components(components, what="reduce"):
    """Check one component per distinct device, equal shapes and dtypes; return the devices."""
    if not components:
        raise ValueError(f"{what}: no devices to reduce over (the device list is empty).")
    devices = [_device_of(c, what) for c in components]
    check_distinct(devices, what)
    first = components[0]
    for c in components[1:]:
        if c.shape != first.shape or c.dtype != first.dtype:
            raise ValueError(f"{what}: replicas hold different tensors: {first.shape} {first.dtype} "
                             f"on {first.device} but {c.shape} {c.dtype} on {c.device}. "
                             f"Every replica must contribute the same shape and dtype.")
    return devices


def _as_components(value):
    if isinstance(value, DistributedValues):
        return list(value.values)
    return [value]


def _destination_devices(destinations, fallback):
    """Devices named by ``destinations``: a device string, a DistributedValues or variable."""
    if destinations is None:
        return fallback
    if isinstance(destinations, DistributedValues):
        return [_dev.get_device(v.device) for v in destinations.values]
    if hasattr(destinations, "device") and not isinstance(destinations, str):
        return [_dev.get_device(destinations.device)]
    if isinstance(destinations, (list, tuple)):
        return [_dev.get_device(d) for d in destinations]
    return [_dev.get_device(destinations)]


class CrossDeviceOps:
    """Base class: validation, packing and MEAN here; the sum in ``_sum_in_place``."""

    def _sum_in_place(self, buffers, devices):
        """Make every ``buffers[i]`` (flat, on ``devices[i]``) the elementwise sum of all."""
        raise NotImplementedError

    # -- public API (TensorFlow's)
    def reduce(self, reduce_op, per_replica_value, destinations=None, options=None):
        """Reduce one value across replicas; the result on every destination device."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """Reduce several values at once (one fused buffer per dtype); list of Mirrored."""
        reduce_op = ReduceOp.validate(reduce_op)
        pairs = list(value_destination_pairs)
        if not pairs:
            return []
        values = [_as_components(v) for v, _ in pairs]
        reduced = self.all_reduce_components(reduce_op, values)
        return [self._to_destinations(r, dest) for r, (_, dest) in zip(reduced, pairs)]

    def broadcast(self, tensor, destinations):
        """``tensor`` copied to every destination device, as a Mirrored."""
        src = tensor.values[0] if isinstance(tensor, DistributedValues) else tensor
        _device_of(src, "broadcast")
        return self._to_destinations([src], destinations)

    # -- shared machinery
    def all_reduce_flat(self, reduce_op, buffers, devices):
        """All-reduce buffers that are already flat and fused (a model's packed
        gradients): one per device, same size and dtype; in place."""
        reduce_op = ReduceOp.validate(reduce_op)
        if len(buffers) != len(devices) or not devices:
            raise ValueError(f"all_reduce_flat: need one buffer per device, got {len(buffers)} "
                             f"buffers for {[d.name for d in devices]}.")
        check_distinct(devices, "all_reduce_flat")
        if any(b.shape != buffers[0].shape or b.dtype != buffers[0].dtype for b in buffers):
            raise ValueError("all_reduce_flat: the buffers differ in shape or dtype.")
        if reduce_op == ReduceOp.MEAN and np.dtype(buffers[0].dtype).kind in "iu":
            raise TypeError(f"all_reduce_flat: the MEAN of {buffers[0].dtype} values is float64 "
                            f"(it divides as /), which cannot be written in place; use "
                            f"all_reduce_components or SUM.")
        self._reduce_fused(reduce_op, buffers, devices)
        return buffers

    def _group_size(self, devices):
        """How many replicas the sum runs over: these devices (one machine). The
        multi-worker ring counts every worker's replicas (``collective_all_reduce.py``)."""
        return len(devices)

    def _reduce_fused(self, reduce_op, buffers, devices):
        """Sum equal flat buffers across devices (the hook), then divide for MEAN."""
        n = self._group_size(devices)
        if n < 2 or not buffers[0].size:
            return
        self._sum_in_place(buffers, devices)
        if reduce_op == ReduceOp.MEAN:
            for dev, flat in zip(devices, buffers):
                with dev.activate():
                    dev.ops.binary_scalar("div", flat, n, flat)

    def all_reduce_components(self, reduce_op, values):
        """values[k] = [component on replica 0, 1, ...] for tensor k.

        Returns, for every k, the list of reduced components, one per replica
        device (views into the fused buffer: no copy on the way out).
        """
        reduce_op = ReduceOp.validate(reduce_op)
        devices = None
        for comps in values:
            d = validate_components(comps, "all-reduce")
            if devices is None:
                devices = d
            elif [x.name for x in d] != [x.name for x in devices]:
                raise ValueError(f"all-reduce: the tensors live on different device lists: "
                                 f"{[x.name for x in devices]} and {[x.name for x in d]}.")
        results = [None] * len(values)
        by_dtype = {}
        for k, comps in enumerate(values):
            by_dtype.setdefault(comps[0].dtype, []).append(k)
        for dtype, ks in by_dtype.items():
            sizes = [int(np.prod(values[k][0].shape, dtype=np.int64)) for k in ks]
            total = sum(sizes)
            fused = []
            for r, dev in enumerate(devices):           # pack: tensor fusion
                with dev.activate():
                    flat = dev.empty((total,), dtype)
                    off = 0
                    for k, size in zip(ks, sizes):
                        if size:
                            dev.copy_into(flat[off:off + size], values[k][r].buf)
                        off += size
                    fused.append(flat)
            if reduce_op == ReduceOp.MEAN and np.dtype(dtype).kind in "iu":
                fused = self._integer_mean(fused, devices)
            else:
                self._reduce_fused(reduce_op, fused, devices)
            for k, size, off in zip(ks, sizes, np.cumsum([0] + sizes[:-1])):
                shape = values[k][0].shape
                results[k] = [Tensor(flat[off:off + size].reshape(shape), dev)
                              for dev, flat in zip(devices, fused)]
        return results

    def _integer_mean(self, fused, devices):
        """MEAN of integer buffers as TensorFlow's cross-device ops compute it: the SUM,
        then ``/ N``, and ``/`` promotes integers to float64 (replica ids 0 and 1 give
        0.5, as ``strategy.reduce`` does). New float64 buffers, one per device."""
        self._reduce_fused(ReduceOp.SUM, fused, devices)
        out = []
        for dev, flat in zip(devices, fused):
            with dev.activate():
                mean = dev.empty(flat.shape, np.float64)
                dev.ops.cast(flat, mean)
                dev.ops.binary_scalar("div", mean, self._group_size(devices), mean)
            out.append(mean)
        return out

    def _to_destinations(self, components, destinations):
        src_devices = [c.dev for c in components]
        dst_devices = _destination_devices(destinations, src_devices)
        out = []
        for dst in dst_devices:
            match = next((c for c in components if c.dev is dst), None)
            if match is None:
                src = components[0]
                with dst.activate():
                    match = Tensor(dst.copy_from(src.buf, src.dev), dst)
            out.append(match)
        return Mirrored(out)


class ReductionToOneDevice(CrossDeviceOps):
    """Copy everything to one device, add there in replica order, copy the sum back.

    ``reduce_to_device``: where the sum is formed (default: the first replica's
    device). Each of the other N−1 devices sends its whole buffer in and gets
    the whole sum back, all through the reducing device's links.
    """

    def __init__(self, reduce_to_device=None):
        self.reduce_to_device = reduce_to_device

    def _sum_in_place(self, buffers, devices):
        hub = _dev.get_device(self.reduce_to_device) if self.reduce_to_device else devices[0]
        with hub.activate():
            total = hub.copy_from(buffers[0], devices[0])
            for buf, dev in zip(buffers[1:], devices[1:]):
                incoming = hub.copy_from(buf, dev)
                hub.ops.binary("add", total, incoming, total)
        for buf, dev in zip(buffers, devices):
            with dev.activate():
                if dev is hub:
                    dev.copy_into(buf, total)
                else:
                    copy = dev.copy_from(total, hub)
                    dev.copy_into(buf, copy)


class NcclAllReduce(CrossDeviceOps):
    """Not available: NCCL is not used here."""

    def __init__(self, num_packs=1):
        raise NotImplementedError(
            "NcclAllReduce: mirrored does not use NCCL; its all-reduce is our own ring over "
            "peer memory. Use mirrored.distribute.RingAllReduce() (the default), or "
            "ReductionToOneDevice() as the simple baseline.")
