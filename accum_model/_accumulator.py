"""`GradientAccumulator`: accumulation for custom training loops.

The public front of the engine for loops written with `tf.GradientTape`:
a `Window` (the state machine, `_window`) plus the optimizer side
(`_optimizer`), which takes Keras optimizers of either generation.
`AccumModel` uses the same pieces from its `train_step`.
"""

import tensorflow as tf

from accum_model import _optimizer
from accum_model._window import Window


class GradientAccumulator(Window):
    """Accumulates gradients over micro-batches and applies their mean.

    The engine behind `AccumModel`, usable on its own in custom training loops
    with `tf.GradientTape`, eagerly or inside a `tf.function`, with or without
    `tf.distribute` (create it under `strategy.scope()`; accumulators are
    per-replica and gradients cross replicas once per applied update).

    Each micro-batch's gradients are added with a weight: the number of samples
    (or tokens, or the sum of sample weights) its mean loss was divided by.
    `apply()` hands `sum(weight * grads) / sum(weight)` to the optimizer, once,
    so a short last micro-batch counts for exactly what it holds and the
    optimizer's step counter, learning-rate schedule, clipping and weight decay
    act once per update.

    Example:

    ```python
    accumulator = GradientAccumulator(model.trainable_variables, accum_steps=4)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return accumulator.step(grads, optimizer, weight=tf.shape(x)[0])
    ```

    Args:
        variables: List of variables whose gradients are accumulated, in the
            order `grads` will be given.
        accum_steps: Int >= 1. Micro-batches per update in `step()`.
        noise_scale: `False` (default), `True` or an
            `accum_model.NoiseScale(every=..., beta=...)`: measure the
            gradient noise scale of the windows, read from the
            `noise_scale` property (see docs/noise_scale.md).
        name: Optional name of the module.

    Raises:
        ValueError: If `accum_steps` is not an integer >= 1.
        TypeError: If `noise_scale` is not a bool, a `NoiseScale` or a dict.
    """

    def accumulate(self, grads, weight=1.0, is_finite=None):
        """Adds one micro-batch's gradients, weighted, to the window.

        Does not apply anything; `step()` does both.

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`),
                one per variable, of the micro-batch's *mean* loss, unscaled
                (`step()` takes those of a loss-scaled loss).
            weight: Float scalar. What that mean divided by (its number of
                samples by default).
            is_finite: Optional bool scalar tensor. When False the micro-batch
                is left out (its weight does not count), but it still takes
                its place in the window.

        Raises:
            ValueError: If `grads` does not hold one gradient per variable.
        """
        self._add(grads, weight, weighted=False, is_finite=is_finite)

    def step(self, grads, optimizer, weight=1.0, is_finite=None):
        """Accumulates `grads` and applies the window when it is full.

        With a `LossScaleOptimizer`, `grads` are what that optimizer's own
        apply takes: under Keras 3 the gradients of
        `optimizer.scale_loss(loss)`, under tf_keras those of
        `optimizer.get_scaled_loss(loss)` passed through
        `optimizer.get_unscaled_gradients`. Each micro-batch is then unscaled
        in float32 with the scale it was computed with, a micro-batch whose
        gradients are not all finite (on any replica) is left out of its
        window (counted in `skipped_steps`), and the dynamic scale moves once
        per micro-batch, as `AccumModel` does (see docs/numerics.md). Under
        Keras 3 in a `tf.function`, build the optimizer before the first
        trace (`optimizer.build(variables)`): an unbuilt one's `scale_loss`
        multiplies by its initial scale as a constant.

        Args:
            grads: As in `accumulate()`.
            optimizer: The optimizer to apply the mean with (Keras 3 or
                tf_keras), called once per window.
            weight: As in `accumulate()`.
            is_finite: As in `accumulate()`.

        Returns:
            A bool scalar tensor: whether this call closed a window.

        Raises:
            ValueError: If `grads` does not hold one gradient per variable,
                or if a Keras 3 `LossScaleOptimizer` is not built yet when
                the step is traced.
        """
        # Checked before the loss scale moves or the optimizer is built.
        grads = self._checked(grads)
        adapter = _optimizer.ADAPTER
        if (
            adapter.is_loss_scale_optimizer(optimizer)
            and not tf.executing_eagerly()
            and not adapter.loss_scale_is_variable(optimizer)
        ):
            raise ValueError(
                "`optimizer` must be built before a step that scales its "
                "loss is traced: until then Keras 3's `scale_loss` "
                "multiplies by the initial scale as a constant, which would "
                "stay in the traced step while the scale moves. Call "
                "`optimizer.build(variables)` first. Received: an unbuilt "
                f"{type(optimizer).__name__}"
            )
        _optimizer.build(optimizer, self._variables)
        _optimizer.add_micro_batch(
            self, grads, weight, optimizer, is_finite=is_finite
        )
        return self._close_if_full(_optimizer.apply_fn(optimizer))

    def apply(self, optimizer):
        """Applies the weighted mean of what was accumulated, then zeroes.

        A no-op when nothing was accumulated since the last apply.

        Args:
            optimizer: The optimizer to apply the mean with.

        Returns:
            A bool scalar tensor: whether a window was closed.
        """
        _optimizer.build(optimizer, self._variables)
        return self._close_if(
            self._micro_step > 0, _optimizer.apply_fn(optimizer)
        )
