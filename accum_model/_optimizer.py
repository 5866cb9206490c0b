"""The optimizer side of accumulation: build, apply, and loss scaling.

Written once for both front ends: `AccumModel.train_step` and
`GradientAccumulator.step` hand each micro-batch to `add_micro_batch` and
close windows with `apply_fn(optimizer)`. Keras optimizers of either
generation are reached through the adapter (`_keras.ADAPTER`); the
loss-scale rules themselves are in `_mixed_precision`.
"""

import tensorflow as tf

from accum_model import _control_flow
from accum_model import _keras
from accum_model import _mixed_precision

ADAPTER = _keras.ADAPTER


def build(optimizer, variables):
    """Creates the optimizer's slots for `variables` now, if it has none.

    Keras optimizers create their slots on their first apply. Here that is
    inside the branch that closes a window, and under a strategy that branch
    runs in `merge_call`, where a traced function cannot lift new variables
    out of the conditional ("You must feed a value for placeholder"). So they
    are built first, eagerly (lifted out of any function being traced) and
    in cross-replica context.

    Args:
        optimizer: A Keras optimizer (either generation).
        variables: The variables it will update.
    """

    def build_now():
        with tf.init_scope():
            ADAPTER.build_optimizer(optimizer, variables)

    _control_flow.call_in_cross_replica_context(build_now)


def apply_fn(optimizer):
    """The `apply_fn(grads, variables)` a window close calls for `optimizer`.

    Gradients arrive unscaled and checked for finiteness; a
    `LossScaleOptimizer`'s inner optimizer applies them.
    """

    def apply(grads, variables):
        ADAPTER.apply_gradients(optimizer, grads, variables)

    return apply


def add_micro_batch(
    window,
    grads,
    weight,
    optimizer,
    weighted=False,
    gradient_scale=None,
    is_finite=None,
):
    """Adds one micro-batch's gradients to `window`, as `optimizer` needs.

    With a `LossScaleOptimizer` (mixed precision) the gradients are those of
    a scaled loss: they are unscaled in float32 with the scale that
    micro-batch was computed with (and weighted in the same multiply), a
    micro-batch whose gradients are not all finite on some replica is left
    out of its window, and the dynamic scale moves on by one micro-batch
    (see `_mixed_precision`). Otherwise they go in as they are.

    Args:
        window: The `Window` to add to.
        grads: One gradient per variable of `window`. Without loss scaling,
            of the micro-batch's mean loss, already multiplied by `weight`
            when `weighted`; with it, of the mean loss times
            `gradient_scale` (not weighted).
        weight: Float scalar, what the micro-batch's mean loss divided by.
        optimizer: The optimizer that will apply the window.
        weighted: Bool. Whether `grads` are multiplied by `weight` already
            (ignored under loss scaling).
        gradient_scale: Float32 scalar, the loss scale `grads` carry; by
            default the scale the optimizer's own apply expects.
        is_finite: Optional bool scalar tensor; False leaves the
            micro-batch out.
    """
    weight = tf.cast(weight, tf.float32)
    if ADAPTER.is_loss_scale_optimizer(optimizer):
        if gradient_scale is None:
            gradient_scale = ADAPTER.applied_gradient_scale(optimizer)
        grads, finite = _mixed_precision.unscale_and_check(
            grads,
            weight / gradient_scale,
            ADAPTER.dynamic_loss_scale(optimizer),
        )
        if is_finite is not None:
            finite = tf.logical_and(finite, is_finite)
        window._add(grads, weight, weighted=True, is_finite=finite)
    else:
        window._add(grads, weight, weighted=weighted, is_finite=is_finite)
