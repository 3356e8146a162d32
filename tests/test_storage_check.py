"""Storage is checked when a Checkpointer is built: a typo fails now with one actionable error,
never later as a silent "no checkpoint, train from scratch"."""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, StorageError
from tests.faultproxy import FaultProxy
from tests.s3server import _free_ports, s3_storage_options

_FAST = {"timeout_s": 1.5, "retries": 1, "backoff_s": 0.05}


def _missing_bucket_url() -> str:
    return f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run1"


# ---- S3 -------------------------------------------------------------------------------------------

@pytest.mark.s3
def test_missing_bucket_in_root(s3_server) -> None:
    url = _missing_bucket_url()
    with pytest.raises(StorageError, match=f"bucket '{url[5:].split('/')[0]}' does not exist") as ei:
        Checkpointer(CheckpointConfig(root=url, storage_options=s3_server.storage_options))
    assert url in str(ei.value) and "fix the bucket name in root" in str(ei.value)


@pytest.mark.s3
def test_missing_bucket_in_remote_url(tmp_path, s3_server) -> None:
    url = _missing_bucket_url()
    remote = {"url": url, "storage_options": s3_server.storage_options}
    with pytest.raises(StorageError, match="fix the bucket name in remote.url"):
        Checkpointer(CheckpointConfig(root=str(tmp_path), remote=remote))


@pytest.mark.s3
def test_existing_bucket_and_fresh_prefix_pass(tmp_path, s3_root) -> None:
    remote = {"url": s3_root.url, "storage_options": s3_root.storage_options}
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "new" / "run"), remote=remote)) as ckpt:
        assert ckpt.latest() is None
        ckpt.save({"w": torch.ones(4)}, step=1).wait_uploaded()


def test_unreachable_port() -> None:
    (port,) = _free_ports(1)  # nothing listens there
    options = s3_storage_options(f"http://127.0.0.1:{port}")
    with pytest.raises(StorageError, match=f"127.0.0.1:{port} cannot be reached") as ei:
        Checkpointer(CheckpointConfig(root="s3://bucket/run", storage_options=options, network=_FAST))
    assert "endpoint_url" in str(ei.value)


def test_closed_proxy_as_remote_url(tmp_path) -> None:
    proxy = FaultProxy(("127.0.0.1", 9), name="closed-proxy")  # never started, then closed: refuses
    endpoint = proxy.endpoint_url
    proxy.close()
    remote = {"url": "s3://bucket/run", "storage_options": s3_storage_options(endpoint)}
    with pytest.raises(StorageError, match="remote.url 's3://bucket/run' cannot hold checkpoints"):
        Checkpointer(CheckpointConfig(root=str(tmp_path), remote=remote, network=_FAST))


@pytest.mark.s3
def test_silent_endpoint_fails_at_the_deadline(tmp_path, s3_fault_proxy) -> None:
    s3_fault_proxy.proxy.blackhole()
    options = s3_storage_options(s3_fault_proxy.endpoint_url, connect_timeout=3600, read_timeout=3600)
    remote = {"url": s3_fault_proxy.fresh_url("silent"), "storage_options": options}
    with pytest.raises(StorageError, match=r"did not answer within 1.5s \(2 attempt"):
        Checkpointer(CheckpointConfig(root=str(tmp_path), remote=remote, network=_FAST))


def test_missing_credentials(monkeypatch) -> None:
    _no_credentials(monkeypatch)
    (port,) = _free_ports(1)
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}}
    with pytest.raises(StorageError, match="no S3 credentials were found"):
        Checkpointer(CheckpointConfig(root="s3://bucket/run", storage_options=options, network=_FAST))


def _no_credentials(monkeypatch) -> None:
    """No credentials anywhere botocore looks: variables, files, a metadata service."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service off loopback


@pytest.mark.s3
def test_missing_bucket_names_the_endpoint_of_aws_endpoint_url(monkeypatch, s3_server) -> None:
    """Issue 55, item 8: with the endpoint in AWS_ENDPOINT_URL (botocore reads it), a wrong bucket was reported "at
    the default AWS endpoint": the error names the endpoint the client really asked."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    url = _missing_bucket_url()
    options = {"key": s3_server.storage_options["key"], "secret": s3_server.storage_options["secret"]}
    with pytest.raises(StorageError, match=f"does not exist at {s3_server.endpoint_url}: ") as ei:
        Checkpointer(CheckpointConfig(root=url, storage_options=options))
    assert "default AWS endpoint" not in str(ei.value)


@pytest.mark.s3
def test_cli_without_credentials_says_what_to_set(monkeypatch, s3_server, capsys) -> None:
    """Issue 55, item 8: the command printed botocore's bare "NoCredentialsError: Unable to locate credentials"."""
    from fastckpt.cli import main

    _no_credentials(monkeypatch)
    code = main(["list", f"s3://{s3_server.bucket}/run", "--storage-option",
                 f"client_kwargs.endpoint_url={s3_server.endpoint_url}"])
    err = capsys.readouterr().err
    assert code == 1 and "Unable to locate credentials" not in err
    assert "no S3 credentials were found: set key and secret in the storage options" in err
    assert "--storage-option key=" in err and "AWS_ACCESS_KEY_ID" in err


@pytest.mark.s3
def test_lightning_without_credentials_says_what_to_set(monkeypatch, s3_server, tmp_path) -> None:
    """Issue 55, item 8: stock ModelCheckpoint reads its s3:// dirpath with fsspec's defaults; without credentials
    there, the Lightning plugin's user met a raw NoCredentialsError. The plugin says what to set, and where."""
    import s3fs
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fastckpt.errors import MissingCredentialsError
    from fastckpt_lightning import FastCheckpointIO
    from tests.lightning_support import ResumableBatches, TinyModule, make_trainer

    _no_credentials(monkeypatch)
    s3fs.S3FileSystem.clear_instance_cache()  # no client built earlier with other settings
    plugin = FastCheckpointIO(storage_options={"client_kwargs": {"endpoint_url": s3_server.endpoint_url}})
    callback = ModelCheckpoint(dirpath=f"s3://{s3_server.bucket}/nocreds", every_n_train_steps=1)
    trainer = make_trainer([callback], plugin, max_steps=1, default_root_dir=str(tmp_path))
    with pytest.raises(MissingCredentialsError) as ei:
        trainer.fit(TinyModule(), ResumableBatches())
    text = str(ei.value)
    assert "ModelCheckpoint opens its dirpath with fsspec's default options" in text
    assert 'fsspec.config.conf["s3"]' in text and "AWS_ACCESS_KEY_ID" in text
    assert MissingCredentialsError.caused(ei.value.__cause__)  # chained from the client's own error


# ---- local roots ----------------------------------------------------------------------------------

def test_root_that_is_a_file(tmp_path) -> None:
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(StorageError, match="is a file, not a directory"):
        Checkpointer(CheckpointConfig(root=str(tmp_path / "ckpt")))


def test_root_under_a_file(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match=f"lies under '{tmp_path / 'f'}', which is a file"):
        Checkpointer(CheckpointConfig(root=str(tmp_path / "f" / "sub" / "run")))


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs mount: chmod does not stop root, a read-only filesystem does."""
    path = tmp_path / "ro"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("sub", ["", "run1"])
def test_read_only_root(read_only_dir, sub) -> None:
    root = read_only_dir / sub if sub else read_only_dir
    with pytest.raises(StorageError, match="is not writable.*read-only"):
        Checkpointer(CheckpointConfig(root=str(root)))


def test_fresh_local_root_passes_and_is_not_created(tmp_path) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "a" / "b"))) as ckpt:
        assert not (tmp_path / "a").exists()  # the probe writes nothing; the first save creates it
        ckpt.save({"w": torch.ones(4)}, step=1).wait()
        assert torch.equal(ckpt.load()["w"], torch.ones(4))
