"""Measuring a machine for the cost model: the calibration job started through an executor (run),
what each of its ranks measures (measure: compute, comm, kernels) and how it times (timing), and
refitting a profile's corrections to measured runs (fit)."""
