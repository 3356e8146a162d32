"""The storage matrix: every core behaviour test runs against each backend."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from fastckpt import CheckpointConfig


@dataclass
class Backend:
    name: str
    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def config(self, **kw: Any) -> CheckpointConfig:
        return CheckpointConfig(root=self.root, storage_options=self.storage_options, **kw)


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path / "ckpts"))
    if request.param == "memory":
        return Backend("memory", f"memory://fastckpt-test-{uuid.uuid4().hex}")
    s3 = request.getfixturevalue("s3_server")
    return Backend("s3", s3.fresh_url("core"), dict(s3.storage_options))
