"""What the cost model reads: the machine profile (profile), GPU spec sheets (devices) and hardware
files (hardware), kernel rates on a spec-sheet GPU (kernels), float8 casts (float8_casts), the
memory-bound work of a model's code (model_ops), NCCL's latency model (nccl), and how far off
predictions were when last checked (accuracy)."""
