"""The cost model: one training step of a job on a machine profile, by part. step (seconds and
tokens/s; comm, its communication; overlap, what compute hides), block (a GPU block priced from its
kernels), shapes (what it counts a model in), memory (peak by part; memory_gpu and memory_cpu the
device-specific terms), placement (process groups on nodes), engine (what differs between
training engines), predict (a job on its hardware file)."""
