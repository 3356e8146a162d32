"""fastckpt_accelerate in one process: async save_state, exact load_state, retention, errors, config."""

from __future__ import annotations

import os
import shutil
import uuid
import random
import threading

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

import fastckpt_accelerate
from accelerate_testing import (GatedStorage, Setup, assert_same, clone, make_accelerator,
                                closing, fresh_accelerate)  # noqa: F401 (the last two are fixtures)
import json

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.storage.protocol import open_storage
from fastckpt.errors import CheckpointNotFoundError, ConfigError, FastCkptError, IntegrityError
from tests.helpers import listed as _listed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gated(closing):
    """Makes GatedStorages; opens every gate at teardown (before `closing` flushes) so a failing test
    cannot hang on a closed gate."""
    made: list[GatedStorage] = []

    def make(root) -> GatedStorage:
        made.append(GatedStorage(str(root)))
        return made[-1]

    yield make
    for storage in made:
        storage.gate.set()


def enable(accelerator, closing, config=None, **kwargs):
    checkpointing = fastckpt_accelerate.enable(accelerator, config, **kwargs)
    closing.append(checkpointing)
    return checkpointing


def test_save_state_returns_before_persisting_and_load_state_restores_everything(tmp_path, closing, gated):
    acc = make_accelerator(tmp_path, total_limit=3)
    storage = gated(tmp_path / "checkpoints")
    checkpointing = enable(acc, closing, storage=storage)
    setup = Setup(acc)
    for _ in range(3):
        setup.step()
    for _ in setup.loader:  # one epoch: moves the dataloader's epoch counter and sampler generator
        pass
    expected = setup.snapshot()

    storage.gate.clear()
    path = acc.save_state()
    # The seal (the next step's pre-hook, here by hand): Accelerate's files are written whole from then on.
    checkpointing.checkpointer.wait_staged()
    # save_state came back while the storage still holds every write: it is asynchronous.
    assert storage.write_started.wait(30)
    assert path == os.path.join(str(tmp_path), "checkpoints", "checkpoint_0")
    assert not checkpointing.last_handle.done()
    assert not checkpointing.checkpointer.exists("checkpoint_0")
    assert acc.save_iteration == 1
    storage.gate.set()
    checkpointing.wait()
    assert checkpointing.checkpointer.exists("checkpoint_0")

    for _ in range(2):  # move everything away from the saved state
        setup.step()
    for _ in setup.loader:
        pass
    acc.project_configuration.iteration = 7
    assert acc.load_state() == path
    assert_same(expected, setup.snapshot())
    assert acc.save_iteration == 1  # restored: Accelerate itself leaves it at 7


def test_resume_in_a_new_accelerator_continues_numbering_and_retention(tmp_path, closing):
    acc = make_accelerator(tmp_path, total_limit=2)
    checkpointing = enable(acc, closing)
    setup = Setup(acc)
    snapshots = []
    for _ in range(4):
        setup.step()
        snapshots.append(setup.snapshot())
        acc.save_state()
    acc.end_training()
    assert checkpointing.closed
    assert _listed(tmp_path / "checkpoints") == ["checkpoint_2", "checkpoint_3"]

    acc2 = make_accelerator(tmp_path, total_limit=2)
    checkpointing2 = enable(acc2, closing)
    setup2 = Setup(acc2, seed=123)
    acc2.load_state(str(tmp_path / "checkpoints" / "checkpoint_2"))
    assert_same(snapshots[2], setup2.snapshot())
    assert acc2.save_iteration == 3
    acc2.load_state()  # the newest committed one
    assert_same(snapshots[3], setup2.snapshot())
    assert acc2.save_iteration == 4
    assert acc2.save_state().endswith("checkpoint_4")  # Accelerate would raise: checkpoint_2 exists
    checkpointing2.wait()
    assert [i.name for i in checkpointing2.checkpointer.list()] == ["checkpoint_3", "checkpoint_4"]


@pytest.mark.timeout(30)  # without the hook, save_state blocks on the gated ring: fail fast
def test_lazy_copy_waits_in_the_inner_optimizer_step(tmp_path, closing, gated):
    """The mutation race: the first step after save_state must not change what is being copied."""
    acc = make_accelerator(tmp_path)
    storage = gated(tmp_path / "checkpoints")
    # The native format's files are written whole (their buffers stay held until the commit), so no small
    # ring of buffers holds the lazy copy back here: the step must still see it finished, and the folder
    # must hold the state of save time although the step then changes every parameter.
    checkpointing = enable(acc, closing, {"persist": {"fsync": False}}, storage=storage)
    setup = Setup(acc, width=256)
    setup.step()
    before = clone({"model": acc.unwrap_model(setup.model).state_dict(), "opt": setup.optimizer.state_dict()})

    storage.gate.clear()
    acc.save_state()
    handle = checkpointing.last_handle
    inner = setup.optimizer.optimizer
    seen_staged = []
    entered = threading.Event()
    # Global pre-hooks run before the per-optimizer ones (fastckpt's wait comes next), ours runs last.
    global_hook = register_optimizer_step_pre_hook(lambda *_: entered.set())
    after_wait = inner.register_step_pre_hook(lambda *_: seen_staged.append(handle.staged()))
    try:
        worker = threading.Thread(target=setup.step, name="test-train-step")
        worker.start()
        assert entered.wait(30)
        storage.gate.set()
        worker.join(30)
    finally:
        global_hook.remove()
        after_wait.remove()
    assert seen_staged == [True]
    checkpointing.wait()
    assert_same(before["model"], load_file(os.path.join(handle.path, "model.safetensors")))
    saved_opt = torch.load(os.path.join(handle.path, "optimizer.bin"), weights_only=True)
    assert_same(before["opt"]["state"], saved_opt["state"])
    assert not torch.equal(before["model"]["0.weight"], acc.unwrap_model(setup.model).state_dict()["0.weight"])


def test_gradient_accumulation_and_skipped_steps_keep_the_hook_working(tmp_path, closing):
    acc = make_accelerator(tmp_path, gradient_accumulation_steps=2)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)  # the scaler path patches inner.step
    checkpointing = enable(acc, closing)  # before prepare: optimizers are resolved at save time
    setup = Setup(acc)
    for _ in range(2):
        setup.step()
    inner = setup.optimizer.optimizer
    expected = setup.snapshot()
    acc.save_state()
    assert len(inner._optimizer_step_pre_hooks) == 1  # on acc_opt.optimizer, which accepts it

    setup.step()  # accumulation: the inner step does not run
    x = torch.randn(8, setup.width)
    with acc.accumulate(setup.model):  # an overflowing step: the scaler skips it
        acc.backward(setup.model(x).sum() * float("inf"))
        setup.optimizer.step()
        setup.optimizer.zero_grad()
    assert setup.optimizer.step_was_skipped
    setup.step()
    setup.step()  # a real step: waits for staging, then changes the parameters
    checkpointing.wait()

    saved_scaler = torch.load(os.path.join(checkpointing.last_handle.path, "scaler.pt"), weights_only=True)
    assert saved_scaler["scale"] == 2.0**4
    acc.load_state()
    assert_same(expected, setup.snapshot())
    assert acc.scaler.get_scale() == 2.0**4


def test_retention_under_slow_storage_never_deletes_before_the_new_checkpoint_commits(tmp_path, closing, gated):
    acc = make_accelerator(tmp_path, total_limit=2)
    storage = gated(tmp_path / "checkpoints")
    checkpointing = enable(acc, closing, storage=storage)
    setup = Setup(acc)
    names = lambda: [i.name for i in checkpointing.checkpointer.list()]  # noqa: E731
    for _ in range(2):
        setup.step()
        acc.save_state()
    checkpointing.wait()
    assert names() == ["checkpoint_0", "checkpoint_1"]

    storage.gate.clear()
    storage.write_started.clear()
    setup.step()
    acc.save_state()
    checkpointing.checkpointer.wait_staged()  # the seal: the files are written from then on
    assert storage.write_started.wait(30)
    # Accelerate deletes checkpoint_0 here, before writing checkpoint_2; fastckpt keeps it until
    # checkpoint_2 is committed, so a crash now still leaves two complete checkpoints.
    assert names() == ["checkpoint_0", "checkpoint_1"]
    setup.step()
    acc.save_state()  # a second save in flight behind the first
    storage.gate.set()
    checkpointing.wait()
    assert names() == ["checkpoint_2", "checkpoint_3"]
    assert _listed(tmp_path / "checkpoints") == ["checkpoint_2", "checkpoint_3"]


def test_corrupt_checkpoint_raises_a_clear_error(tmp_path, closing):
    acc = make_accelerator(tmp_path)
    checkpointing = enable(acc, closing)
    setup = Setup(acc)
    setup.step()
    path = acc.save_state()
    checkpointing.wait()
    shard = os.path.join(path, "model.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="checkpoint_0 is corrupt.*model.safetensors"):
        acc.load_state()


def test_missing_or_unfinished_checkpoints_are_not_found(tmp_path, closing):
    acc = make_accelerator(tmp_path)
    enable(acc, closing)
    Setup(acc)
    with pytest.raises(CheckpointNotFoundError, match="no committed fastckpt checkpoint"):
        acc.load_state()
    unfinished = tmp_path / "checkpoints" / "checkpoint_9"
    unfinished.mkdir(parents=True)
    (unfinished / "model.safetensors").write_bytes(b"partial")
    (unfinished / ".fastckpt-pending").write_bytes(b"")  # what a killed native save leaves
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        acc.load_state(str(unfinished))
    (unfinished / ".fastckpt-pending").unlink()
    (unfinished / "model.safetensors").unlink()
    (unfinished / "shard-00000.safetensors").write_bytes(b"partial")
    with pytest.raises(CheckpointNotFoundError, match="not a committed fastckpt checkpoint"):
        acc.load_state(str(unfinished))


def test_explicit_output_dir_can_be_saved_again(tmp_path, closing):
    acc = make_accelerator(tmp_path, automatic=False)
    enable(acc, closing)
    setup = Setup(acc)
    target = str(tmp_path / "elsewhere" / "latest")
    setup.step()
    acc.save_state(target)
    setup.step()
    expected = setup.snapshot()
    assert acc.save_state(target) == target  # Accelerate overwrites an explicit folder; so do we
    setup.step()
    acc.load_state(target)
    assert_same(expected, setup.snapshot())


def test_folders_written_by_accelerate_itself_still_load(tmp_path, closing):
    acc = make_accelerator(tmp_path, automatic=False)
    setup = Setup(acc)
    setup.step()
    folder = str(tmp_path / "plain" / "checkpoint_5")
    type(acc).save_state(acc, folder)  # Accelerate's own writer
    expected = setup.snapshot()
    enable(acc, closing)
    setup.step()
    acc.load_state(folder)
    assert_same(expected["model"], setup.snapshot()["model"])
    assert acc.save_iteration == 6


def test_stats_are_exposed_and_logged_through_accelerator_log(tmp_path, closing):
    acc = make_accelerator(tmp_path)
    logged = []

    class Tracker:
        name = "memory"
        requires_logging_directory = False

        def log(self, values, step=None, **_):
            logged.append((step, values))

        def finish(self):
            pass

    acc.trackers = [Tracker()]
    checkpointing = enable(acc, closing, log_stats=True)
    setup = Setup(acc)
    for _ in range(2):
        setup.step()
        acc.save_state()
    checkpointing.wait()
    assert [s.name for s in checkpointing.stats] == ["checkpoint_0", "checkpoint_1"]
    assert all(s.nbytes > 0 and s.blocking_ms >= 0 and s.persist_s > 0 for s in checkpointing.stats)
    assert [step for step, _ in logged] == [0, 1]
    assert set(logged[0][1]) >= {"fastckpt/blocking_ms", "fastckpt/persist_s", "fastckpt/nbytes"}
    for (_, values), stats in zip(logged, checkpointing.stats):  # the stall the save cost the training loop
        assert values["fastckpt/waited_ms"] == stats.waited_ms
        assert values["fastckpt/stall_ms"] == stats.blocking_ms + stats.waited_ms
    assert len(checkpointing.save_state_ms) == 2


def test_end_training_flushes_and_closes(tmp_path, gated):
    acc = make_accelerator(tmp_path)
    storage = gated(tmp_path / "checkpoints")
    checkpointing = fastckpt_accelerate.enable(acc, storage=storage)
    setup = Setup(acc)
    setup.step()
    storage.gate.clear()
    acc.save_state()
    flusher = threading.Thread(target=acc.end_training, name="test-end-training")
    flusher.start()
    assert storage.write_started.wait(30)
    storage.gate.set()
    flusher.join(30)
    assert checkpointing.closed and not flusher.is_alive()
    assert _meta(str(tmp_path / "checkpoints" / "checkpoint_0"))["iteration"] == 0
    with pytest.raises(FastCkptError, match="closed"):
        acc.save_state()


def test_config_from_yaml_with_project_defaults(tmp_path, closing):
    config_file = tmp_path / "fastckpt.yaml"
    config_file.write_text(yaml.safe_dump({"persist": {"workers": 1}, "staging": {"mode": "eager"}}))
    acc = make_accelerator(tmp_path / "proj", total_limit=4)
    checkpointing = enable(acc, closing, str(config_file))
    assert checkpointing.config.root == str(tmp_path / "proj" / "checkpoints")
    assert checkpointing.config.retention.keep_last == 4
    assert checkpointing.config.persist.workers == 1
    assert checkpointing.config.staging.mode == "eager"
    with pytest.raises(ConfigError, match="already enabled"):
        fastckpt_accelerate.enable(acc)


def test_config_errors_name_the_problem(tmp_path):
    acc = make_accelerator(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("root: x\nsave_every: 3\n")
    with pytest.raises(ConfigError, match="save_every"):
        fastckpt_accelerate.enable(acc, str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        fastckpt_accelerate.enable(acc, str(tmp_path / "missing.yaml"))


def test_shared_yaml_with_shm_saves_with_one_warning(tmp_path, closing):
    """The YAML serves the core too: its shared-memory tier is dropped for the native folders, with one warning
    naming the field, and saves work (they used to be refused)."""
    shared = tmp_path / "fastckpt.yaml"
    shared.write_text("staging:\n  shm: true\n")
    acc = make_accelerator(tmp_path / "proj")
    with pytest.warns(UserWarning, match="staging.shm") as caught:
        checkpointing = enable(acc, closing, str(shared))
    assert len([w for w in caught if "staging.shm" in str(w.message)]) == 1
    assert checkpointing.config.staging.shm is False
    acc.save_state()
    checkpointing.wait()
    assert (tmp_path / "proj" / "checkpoints" / "checkpoint_0" / "manifest.json").is_file()


def test_explicit_root_and_retention_override(tmp_path, closing):
    acc = make_accelerator(tmp_path / "proj", total_limit=5)
    root = tmp_path / "fast"
    checkpointing = enable(acc, closing, {"root": str(root), "retention": {"keep_last": 1}})
    setup = Setup(acc)
    for _ in range(3):
        setup.step()
        acc.save_state()
    checkpointing.wait()
    assert _listed(root) == ["checkpoint_2"]
    assert not (tmp_path / "proj" / "checkpoints").exists()


def test_rng_states_round_trip_exactly():
    from fastckpt_accelerate.rng import capture_rng_states, restore_rng_states

    states = capture_rng_states()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    restore_rng_states(states)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]


def test_remote_tier_resumes_after_the_project_dir_is_lost(tmp_path, closing):
    """With remote.url, automatic checkpoints are uploaded; a new machine (empty project dir) resumes from them."""
    url = f"memory://fastckpt-accelerate-{uuid.uuid4().hex}"
    acc = make_accelerator(tmp_path / "run", total_limit=1)
    checkpointing = enable(acc, closing, {"remote": {"url": url}})
    setup = Setup(acc)
    snapshots = []
    for _ in range(3):
        setup.step()
        snapshots.append(setup.snapshot())
        acc.save_state()
    checkpointing.wait()  # committed locally and uploaded
    acc.end_training()
    assert _listed(tmp_path / "run" / "checkpoints") == ["checkpoint_2"]  # total_limit: local only
    with Checkpointer(CheckpointConfig(root=url)) as remote:
        assert [i.name for i in remote.list()] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]

    shutil.rmtree(tmp_path / "run")  # the machine is gone
    acc2 = make_accelerator(tmp_path / "run", total_limit=1)
    enable(acc2, closing, {"remote": {"url": url}})
    setup2 = Setup(acc2, seed=123)
    path = acc2.load_state()
    assert path.startswith("memory://") and path.endswith("/checkpoint_2")
    assert_same(snapshots[2], setup2.snapshot())
    assert acc2.save_iteration == 3
    assert acc2.save_state().endswith("checkpoint_3")


def test_remote_tier_mirrors_only_the_configured_root(tmp_path, closing):
    url = f"memory://fastckpt-accelerate-{uuid.uuid4().hex}"
    acc = make_accelerator(tmp_path, automatic=False)
    checkpointing = enable(acc, closing, {"root": str(tmp_path / "root"), "remote": {"url": url}})
    setup = Setup(acc)
    setup.step()
    acc.save_state(str(tmp_path / "root" / "mirrored"))
    acc.save_state(str(tmp_path / "elsewhere"))  # not under root: neither its retention nor its remote copy
    checkpointing.wait()
    with Checkpointer(CheckpointConfig(root=url)) as remote:
        assert [i.name for i in remote.list()] == ["mirrored"]
    local, remote_copy = open_storage(str(tmp_path / "elsewhere")), open_storage(f"{url}/mirrored")
    for name in ("model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"):  # same state, both folders
        assert local.read_bytes(local.join(local.url, name)) == remote_copy.read_bytes(remote_copy.join(remote_copy.url, name))


def test_shared_writes_needs_several_processes_and_shared_storage(tmp_path, closing):
    acc = make_accelerator(tmp_path)
    with pytest.raises(ConfigError, match=r"shared_writes=True.*several processes"):
        fastckpt_accelerate.enable(acc, shared_writes=True)
    checkpointing = enable(acc, closing)  # the default on one process: the main process writes everything
    assert checkpointing.shared_writes is False


def _meta(path: str) -> dict:
    """The fastckpt_accelerate block of a native folder's manifest."""
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)["user"]["fastckpt_accelerate"]
