"""SLURM through submitit: one task per rank, nnodes x nproc_per_node tasks.

    python launch.py cluster=slurm cluster.nnodes=4 cluster.gpus_per_node=8 parallelism=3d

The launcher validates and writes the run dir as for a local run; then this module
  1. asks the controller whether the partition can hold the job (`preflight`), before anything
     is written,
  2. copies the titan_exp package into `<root>/code` and puts it first on the ranks' PYTHONPATH,
     so a queued job runs the code as it was at submission, whatever happens to the checkout,
  3. submits `TrainTask(run_dir)` with submitit, records the job in `<run dir>/slurm_job.json`,
     writes a `pending` summary, prints the job id and log paths and returns (cluster.wait=true
     waits and returns the result).

On the nodes each task takes its rank and the rendezvous (first node, a port derived from the
job id) from submitit's TorchDistributedEnvironment and runs `titan_exp.train.main`, like a
local rank. SLURM's warning signal (SIGUSR2, `cluster.signal_delay_s` before the time limit, or
on preemption) stops every rank at a step boundary with a checkpoint (titan_exp.signals); rank 0
then hands over to submitit's own handler, which requeues the job (TrainTask is Checkpointable).
The requeued job runs the same task on the same run dir, and the trainer resumes from its latest
checkpoint.

A multirun (`-m`) with cluster=slurm submits its members together as job arrays (one per set of
sbatch options) when the sweep has been composed (SlurmArrayCallback), without waiting.

    submit.py     the task, sbatch options, the code snapshot, submission, the executor, job arrays
    follow.py     a job's state, waiting for it, and its run record brought up to date
    preflight.py  static checks and the controller's answer, before anything is written
"""

from titan_exp.cluster.slurm.follow import job_state, refresh, wait
from titan_exp.cluster.slurm.submit import SlurmArrayCallback, run_slurm, submit_pending

__all__ = ["SlurmArrayCallback", "job_state", "refresh", "run_slurm", "submit_pending", "wait"]
