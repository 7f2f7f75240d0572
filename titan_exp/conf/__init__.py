"""Hydra reads this package's YAML presets as pkg://titan_exp.conf; the file makes it a package Hydra can find."""
