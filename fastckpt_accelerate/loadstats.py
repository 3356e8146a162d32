"""What one ``load_state`` read, how, and what each file's bytes were checked against; which files stock reads."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["MANIFEST_CHECKED", "NOT_CHECKED", "ZIP_CHECKED", "LoadStateStats", "stock_reads"]

# What a file's bytes were checked against (``LoadStateStats.checked``)
MANIFEST_CHECKED = "manifest"  # its whole CRC32C against the manifest's
ZIP_CHECKED = "zip"  # each zip record against the CRC-32 of its zip entry (a torch file fastckpt did not list)
NOT_CHECKED = "none"  # nothing: a stock safetensors, verify_on_load off, a torch file written without CRC-32s

# The files Accelerate's load_state reads (accelerate/checkpointing.py, 1.x: load_accelerator_state and
# load_custom_state), besides the model's safetensors; ``{rank}``: the one RNG file of this process.
_STOCK = (r"pytorch_model(_\d+)?\.bin", r"(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin", r"scaler\.pt",
          r"custom_checkpoint_\d+\.pkl")


def stock_reads(name: str, process_index: int | None) -> bool:
    """Whether Accelerate's ``load_state`` may read the file ``name`` of a folder (the RNG file: only this process's,
    or any when ``process_index`` is None). Anything else there is a bystander, never read, never checked."""
    if name.startswith("random_states_"):
        return re.fullmatch(r"random_states_\d+\.pkl", name) is not None and (
            process_index is None or name == f"random_states_{process_index}.pkl")
    return any(re.fullmatch(p, name) for p in _STOCK)


@dataclass
class LoadStateStats:
    """What one ``load_state`` did: ``FastAccelerateCheckpointing.last_load_stats``.

    ``files`` maps each file read to how: ``"into"`` (read straight into the model's tensors), ``"read"``
    (read whole, checked, and unpickled over those bytes), ``"stock"`` (read by Accelerate's own code; checked
    first where the manifest lists it). ``fallbacks``: why a file did not take the fast path (``"*"``: the whole
    load). ``checked`` maps each file read to what its bytes were checked against: ``"manifest"`` (its CRC32C,
    listed in the manifest), ``"zip"`` (its zip records' CRC-32s: a torch file of a stock folder, or one the
    manifest does not list) or ``"none"``. ``verified``: every file the load read was checked against the manifest,
    exactly (False as soon as one was not: a stock folder, a file the manifest does not list, ``verify_on_load``
    off). Files the folder holds but the load never read (an unrelated ``notes.zip``) are neither read nor checked.
    """

    path: str
    kind: str  # folder.FILES, folder.STOCK or folder.CORE
    files: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0  # bytes read by fastckpt's readers (the model's tensors and the checked files)
    seconds: float = 0.0  # the whole load_state call
    verified: bool = True
    checked: dict[str, str] = field(default_factory=dict)
