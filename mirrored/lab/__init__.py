"""``mirrored.lab``: what the labs measure and draw, apart from the library they teach.

The library does not import this package (only ``python -m mirrored``, ``__main__.py``,
runs ``workflow``); it imports the library:

    labs.py        the notebooks' first cell (``labs.setup``) and the lab's model
    workflow.py    the command-line lab (``python -m mirrored``): devices, data, the model
    scaling.py     ``compare``: the same model under several strategies, timed
    timing.py      a phase timer around the training step (``TimedStep``)
    perf_model.py  N GPUs predicted from measured phases and link speeds
    viz.py         the pictures (the ring, the timeline, the kernels' thread maps)

    from mirrored.lab import labs, viz
    lab = labs.setup(replicas=2)
"""
