"""A user's own classes, outside the package: what `allowed_targets=[mylab]` lets a config name
(tests/test_targets.py puts this folder on PYTHONPATH)."""

import json

from titan_exp.data.loader import PackedLoader
from titan_exp.models.llama import Transformer
from titan_exp.train.trainer import Trainer


class TaggedTransformer(Transformer):
    """The model with an extra constructor argument, given by +model.kwargs.tag=..."""

    def __init__(self, config, tag: str):
        super().__init__(config)
        self.tag = tag


class CountingLoader(PackedLoader):
    """The loader, counting the batches it served."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served = 0

    def next_batch(self):
        self.served += 1
        return super().next_batch()


class RecordingTrainer(Trainer):
    """The trainer, writing down what it was built from."""

    def train(self):
        result = super().train()
        if self.rank == 0:
            optimizer, scheduler, model = self.optimizers[0], self.schedulers[0], self.model_parts[0]
            (self.run_dir.path / "mylab.json").write_text(json.dumps({
                "trainer": type(self).__name__,
                "model": type(model).__name__,
                "tag": model.tag,
                "optimizer": type(optimizer).__name__,
                "momentum": optimizer.param_groups[0]["momentum"],
                "scheduler": type(scheduler).__name__,
                "loader": type(self.loader).__name__,
                "batches": self.loader.served,
            }))
        return result
