"""`ResumableBackup`: a preempted fit resumes exactly, on one device.

A run is interrupted after a given micro-batch (a callback raises, as a
preemption would end the process: no `on_train_end`), then a fresh model
resumes it with the same callback. The reference is plain Keras training
with the large batch, uninterrupted: the resumed run must end on its
weights with its number of updates.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from accum_model import AccumModel
from accum_model import ResumableBackup
from accum_model.keras._adapter import keras
from tests import loopback_cluster
from tests import testing_utils as tu

# 20 samples, micro-batches of 2: 10 per epoch; windows of 3 micro-batches
# (6 samples), so an epoch is 3 full windows and one of 1 micro-batch.
_N, _MICRO, _STEPS, _EPOCHS = 20, 2, 3, 3


class Preempted(Exception):
    pass


class PreemptAt(keras.callbacks.Callback):
    """Raises after micro-batch `batch` of `epoch` ran (and was saved)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch, self._current = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self._current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._current, batch) == (self.epoch, self.batch):
            raise Preempted(f"preempted after ({self.epoch}, {batch})")


def _reference(x, y, epoch_end):
    """Plain Keras, uninterrupted, large batch; per-update weights."""
    model = tu.mlp(keras.Model)
    if epoch_end == "apply":
        # Each epoch: windows of 6, 6, 6 and the 2-sample rest.
        _, trajectory = tu.train(model, x, y, _MICRO * _STEPS, _EPOCHS)
    else:
        # Windows run across epochs: the epochs back to back, in order.
        _, trajectory = tu.train(
            model,
            np.concatenate([x] * _EPOCHS),
            np.concatenate([y] * _EPOCHS),
            _MICRO * _STEPS,
            1,
        )
    return model, trajectory


def _resumable_run(
    x,
    y,
    directory,
    preemptions,
    epoch_end="apply",
    save_freq=1,
    steps_per_execution=1,
    backup_class=ResumableBackup,
    watch=None,
):
    """Runs until done, restarting a fresh model after each preemption.

    Returns the final model and the callbacks' record of where each restart
    resumed from (None for a `backup_class` that does not say). `watch`, a
    callback made anew for each run, comes after the backup.
    """
    resumed = []
    for preemption in list(preemptions) + [None]:
        # A fresh process: another initialization, overwritten by the
        # restore (or, for the first run, the reference's initialization).
        seed = 0 if not resumed else 100 + len(resumed)
        model = tu.mlp(
            AccumModel, seed=seed, accum_steps=_STEPS, epoch_end=epoch_end
        )
        model.compile(
            optimizer=tu.OPTIMIZERS["sgd"](),
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
        backup = backup_class(directory, save_freq=save_freq)
        callbacks = [backup] + ([watch()] if watch else [])
        if preemption is not None:
            callbacks.append(PreemptAt(*preemption))
        try:
            model.fit(
                x,
                y,
                batch_size=_MICRO,
                epochs=_EPOCHS,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        except Preempted:
            pass
        resumed.append(getattr(backup, "resumed_from", None))
    return model, resumed


class ResumableBackupTest(tf.test.TestCase, parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.x, self.y = tu.regression_data(_N)

    def _assert_matches_reference(self, model, epoch_end="apply"):
        reference, trajectory = _reference(self.x, self.y, epoch_end)
        self.assertEqual(int(model.optimizer.iterations), len(trajectory))
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            1e-5,
        )

    @parameterized.named_parameters(
        # (epoch, batch) of the preemption, save_freq.
        ("first_micro_batch", [(0, 0)], 1),
        ("mid_window", [(0, 4)], 1),
        ("window_boundary", [(1, 5)], 1),
        # After the epoch's last micro-batch, before its partial window is
        # applied at the epoch's end.
        ("before_epoch_end_apply", [(1, 9)], 1),
        # The backup is older than the preemption: the micro-batches since
        # are trained again from the backup's state.
        ("save_every_3", [(2, 7)], 3),
        ("save_every_4", [(1, 6)], 4),
        # Preempted twice in the same epoch (Keras' BackupAndRestore then
        # falls back to epoch 0).
        ("twice_in_one_epoch", [(1, 2), (1, 7)], 2),
        ("three_times", [(0, 3), (1, 1), (2, 8)], 1),
    )
    def test_resume_equals_uninterrupted_large_batch(
        self, preemptions, save_freq
    ):
        directory = os.path.join(self.get_temp_dir(), self._testMethodName)
        model, resumed = _resumable_run(
            self.x, self.y, directory, preemptions, save_freq=save_freq
        )
        self._assert_matches_reference(model)
        self.assertIsNone(resumed[0])
        for restart in resumed[1:]:
            self.assertIsNotNone(restart)
        # A finished fit deletes its backup.
        self.assertFalse(os.path.exists(os.path.join(directory, "resume.json")))

    def test_carry_window_across_an_epoch_boundary(self):
        # epoch_end="carry": the window open at the epoch's end (1 micro-
        # batch) is saved at the epoch's end and completed after the
        # restart, in the next epoch.
        directory = os.path.join(self.get_temp_dir(), "carry")
        model, _ = _resumable_run(
            self.x, self.y, directory, [(1, 0), (1, 9)], epoch_end="carry"
        )
        self._assert_matches_reference(model, epoch_end="carry")

    def test_skipped_batches_show_the_last_logs_to_callbacks(self):
        # Before: the skipped batches gave callbacks `logs={}`, and one that
        # reads `logs["loss"]` failed on the restart.
        runs = []

        class ReadsLoss(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seen = {}
                runs.append(self)

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                self.seen[(self.epoch, batch)] = float(logs["loss"])

        directory = os.path.join(self.get_temp_dir(), "logs")
        model, resumed = _resumable_run(
            self.x, self.y, directory, [(1, 4)], watch=ReadsLoss
        )
        self.assertEqual(resumed[1], (1, 5))
        self._assert_matches_reference(model)
        first, second = runs
        # Batches 0-4 of epoch 1 are skipped: each shows the loss of batch 4,
        # the last trained before the backup; batch 5 on is trained anew.
        for batch in range(5):
            self.assertEqual(second.seen[(1, batch)], first.seen[(1, 4)])
        self.assertIn((1, 5), second.seen)

    def test_steps_per_execution(self):
        directory = os.path.join(self.get_temp_dir(), "spe")
        model, resumed = _resumable_run(
            self.x,
            self.y,
            directory,
            [(1, 5)],
            save_freq=2,
            steps_per_execution=2,
        )
        self.assertEqual(resumed[1], (1, 6))
        self._assert_matches_reference(model)

    def test_canary_plain_backup_and_restore_replays_the_epoch(self):
        # Canary: checks Keras' BackupAndRestore, not this package; it
        # fails when Keras changes what the docs compare with.
        # What Keras' own callback does, for the documentation's claim: the
        # consumed micro-batches are trained again and counted again.
        if tu.TF_KERAS:
            self.skipTest("tf_keras' BackupAndRestore works differently")
        directory = os.path.join(self.get_temp_dir(), "keras")
        model, _ = _resumable_run(
            self.x,
            self.y,
            directory,
            [(1, 4)],
            backup_class=keras.callbacks.BackupAndRestore,
        )
        reference, trajectory = _reference(self.x, self.y, "apply")
        self.assertGreater(int(model.optimizer.iterations), len(trajectory))
        self.assertGreater(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            1e-3,
        )

    @parameterized.named_parameters(("deleted", True), ("kept", False))
    def test_clean_run_deletes_its_backup(self, delete):
        # A clean run left an empty `backup_dir` behind (issue 32).
        directory = os.path.join(self.get_temp_dir(), f"clean-{delete}")
        model = tu.mlp(AccumModel, accum_steps=_STEPS)
        model.compile(optimizer=tu.OPTIMIZERS["sgd"](), loss="mse")
        backup = ResumableBackup(
            directory, save_freq=1, delete_checkpoint=delete
        )
        model.fit(
            self.x, self.y, batch_size=_MICRO, verbose=0, callbacks=[backup]
        )
        self.assertEqual(os.path.exists(directory), not delete)
        if not delete:
            self.assertEqual(backup.read_metadata()["epoch"], 1)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "save_freq=0"):
            ResumableBackup("/tmp/x", save_freq=0)
        with self.assertRaisesRegex(ValueError, "save_freq=True"):
            ResumableBackup("/tmp/x", save_freq=True)
        with self.assertRaisesRegex(ValueError, "backup_dir=''"):
            ResumableBackup("")


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FAULT_WORKER = os.path.join(_ROOT, "tests", "fault_worker.py")
# Every launch of the pair is bounded; a hang fails the test, it never
# blocks it.
_LAUNCH_TIMEOUT_S = 150


def _launch_pair(tmp, name, backup_dir, **flags):
    """Runs tests/fault_worker.py as a 2-worker loopback cluster.

    Returns `(results, returncodes)`: each worker's JSON result (None when it
    wrote none) and exit status. Kills both when `_LAUNCH_TIMEOUT_S`
    passes and fails the calling test with their logs.
    """
    ports = loopback_cluster.free_ports(2)
    processes, logs, outputs = [], [], []
    for index in range(2):
        env = dict(
            os.environ,
            PYTHONPATH=_ROOT,
            TF_CPP_MIN_LOG_LEVEL="2",
            TF_CONFIG=loopback_cluster.tf_config(ports, index),
        )
        outputs.append(os.path.join(tmp, f"{name}-out{index}.json"))
        logs.append(open(os.path.join(tmp, f"{name}-log{index}.txt"), "w+"))
        args = [
            sys.executable,
            _FAULT_WORKER,
            f"--backup_dir={backup_dir}",
            f"--output={outputs[index]}",
        ]
        args += [f"--{k}={v}" for k, v in flags.items()]
        processes.append(
            subprocess.Popen(
                args,
                stdout=logs[index],
                stderr=subprocess.STDOUT,
                env=env,
                cwd=_ROOT,
            )
        )
    deadline = time.monotonic() + _LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline and any(
        p.poll() is None for p in processes
    ):
        time.sleep(0.2)
    timed_out = any(p.poll() is None for p in processes)
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read()[-3000:])
        log.close()
    if timed_out:
        raise AssertionError(
            f"{name}: a worker ran past {_LAUNCH_TIMEOUT_S} s:\n"
            + "\n".join(texts)
        )
    results = []
    for path in outputs:
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append(None)
    return results, [p.returncode for p in processes], texts


def _multi_worker_reference():
    """Plain single-device Keras at the global large batch (2 * 2 * 4)."""
    x, y = tu.regression_data(24)
    model = tu.mlp(keras.Model)
    _, trajectory = tu.train(model, x, y, 16, 3, optimizer="adam")
    return model.get_weights(), len(trajectory)


class MultiWorkerResumeTest(tf.test.TestCase):
    """Two workers under MultiWorkerMirroredStrategy on 127.0.0.1."""

    def _assert_finished_as_reference(self, results, texts):
        weights, updates = _multi_worker_reference()
        for index, result in enumerate(results):
            self.assertIsNotNone(result, texts[index])
            self.assertIn("weights", result, texts[index])
            self.assertEqual(result["iterations"], updates)
            actual = [np.asarray(w, np.float32) for w in result["weights"]]
            self.assertLessEqual(tu.max_abs_diff(weights, actual), 1e-5)

    def test_preempted_pair_resumes_exactly(self):
        tmp = self.get_temp_dir()
        backup = os.path.join(tmp, "preempt-backup")
        # Mid-window: micro-batch 2 of the epoch's first window of 4.
        results, codes, texts = _launch_pair(
            tmp, "preempt", backup, preempt="1,1"
        )
        self.assertEqual(codes, [0, 0], texts)
        self.assertEqual([r["preempted"] for r in results], [True, True])
        results, codes, texts = _launch_pair(tmp, "resume", backup)
        self.assertEqual(codes, [0, 0], texts)
        self.assertEqual([r["resumed_from"] for r in results], [[1, 2], [1, 2]])
        self._assert_finished_as_reference(results, texts)

    def test_killed_worker_stops_the_survivor_then_the_pair_resumes(self):
        tmp = self.get_temp_dir()
        backup = os.path.join(tmp, "kill-backup")
        kill_time = os.path.join(tmp, "kill-time")
        heartbeat_s = 10.0
        results, codes, texts = _launch_pair(
            tmp,
            "kill",
            backup,
            kill="1,1",
            kill_time_file=kill_time,
            heartbeat_s=heartbeat_s,
        )
        self.assertEqual(codes[1], -9, texts[1])
        survivor = results[0]
        self.assertIsNotNone(survivor, texts[0])
        self.assertEqual(codes[0], 0, texts[0])
        # The coordination service's heartbeat: the survivor's next
        # collective is aborted with UnavailableError.
        self.assertEqual(
            survivor["error"], "UnavailableError", survivor.get("message")
        )
        with open(kill_time) as f:
            killed_at = float(f.read())
        noticed_after = survivor["error_time"] - killed_at
        self.assertLess(noticed_after, 3 * heartbeat_s, survivor)
        results, codes, texts = _launch_pair(tmp, "relaunch", backup)
        self.assertEqual(codes, [0, 0], texts)
        self.assertEqual([r["resumed_from"] for r in results], [[1, 2], [1, 2]])
        self._assert_finished_as_reference(results, texts)


if __name__ == "__main__":
    tf.test.main()
