"""``mirrored.config``: TensorFlow's device-configuration functions.

    import mirrored as tf
    gpus = tf.config.list_physical_devices("GPU")
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=1024)] * 4)
    tf.config.list_logical_devices("GPU")    # four logical GPUs on one card

With no GPU, split the CPU the same way to run N replicas on a laptop:

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

The machinery lives in ``devices.py``; this module is the public face.
"""
from mirrored import devices as _dev
from mirrored.devices import LogicalDevice, LogicalDeviceConfiguration, PhysicalDevice

__all__ = ["list_physical_devices", "list_logical_devices", "set_logical_device_configuration",
           "get_logical_device_configuration", "LogicalDeviceConfiguration", "PhysicalDevice",
           "LogicalDevice", "experimental"]


#: Device types TensorFlow knows that we never have: asking for them lists nothing, as in
#: TensorFlow, so the usual detection code (``if list_physical_devices("TPU"): ...``) runs.
ABSENT_TYPES = ("TPU", "TPU_SYSTEM", "XLA_CPU", "XLA_GPU")


def _check_type(device_type):
    if device_type is None:
        return None
    kind = str(device_type).upper()
    if kind not in ("CPU", "GPU") + ABSENT_TYPES:
        raise ValueError(f"device_type must be 'CPU', 'GPU' or None (or one of {ABSENT_TYPES}, "
                         f"of which there are none here), got {device_type!r}.")
    return kind


def list_physical_devices(device_type=None):
    """Physical devices, e.g. ``[PhysicalDevice(name='/physical_device:GPU:0', device_type='GPU')]``."""
    kind = _check_type(device_type)
    return [d for d in _dev.list_physical() if kind is None or d.device_type == kind]


def list_logical_devices(device_type=None):
    """Logical devices (initialises them: configuration is frozen afterwards, as in TF)."""
    kind = _check_type(device_type)
    return [d.logical_device() for d in _dev.logical_devices()
            if kind is None or d.device_type == kind]


def set_logical_device_configuration(device, logical_devices):
    """Split physical ``device`` into one logical device per configuration.

    Must be called before the first device use (a tensor, variable or strategy);
    afterwards it raises ``RuntimeError``, as TensorFlow does. ``None`` resets.
    """
    _dev.set_configuration(device, logical_devices)


def get_logical_device_configuration(device):
    """The configurations set for physical ``device``, or ``None``."""
    return _dev.get_configuration(device)


class experimental:  # noqa: N801  (TensorFlow's namespace)
    """``tf.config.experimental`` names that the course code uses."""

    set_virtual_device_configuration = staticmethod(set_logical_device_configuration)
    VirtualDeviceConfiguration = LogicalDeviceConfiguration
    list_physical_devices = staticmethod(list_physical_devices)
    list_logical_devices = staticmethod(list_logical_devices)

    @staticmethod
    def get_memory_info(device):
        """{'current': bytes in use, 'peak': peak bytes} for a logical device string."""
        d = _dev.get_device(device)
        return {"current": d.bytes_in_use, "peak": d.peak_bytes_in_use}

    @staticmethod
    def reset_memory_stats(device):
        _dev.get_device(device).reset_peak()

    @staticmethod
    def set_memory_growth(device, enable):
        """Accepted for compatibility: Numba allocates on demand already."""
