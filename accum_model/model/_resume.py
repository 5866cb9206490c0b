"""`ResumableBackup`: a preempted `fit` resumes where it stopped, exactly.

Keras' `BackupAndRestore` restores the weights and the optimizer, then
replays the interrupted epoch from its first batch: the batches consumed
before the interruption are trained on twice and `optimizer.iterations`
counts them twice. This callback also saves how many batches of the epoch
were consumed, and on restart skips exactly those (it draws them from the
iterator without running a step), so the resumed run takes the same updates
as one that was never interrupted, given a data order that depends only on
the epoch (`shuffle=False`, or a seeded `tf.data` pipeline).
"""

import json
import os

import numpy as np

from accum_model.core._validation import check_integer
from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER

_METADATA = "resume.json"


def _validate_save_freq(save_freq):
    if save_freq == "epoch":
        return save_freq
    try:
        return check_integer("save_freq", save_freq, 1)
    except ValueError:
        raise ValueError(
            "`save_freq` must be 'epoch' or an integer >= 1 (batches). "
            f"Received: save_freq={save_freq!r}"
        ) from None


class ResumableBackup(ADAPTER.callback_base):
    """Backs up training and resumes a preempted `fit` exactly where it was.

    Like `keras.callbacks.BackupAndRestore`, it saves the model's weights,
    the optimizer and (for an `AccumModel`) the open window of accumulated
    gradients to `backup_dir`, and a restarted `fit` with the same callback
    restores them. Unlike it, it also saves the epoch and the number of
    batches of that epoch already consumed, and the restarted `fit` starts
    at that epoch and skips exactly those batches (drawn from the data
    without a training step), so the run ends on the weights, and with the
    number of updates, of a run that was never interrupted.

    What must hold for that: the data order is a function of the epoch
    (`shuffle=False`, or a `tf.data` pipeline seeded per epoch), the same
    `batch_size`, `steps_per_execution` and number of workers. Metrics of
    the resumed epoch count only the batches trained after the restart.
    Callbacks see every batch index of the epoch; for the skipped ones
    `on_train_batch_end` gets the logs of the last batch trained before the
    backup (saved with it), so a callback that reads `logs["loss"]` reads
    the last loss known.

    Under `MultiWorkerMirroredStrategy` every worker must have the callback
    (saving reads replicated state with collectives): the chief writes to
    `backup_dir`, worker `i` to `backup_dir/worker_i`.

    Example:

    ```python
    model.fit(x, y, batch_size=32, epochs=10, shuffle=False,
              callbacks=[accum_model.ResumableBackup("/ckpt", save_freq=100)])
    ```

    Args:
        backup_dir: Directory for the backup (created if missing).
        save_freq: `"epoch"` (save at the end of every epoch) or an integer
            N >= 1: save every N batches, and at the end of every epoch.
        delete_checkpoint: Whether to delete the backup when `fit` ends
            normally (an interrupted `fit` keeps it): its files, and
            `backup_dir` when nothing else is left in it.

    Attributes:
        resumed_from: `(epoch, batches)` the last `fit` resumed from, or
            None when it found no backup.

    Raises:
        ValueError: If `backup_dir` is empty or `save_freq` is neither
            `"epoch"` nor an integer >= 1.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        if not backup_dir:
            raise ValueError(
                "`backup_dir` must be a non-empty path. "
                f"Received: backup_dir={backup_dir!r}"
            )
        save_freq = _validate_save_freq(save_freq)
        super().__init__()
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self._epoch = 0
        self._consumed = 0
        self._since_save = 0
        self._saves = 0
        self._skipping = False
        self._last_logs = {}
        self.resumed_from = None

    # Paths

    def _directory(self):
        # Public on MultiWorkerMirroredStrategy; None elsewhere.
        resolver = getattr(
            self.model.distribute_strategy, "cluster_resolver", None
        )
        if resolver is None or not resolver.cluster_spec().as_dict():
            return self.backup_dir
        task_type, task_id = resolver.task_type, resolver.task_id
        has_chief = "chief" in resolver.cluster_spec().as_dict()
        if task_type == "chief" or (
            task_type == "worker" and task_id == 0 and not has_chief
        ):
            return self.backup_dir
        return os.path.join(self.backup_dir, f"{task_type}_{task_id}")

    def _metadata_path(self):
        return os.path.join(self._directory(), _METADATA)

    def read_metadata(self):
        """The saved position: `{"epoch", "batches", "weights", "logs"}`.

        Returns None when there is no backup. `"logs"` are the scalar logs
        of the last batch trained before it.
        """
        path = self._metadata_path()
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    # Restoring

    def on_train_begin(self, logs=None):
        self._epoch, self._consumed, self._since_save = 0, 0, 0
        self.resumed_from = None
        metadata = self.read_metadata()
        if metadata is None:
            return
        weights = os.path.join(self._directory(), metadata["weights"])
        model = self.model
        if model.optimizer is not None:
            # Built now, so that its slots are restored now: a TensorFlow
            # checkpoint restores variables created later when they are
            # created, from a file the next backup will have replaced.
            with model.distribute_strategy.scope():
                ADAPTER.build_optimizer_for_restore(
                    model.optimizer, model.trainable_variables
                )
        model.load_weights(weights)
        epoch, batches = int(metadata["epoch"]), int(metadata["batches"])
        self.resumed_from = (epoch, batches)
        self._epoch, self._consumed = epoch, batches
        ADAPTER.start_at_epoch(self.model, epoch)
        if batches:
            self._skip_batches(batches, metadata.get("logs", {}))

    def _skip_batches(self, count, logs):
        # `fit` looks `train_function` up before every step, so a wrapper
        # set here sees the first calls: each one draws the batches a step
        # would consume, runs no step, and callbacks still see the true
        # batch indices. The wrapper removes itself once done.
        model = self.model
        train_function = model.train_function
        spe = max(1, int(ADAPTER.steps_per_execution(model)))
        left = [count]

        def skipping_train_function(iterator):
            if left[0] <= 0:
                model.train_function = train_function
                self._skipping = False
                return train_function(iterator)
            for _ in range(min(spe, left[0])):
                next(iterator)
            left[0] -= min(spe, left[0])
            # Keras hands these to `on_train_batch_end`: never `{}`, which
            # a callback reading `logs["loss"]` would fail on.
            return dict(logs)

        self._skipping = True
        model.train_function = skipping_train_function

    # Saving

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._consumed = 0
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._skipping:
            return
        self._last_logs = _scalars(logs)
        consumed = batch + 1  # `batch` is the last index run by the call.
        self._since_save += consumed - self._consumed
        self._consumed = consumed
        if self.save_freq != "epoch" and self._since_save >= self.save_freq:
            self._save(self._epoch, consumed)

    def on_epoch_end(self, epoch, logs=None):
        # After `AccumModel` applied a partial window (`epoch_end="apply"`):
        # its callback runs first.
        if self._skipping:
            # The whole epoch was consumed before the interruption: the
            # wrapper was not called again, so take it off here.
            self._skipping = False
        self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        ADAPTER.clear_start_epoch(self.model)
        if not self.delete_checkpoint:
            return
        directory = self._directory()
        metadata = self.read_metadata()
        if metadata is not None:
            os.remove(self._metadata_path())
            self._remove_weights(directory, metadata["weights"])
        # As Keras' `BackupAndRestore` does, but only what is left empty
        # (never files of someone else's); a worker's own directory first,
        # then `backup_dir` (the last of the workers to finish removes it).
        _remove_if_empty(directory)
        if directory != self.backup_dir:
            _remove_if_empty(self.backup_dir)

    def _save(self, epoch, batches):
        directory = self._directory()
        os.makedirs(directory, exist_ok=True)
        previous = self.read_metadata()
        self._saves += 1
        name = f"backup-{os.getpid()}-{self._saves}{ADAPTER.backup_suffix}"
        self.model.save_weights(os.path.join(directory, name))
        # The metadata names the weights and is replaced atomically, last:
        # an interruption while saving leaves the previous backup whole.
        temporary = self._metadata_path() + ".tmp"
        with open(temporary, "w") as f:
            json.dump(
                {
                    "epoch": epoch,
                    "batches": batches,
                    "weights": name,
                    "logs": self._last_logs if batches else {},
                },
                f,
            )
        os.replace(temporary, self._metadata_path())
        self._since_save = 0
        if previous is not None and previous["weights"] != name:
            self._remove_weights(directory, previous["weights"])

    def _remove_weights(self, directory, name):
        for path in ADAPTER.backup_files(os.path.join(directory, name)):
            if os.path.exists(path):
                os.remove(path)


# TensorFlow's checkpoint index, which tf_keras' `save_weights` (TF format)
# writes beside the weights and never removes.
_CHECKPOINT_INDEX = "checkpoint"


def _remove_if_empty(directory):
    """Removes `directory` if nothing but a checkpoint index is left in it."""
    try:
        left = os.listdir(directory)
    except FileNotFoundError:
        return
    if set(left) - {_CHECKPOINT_INDEX}:
        return
    try:
        for name in left:
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)
    except OSError:
        # Another worker's backup arrived, or removed it first.
        pass


def _scalars(logs):
    """The scalar entries of `logs` as Python floats (JSON, and portable)."""
    scalars = {}
    for key, value in (logs or {}).items():
        value = np.asarray(value)
        if value.size == 1 and np.issubdtype(value.dtype, np.number):
            scalars[key] = float(value.reshape(()))
    return scalars
