"""Counts the cross-replica all-reduces a process *executes*, and their bytes.

Both `MirroredStrategy` on CPUs and `MultiWorkerMirroredStrategy` reduce
through `CollectiveAllReduce._all_reduce`: one call per replica per batch of
tensors (a gradient list is one batch). `install()` wraps it so that every
executed batch (replica 0's, once per batch across replicas) appends its
number of tensors and bytes to a list on the host: a `tf.numpy_function`
with a control dependency into the reduced values, so a reduction counts
when its graph runs, not when it is traced, and a reduction inside a branch
that is not taken does not count.

Private TensorFlow name, used for this test instrumentation only (never by
the package): `cross_device_ops.CollectiveAllReduce._all_reduce`.
"""

import threading

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops

_LOCK = threading.Lock()
_RECORDS = []
_ORIGINAL = None


def _record(num_tensors, num_bytes):
    with _LOCK:
        _RECORDS.append((int(num_tensors), int(num_bytes)))
    return 0


def _bytes(value):
    if isinstance(value, tf.IndexedSlices):
        return _bytes(value.values) + _bytes(value.indices)
    return tf.cast(tf.size(value), tf.int64) * value.dtype.size


def _counted_all_reduce(self, reduce_op, value, replica_id, options):
    result = _ORIGINAL(self, reduce_op, value, replica_id, options)
    if replica_id != 0:
        return result
    flat = tf.nest.flatten(value, expand_composites=False)
    num_bytes = tf.add_n([_bytes(v) for v in flat]) if flat else 0
    if tf.executing_eagerly():
        _record(len(flat), num_bytes)
        return result
    count = len(flat)
    marker = tf.numpy_function(
        lambda b: _record(count, b), [num_bytes], tf.int64, stateful=True
    )
    with tf.control_dependencies([marker]):
        return tf.nest.map_structure(
            lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
            result,
        )


def install():
    """Wraps `CollectiveAllReduce._all_reduce` (idempotent)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = cross_device_ops.CollectiveAllReduce._all_reduce
        cross_device_ops.CollectiveAllReduce._all_reduce = _counted_all_reduce


def reset():
    with _LOCK:
        del _RECORDS[:]


def records():
    """List of `(num_tensors, num_bytes)`, one per executed batch."""
    with _LOCK:
        return list(_RECORDS)
