"""The window's state in TensorFlow checkpoints, matched as in Keras' files.

`StateCheckpoint` is what a model under tf_keras tracks as its checkpoint
dependency (`tf.train.Checkpoint`, `save_weights` in TensorFlow format,
`BackupAndRestore`): it saves the entries `WindowState.save` writes (by name,
the model's items keyed by structure, with the format's version; neither
settings nor a batch in progress) and restores them through
`WindowState.load`, all or nothing, so a TensorFlow checkpoint loads exactly
as a Keras 3 file does: into the same network built again whatever
Keras' names, never crosswise, and with a `ValueError` naming the entry
that does not match.

TensorFlow restores the keys that `_serialize_to_tensors` returns now,
and a key the checkpoint lacks fails in its own restore op, before the
object sees anything; one the checkpoint holds and this state does not
save is left out silently. So the entries are packed in three tensors of
fixed keys (their keys, dtypes and serialized values), and
`WindowState.load` decides on all of them, as it does for a file, an
entry a later format adds (`Entry.since`) included.

This module knows TensorFlow only.
"""

import warnings

import numpy as np
import tensorflow as tf

_KEYS = "keys"
_DTYPES = "dtypes"
_VALUES = "values"


class StateCheckpoint(tf.__internal__.tracking.Trackable):
    """The saved entries of a `WindowState`, as one checkpoint object.

    Args:
        state: The `WindowState` (its items placed, `place_items_in`).
    """

    def __init__(self, state):
        self._window = state
        self._warned_old_layout = False

    def _serialize_to_tensors(self):
        if not tf.executing_eagerly():
            # A SavedModel's graph, which cannot read this process's
            # variables: a SavedModel serves, and holds no window.
            return {}
        store = {}
        self._window.save(store)
        keys = sorted(store)
        values = [tf.convert_to_tensor(store[k]) for k in keys]
        return {
            _KEYS: tf.constant(keys, tf.string),
            _DTYPES: tf.constant(
                [v.dtype.as_datatype_enum for v in values], tf.int32
            ),
            _VALUES: tf.stack([tf.io.serialize_tensor(v) for v in values]),
        }

    def _restore_from_tensors(self, restored_tensors):
        if restored_tensors:
            self._window.load(unpack(restored_tensors))
        return tf.no_op()

    def _lookup_dependency(self, name, cached_dependencies=None):
        # Asked for each child the checkpoint holds under this object. It
        # has none: a checkpoint written before 0.2.0, which kept the
        # accumulator itself (`state/_variables/<name>`, by Keras' names,
        # which could give one layer another's gradients). Not restored,
        # but said, rather than left silently.
        del cached_dependencies
        if not self._warned_old_layout:
            self._warned_old_layout = True
            warnings.warn(
                "This TensorFlow checkpoint holds the accumulation state "
                "as accum_model wrote it before 0.2.0 (the "
                f"accumulator's variables, {name!r}, by Keras' names). It "
                "is not restored: the window starts empty.",
                stacklevel=2,
            )
        return None


def unpack(restored):
    """`{key: array}` of the tensors `_serialize_to_tensors` returned."""
    keys = [k.decode() for k in restored[_KEYS].numpy()]
    dtypes = restored[_DTYPES].numpy()
    values = restored[_VALUES].numpy()
    return {
        k: np.asarray(tf.io.parse_tensor(v, tf.dtypes.as_dtype(int(d))))
        for k, d, v in zip(keys, dtypes, values)
    }
