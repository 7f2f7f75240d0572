"""titan_exp: Hydra-configured Llama training with PyTorch-native N-D parallelism."""

__version__ = "0.1.0"
