"""Conditionals that stay correct inside `tf.distribute` and under XLA.

A window closes inside a conditional whose branch all-reduces (the
optimizer's apply does). Two things make the plain `tf.cond` wrong there:

- inside `strategy.run` such a `tf.cond` fails ("merge_call called while
  defining a new graph"), so the condition is taken in cross-replica context
  and the branch runs back in each replica (the pattern of Keras'
  `LossScaleOptimizer`);
- XLA turns a conditional whose branches are elementwise, as an optimizer
  update is, into a select of both, which would run the update on every
  micro-batch. It never speculates a loop, so under XLA the branch runs in a
  loop with a trip count of 0 or 1.

This module knows TensorFlow only.
"""

import functools
import platform

import tensorflow as tf


def in_replica_context_of_strategy():
    """Whether the code being run is inside `strategy.run` of a strategy."""
    return (
        tf.distribute.has_strategy()
        and not tf.distribute.in_cross_replica_context()
    )


def call_in_cross_replica_context(fn, *args):
    """Calls `fn(*args)` once in cross-replica context.

    In replica context (inside `strategy.run`), through `merge_call`: `args`
    then arrive as per-replica values, and `fn` runs once for all replicas.
    Elsewhere `fn(*args)` is called as it is.

    Args:
        fn: Callable. Under a strategy it receives the first replica's
            value of each per-replica argument: call it only with values
            that are equal on every replica.
        *args: Its arguments.

    Returns:
        What `fn` returns.
    """
    if not in_replica_context_of_strategy():
        return fn(*args)

    def merge_fn(strategy, *merged):
        return fn(*[first_replica(strategy, a) for a in merged])

    return tf.distribute.get_replica_context().merge_call(merge_fn, args=args)


def first_replica(strategy, value):
    """The first replica's value of a (possibly per-replica) `value`."""
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


@functools.cache
def xla_available():
    """Whether XLA can compile here, as Keras asks before it uses it.

    Not on Apple's ARM processors (Keras 3 turns XLA off there under
    TensorFlow's Metal plugin, tf_keras' optimizers on any Apple ARM), nor
    with a pluggable device of another type (tf_keras' `can_jit_compile`).
    """
    if platform.system() == "Darwin" and "arm" in platform.processor().lower():
        return False
    return all(
        device.device_type in ("CPU", "GPU", "TPU")
        for device in tf.config.list_physical_devices()
    )


def in_xla_context():
    """Whether the graph being traced is compiled by XLA (`jit_compile`).

    For callers that were not told (a custom loop's `tf.function`);
    `AccumModel` passes its `jit_compile` instead.
    """
    # Private (TensorFlow): the only way to ask a graph being traced.
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def run_if(pred, fn, xla):
    """Runs `fn()` (no outputs) when the bool scalar `pred` holds.

    Only the taken branch runs, also under XLA.

    Args:
        pred: Bool scalar tensor.
        fn: Callable without arguments or outputs.
        xla: Bool. Whether the graph is compiled by XLA.
    """
    if xla:

        def body(i):
            fn()
            return i + 1

        tf.while_loop(
            lambda i: i < tf.cast(pred, tf.int32), body, [tf.constant(0)]
        )
        return

    def branch():
        fn()
        return tf.constant(True)

    tf.cond(pred, branch, lambda: tf.constant(False))


def run_in_replicas_if(pred, fn, xla):
    """Runs `fn()` (no outputs) in each replica when `pred` holds.

    For a branch that all-reduces (a window's close): under a strategy the
    condition is taken once, in cross-replica context, from the first
    replica's `pred`, and `fn` runs back in each replica. Elsewhere it is
    `run_if`.

    Args:
        pred: Bool scalar tensor, equal on every replica.
        fn: Callable without arguments or outputs, called in replica
            context.
        xla: Bool. Whether the graph is compiled by XLA.
    """
    if not in_replica_context_of_strategy():
        run_if(pred, fn, xla)
        return

    def merge_fn(strategy, pred):
        run_if(
            first_replica(strategy, pred),
            lambda: strategy.extended.call_for_each_replica(fn),
            xla,
        )

    tf.distribute.get_replica_context().merge_call(merge_fn, args=(pred,))
