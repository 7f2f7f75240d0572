"""Which layout is fastest here: one package for the performance model and what feeds it.

    plan.py        every valid layout with its predicted step time, tokens/s and memory
                   (`python -m titan_exp.perf.plan`)
    step.py        seconds per step by part (step_comm.py: its communication); memory.py peak
                   memory by part; memory_cpu.py the CPU-only terms (glibc's heap and fresh
                   pages), which GPU plans never read; shapes.py what they count a model in
    profile.py     the machine profile file; devices.py GPU spec sheets as profiles
    calibrate.py   `python -m titan_exp.perf.calibrate`: starts measuring ranks through an executor;
                   measure.py is what each runs (measure_compute.py, measure_comm.py, timing.py)
    fit.py trace.py  predictions against runs: rank correlation, refit, a profiler trace's split
    autotune.py    the search: predict every candidate, measure the best, refit
"""
