"""Which layout is fastest here: the machine profile (profile.py) that calibration measures
(calibrate.py, `python -m titan_exp.calibrate`), the performance and memory models (step.py,
memory.py), predictions checked against runs (fit.py, trace.py), and autotune (autotune.py)."""
