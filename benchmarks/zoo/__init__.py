"""The model zoo: step time and peak memory of the bare model, torch DDP and DDPWrapper on
models users train (``pytest benchmarks/zoo -s``).

``models.py`` holds the models and their batches, ``video.py`` the uint8 clips on disk,
``measure.py`` what one rank measures, ``bench_zoo.py`` the pytest cases that run them on two
gloo ranks and record ``benchmarks/results/zoo.json``; ``table.py`` turns that into the table
and plot of docs/benchmarks.md.
"""
