"""A DCP ``DefaultStager`` that lives as long as the benchmark's peer, whatever ``dcp.async_save`` does with it.

torch 2.11's ``async_save`` closes the stager it is given once a checkpoint's upload is done (torch 2.13 closes only
the stagers it made itself). A closed ``DefaultStager`` has cleared its deepcopy dispatch table, and its next
``stage()`` fails on the first class object the deep copy meets: ``KeyError: <class 'type'>``, the error the H200
run of ``benchmarks/gpu.sh`` met at its second DCP checkpoint (reproduced on torch 2.13: ``close()``, then
``stage()``). The peer reuses one stager on purpose, as torchtitan does: its cached (pinned) host storages are
what makes DCP's staging fast. So ``close()`` from ``async_save`` is ignored and the peer releases it at the end.
"""
from __future__ import annotations

from typing import Any

__all__ = ["kept_stager"]


def kept_stager(**options: Any) -> Any:
    """A ``DefaultStager(StagingOptions(**options))`` whose ``close()`` does nothing; ``release()`` closes it."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class KeptStager(DefaultStager):
        def close(self) -> None:  # async_save's, after each upload (torch 2.11): the stager is reused
            pass

        def release(self) -> None:
            DefaultStager.close(self)

    return KeptStager(StagingOptions(**options))
