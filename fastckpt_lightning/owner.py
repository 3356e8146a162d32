"""``FastIOOwner``: what fastckpt's Lightning strategies share: the plugin that owns their core Checkpointers."""
from __future__ import annotations

from typing import Any

from fastckpt_lightning.checkpoint_io import FastCheckpointIO

__all__ = ["FastIOOwner"]


class FastIOOwner:
    """Mixed into a Lightning strategy (``checkpoint_io`` is the strategy's): the Trainer's ``FastCheckpointIO``,
    or a default one installed on first use, so that one plugin saves, removes and loads."""

    checkpoint_io: object

    @property
    def fast_io(self) -> FastCheckpointIO:
        """The plugin that owns the core Checkpointers (the Trainer's, or a default one)."""
        io = self.checkpoint_io
        if not isinstance(io, FastCheckpointIO):
            io = FastCheckpointIO()
            self.checkpoint_io = io
        return io

    def refuse_storage_options(self, storage_options: Any) -> None:
        """Per-call ``storage_options`` are not taken: the plugin's, set once, serve every save."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported: pass "
                            "storage options once, as FastCheckpointIO(storage_options=...)")
