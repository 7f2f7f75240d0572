"""titan_exp's autotune as a Hydra sweeper (`hydra/sweeper=autotune`; `+sweep=autotune` selects it)."""
