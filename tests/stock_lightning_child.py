"""Run as a script by ``test_lightning_fidelity``: stock Lightning, with fastckpt unimportable, reads a ``.ckpt``
that fastckpt wrote.

``python stock_lightning_child.py CKPT OUT TOTAL_STEPS`` loads CKPT with ``TinyModule.load_from_checkpoint``, then
resumes ``Trainer.fit(ckpt_path=CKPT)`` to TOTAL_STEPS, and ``torch.save``s what it saw to OUT.
"""

from __future__ import annotations

import importlib.abc
import sys


class _NoFastckpt(importlib.abc.MetaPathFinder):
    """Any import of a fastckpt package fails: the proof that nothing below needs it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in ("fastckpt", "fastckpt_lightning", "fastckpt_accelerate"):
            raise ImportError(f"stock process: {fullname} must not be imported")
        return None


def main(ckpt: str, out: str, total_steps: int) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_models import ResumableBatches, TinyModule

    def clone(state):
        return {key: value.clone() for key, value in state.items()}

    loaded = TinyModule.load_from_checkpoint(ckpt)
    module = TinyModule(batchnorm=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, max_steps=total_steps)
    starts = []
    trainer.callbacks.append(type("Start", (pl.Callback,), {
        "on_train_start": lambda self, trainer, module: starts.append(trainer.global_step)})())
    trainer.fit(module, ResumableBatches(), ckpt_path=ckpt)
    torch.save({
        "hparams": dict(loaded.hparams),
        "loaded": clone(loaded.state_dict()),
        "resumed": {"state_dict": clone(module.state_dict()),
                    "optimizer_states": [trainer.optimizers[0].state_dict()]},
        "start_step": starts[0],
        "io": type(trainer.strategy.checkpoint_io).__module__,
        "fastckpt_modules": sorted(name for name in sys.modules if name.split(".")[0].startswith("fastckpt")),
    }, out)


if __name__ == "__main__":
    sys.meta_path.insert(0, _NoFastckpt())
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
