"""What each rank runs: the entry (`python -m titan_exp.train.rank RUN_DIR`), the training loop,
and the optimizer and lr schedule it steps."""
