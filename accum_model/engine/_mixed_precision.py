"""Loss scaling for accumulation: unscale per micro-batch, skip what overflows.

Under `mixed_float16` Keras wraps the optimizer in a `LossScaleOptimizer`:
the loss is multiplied by a dynamic scale before the backward pass, so small
float16 gradients do not underflow, and the gradients are divided by it
again. The engine does the same per micro-batch
(`GradientAccumulator.accumulate`), with the rules here:

- Each micro-batch's gradients are unscaled in float32 with the scale *that
  micro-batch* was computed with (and multiplied by its normalizer weight in
  the same multiply, the engine's one), so a scale that changes mid-window
  is harmless: the window only ever holds unscaled gradients.
- A micro-batch whose gradients are not all finite, on any replica, is left
  out of the window (its samples do not count toward the normalizer) but
  still takes its place in it, so windows close on schedule.
- The scale follows Keras' dynamic rule once per *micro-batch* (one backward
  pass, which is what can overflow): halve it on a non-finite micro-batch,
  double it after `dynamic_growth_steps` finite micro-batches in a row. The
  scale therefore evolves exactly as in plain `fit` with batch `B` over the
  same micro-batches.

This module knows TensorFlow only; `_adapter.ADAPTER` says where each Keras
generation keeps its loss-scale variables (`dynamic_loss_scale`).
"""

import tensorflow as tf

from accum_model.core import _control_flow


def all_replicas_finite(grads):
    """Bool scalar: whether every gradient on every replica is finite.

    Each replica counts its non-finite gradient tensors and, under a
    `tf.distribute` strategy (in replica context), the counts are summed
    across replicas, so every replica (also across workers with
    `MultiWorkerMirroredStrategy`) takes the same decision on the same
    micro-batch. Before accumulation the gradients are per-replica, not yet
    all-reduced, so a local check alone could disagree between replicas.

    Args:
        grads: List of gradients (tensors, `tf.IndexedSlices` or `None`).

    Returns:
        A bool scalar tensor.
    """
    values = [
        g.values if isinstance(g, tf.IndexedSlices) else g
        for g in grads
        if g is not None
    ]
    return none_on_any_replica(non_finite_count(values))


def non_finite_count(tensors):
    """Float32 scalar: how many of `tensors` hold an inf or NaN."""
    if not tensors:
        return tf.constant(0.0)
    # float32: every cross-device all-reduce implementation supports it.
    return tf.add_n(
        [
            tf.cast(
                tf.logical_not(tf.reduce_all(tf.math.is_finite(t))), tf.float32
            )
            for t in tensors
        ]
    )


def none_on_any_replica(bad):
    """Bool scalar: whether the count `bad` is 0 summed over the replicas."""
    if _control_flow.in_replica_context_of_strategy():
        bad = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, bad
        )
    return tf.equal(bad, 0.0)


def next_scale_and_counter(
    scale, counter, is_finite, growth_steps, min_scale=None
):
    """Keras' dynamic loss-scale rule, one step.

    Non-finite: the scale halves (not below `min_scale`, when given) and the
    counter resets. Finite: the counter counts up; when it reaches
    `growth_steps` the scale doubles and the counter resets.

    Args:
        scale: Float32 scalar tensor, the current loss scale.
        counter: Integer scalar tensor, finite steps since the last change.
        is_finite: Bool scalar tensor.
        growth_steps: Int, Keras' `dynamic_growth_steps`.
        min_scale: Optional float: tf_keras never goes below 1, Keras 3 has
            no floor.

    Returns:
        `(new_scale, new_counter)`, of the dtypes of `scale` and `counter`.
    """
    grown = counter + 1
    grow = tf.logical_and(
        is_finite, grown >= tf.cast(growth_steps, grown.dtype)
    )
    halved = scale * 0.5
    if min_scale is not None:
        halved = tf.maximum(halved, tf.cast(min_scale, scale.dtype))
    new_scale = tf.where(is_finite, tf.where(grow, scale * 2.0, scale), halved)
    new_counter = tf.where(
        tf.logical_and(is_finite, tf.logical_not(grow)),
        grown,
        tf.zeros_like(counter),
    )
    return new_scale, new_counter


def assign_everywhere(assignments, is_finite):
    """Runs `assignments(is_finite)` once, in cross-replica context.

    Loss-scale variables are mirrored with aggregation NONE: Keras updates
    them in cross-replica context, where one assignment sets every replica's
    copy. `is_finite` is the same on every replica (see
    `all_replicas_finite`), so the first replica's value stands for all.

    Args:
        assignments: `fn(is_finite)` that assigns the variables.
        is_finite: Bool scalar tensor.
    """
    _control_flow.call_in_cross_replica_context(assignments, is_finite)


def update_loss_scale(dynamic_loss_scale, is_finite):
    """Moves a dynamic loss scale on by one micro-batch (Keras' rule).

    Args:
        dynamic_loss_scale: What `ADAPTER.dynamic_loss_scale` returns:
            `(scale_variable, counter_variable, growth_steps, min_scale)`,
            or None for a fixed scale (nothing to do).
        is_finite: Bool scalar tensor, the same on every replica.
    """
    if dynamic_loss_scale is None:
        return
    scale_variable, counter_variable, growth_steps, min_scale = (
        dynamic_loss_scale
    )

    def assign(flag):
        scale, counter = next_scale_and_counter(
            tf.convert_to_tensor(scale_variable),
            tf.convert_to_tensor(counter_variable),
            flag,
            growth_steps,
            min_scale=min_scale,
        )
        scale_variable.assign(scale)
        counter_variable.assign(counter)

    assign_everywhere(assign, is_finite)
