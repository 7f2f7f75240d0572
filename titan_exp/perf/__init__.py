"""Which layout, how many devices, how long: the performance model and what feeds it.

The commands (each a module here):
    plan.py        `python -m titan_exp.perf.plan`: every valid layout ranked by predicted tokens/s,
                   with memory per device; optionally written out as a sweep
    calibrate.py   `python -m titan_exp.perf.calibrate`: measure this machine (or a cluster's nodes)
    autotune.py    `python launch.py -m +sweep=autotune`: predict every candidate, measure the best

The library, by concern, each importing only those below it:
    search/        the planner: layouts and batch splits, the axes searched, ranking, sweep files
    calibration/   calibration ranks started through an executor, what they measure, timing, refit
    model/         the cost model: step time by part, communication, overlap, a GPU block from its
                   parts, shapes, memory (GPU and CPU terms), placement on nodes, the Engine
    rates/         what the model reads: machine profiles, GPU spec sheets, hardware files, kernel
                   rates, float8 casts, per-model op counts, NCCL's latencies, recorded accuracy
"""
