"""BatchNormalization whose moving statistics see the whole window.

Under gradient accumulation a plain `BatchNormalization` updates its moving
mean and variance once per *micro-batch*: with momentum `m` they decay like
`m ** N` per optimizer update and follow the noisy moments of small batches.
`AccumBatchNormalization` normalizes each micro-batch with its own moments, as
every BN does in training, but pools the moments of all samples of the window
(Chan et al.'s parallel mean/variance) and moves the statistics once, when
`AccumModel` applies the window:

    moving = moving * momentum + pooled * (1 - momentum)

where `pooled` is the mean (biased variance) of the window's concatenated
activations, exactly.
"""

import tensorflow as tf

from accum_model.engine import _state
from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER
keras = _adapter.keras
# Keras 3 only: the layer builds on Keras 3's BatchNormalization internals.
ops = getattr(keras, "ops", None)


class _WindowMoments:
    """Count, mean and variance of the activations seen in the open window.

    Variables of the accumulator's state (`_state.BATCHNORM`), not of the
    layer: Keras neither counts them as weights (so weights transfer 1:1
    with `BatchNormalization`) nor locks the built layer against them.
    Under `tf.distribute` they are per-replica.
    """

    def __init__(self, variables):
        self.count = variables["count"]
        self.mean = variables["mean"]
        self.variance = variables["variance"]

    def add(self, count, mean, variance):
        """Merges one batch's moments into the window (parallel formula).

        With `w_a = n_a / n` and `w_b = n_b / n`:
        `mean = w_a mean_a + w_b mean_b` and
        `var = w_a var_a + w_b var_b + w_a w_b (mean_b - mean_a) ** 2`,
        which is `M2 / n` of Chan et al. with `M2 = M2_a + M2_b + delta ** 2
        n_a n_b / n`. Kept as a variance rather than M2 because every term is
        non-negative and, for the first batch of a window (`w_a = 0`,
        `w_b = 1`), the result is that batch's moments bit for bit.
        """
        dtype = self.mean.dtype
        count = tf.cast(count, dtype)
        mean = tf.cast(mean, dtype)
        variance = tf.cast(variance, dtype)
        count_a = self.count.read_value()
        mean_a = self.mean.read_value()
        total = count_a + count
        w_a = tf.math.divide_no_nan(count_a, total)
        w_b = tf.math.divide_no_nan(count, total)
        delta = mean - mean_a
        self.variance.assign(
            w_a * self.variance.read_value()
            + w_b * variance
            + w_a * w_b * tf.square(delta)
        )
        self.mean.assign(w_a * mean_a + w_b * mean)
        self.count.assign(total)


class AccumBatchNormalization(keras.layers.BatchNormalization):
    """`BatchNormalization` whose moving statistics pool a whole window.

    A drop-in for `tf.keras.layers.BatchNormalization`: same arguments, same
    weights (names, order, shapes; they load into each other both ways), same
    inference. In training each micro-batch is still normalized with its own
    mean and variance (that is inherent to accumulation). What changes, inside
    an `AccumModel`, is the moving statistics: the layer pools the count,
    mean and variance of every sample of the window (padding excluded when a
    mask is given) and, once per optimizer update, sets

    ```
    moving_mean     = moving_mean * momentum     + window_mean * (1 - momentum)
    moving_variance = moving_variance * momentum + window_var  * (1 - momentum)
    ```

    with `window_var` the biased variance of the window's concatenated
    activations, so the statistics move as they would for one batch of
    `batch_size * accum_steps` samples normalized the same way. With
    `accum_steps=1`, or outside an `AccumModel`, it computes exactly what
    `BatchNormalization` computes.

    Use `replace_batchnorm(model)` to swap the layers of an existing
    functional or Sequential model.

    Args:
        **kwargs: The arguments of `tf.keras.layers.BatchNormalization`.
    """

    def __init__(self, *args, **kwargs):
        ADAPTER.check_accum_batchnorm()
        super().__init__(*args, **kwargs)
        # Python attributes, set before the train step is traced, so the
        # traced graph takes the pooled path.
        self._accum_managed = False
        self._accum_window = None

    def attach_to_accumulator(self, accumulator):
        """Hands the moving-statistics update to `accumulator`'s window.

        Called by `AccumModel` when it builds its `GradientAccumulator`. From
        then on, training-mode calls add their moments to the window, the
        accumulator's apply branch (also taken by the epoch-end flush)
        updates the moving statistics once, and the accumulator empties the
        layer's window with its own.

        A layer that is not built (not called by the model's forward pass)
        stays unattached and behaves as `BatchNormalization`.

        Args:
            accumulator: The `GradientAccumulator` of the model.
        """
        if not self.built:
            return
        # A new accumulator (the trainable variables changed) opens a new
        # window with new variables; the old one is discarded as the
        # gradients are.
        self._accum_window = _WindowMoments(
            accumulator.state.declare_item(
                "batchnorm",
                self.name,
                _state.BATCHNORM,
                shape=(self.moving_mean.shape[0],),
                dtype=_window_dtype(self.moving_mean.dtype),
            )
        )
        self._accum_managed = True
        accumulator.add_apply_hook(self._update_moving_from_window)

    def call(self, inputs, training=None, mask=None):
        if not (self._accum_managed and training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        # BatchNormalization.call in training mode, with the moving-statistics
        # update replaced by adding to the window.
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less "
                "than the inputs. Received: "
                f"mask.shape={mask.shape}, inputs.shape={inputs.shape}"
            )
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None

        mean, variance = self._moments(inputs, mask)
        self._accum_window.add(self._count(inputs, mask), mean, variance)
        if self.renorm:
            r, d, mean, variance = self._renorm_correction_and_moments(
                mean, variance
            )
            gamma, beta = self._compose_transforms(
                r, d, gamma, beta, inputs.dtype
            )
        outputs = ops.batch_normalization(
            x=inputs,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _count(self, inputs, mask):
        """Per-channel number of values the batch's moments were taken over."""
        channels = self.moving_mean.shape[0]
        if mask is None:
            count = tf.cast(tf.size(inputs, tf.int64), tf.float32) / channels
            replica_ctx = tf.distribute.get_replica_context()
            if self.synchronized and replica_ctx is not None:
                # The moments are global; so is the count they stand for.
                count = replica_ctx.all_reduce(
                    tf.distribute.ReduceOp.SUM, count
                )
            return tf.fill((channels,), count)
        # The mask covers every axis but the last, like BatchNormalization's.
        weights = tf.cast(tf.expand_dims(mask, -1), tf.float32)
        weights = tf.broadcast_to(weights, tf.shape(inputs))
        count = tf.reduce_sum(weights, axis=self._reduction_axes)
        return tf.reshape(count, (channels,))

    def _update_moving_from_window(self):
        """Moves the statistics once by the window's moments.

        Runs inside the accumulator's apply branch, which then empties the
        window. Channels that saw no value in the window (all masked) keep
        their statistics.
        """
        window = self._accum_window
        if self.trainable:
            seen = window.count.read_value() > 0
            mean = window.mean.read_value()
            variance = window.variance.read_value()
            if self.renorm:
                renorm_state = [
                    self.moving_mean,
                    self.moving_variance,
                    self.moving_stddev,
                    self.renorm_mean,
                    self.renorm_stddev,
                ]
                before = [tf.convert_to_tensor(v.value) for v in renorm_state]
                self._update_renorm_statistics(
                    ops.cast(mean, self.moving_mean.dtype),
                    ops.cast(variance, self.moving_mean.dtype),
                )
                for v, old in zip(renorm_state, before):
                    v.assign(tf.where(seen, v.value, old))
            else:
                # The expression of BatchNormalization.call, in the same
                # dtypes, so one batch per window moves them identically.
                dtype = mean.dtype
                moving_mean = ops.cast(self.moving_mean, dtype)
                moving_variance = ops.cast(self.moving_variance, dtype)
                new_mean = moving_mean * self.momentum + mean * (
                    1.0 - self.momentum
                )
                new_variance = moving_variance * self.momentum + variance * (
                    1.0 - self.momentum
                )
                self.moving_mean.assign(tf.where(seen, new_mean, moving_mean))
                self.moving_variance.assign(
                    tf.where(seen, new_variance, moving_variance)
                )


AccumBatchNormalization = ADAPTER.register_serializable(AccumBatchNormalization)


def _window_dtype(variable_dtype):
    # Moments are computed in float32 at least (float16 policies included);
    # a float64 layer keeps float64.
    if tf.as_dtype(variable_dtype) == tf.float64:
        return tf.float64
    return tf.float32


def replace_batchnorm(model):
    """Returns a copy of `model` with `AccumBatchNormalization` layers.

    Every `BatchNormalization` layer of a functional or Sequential model
    (nested functional and Sequential models included) becomes an
    `AccumBatchNormalization` with the same configuration; all weights,
    moving statistics included, are copied. An `AccumModel` keeps its
    `accum_steps` and `epoch_end`; a compiled model is compiled again from its
    compile config (the optimizer's state is not copied).

    Args:
        model: A functional or Sequential `tf.keras.Model`.

    Returns:
        A new model of the same kind, sharing no variables with `model`.

    Raises:
        ValueError: If `model` is not a functional or Sequential model, or
            under tf_keras.
    """
    ADAPTER.check_accum_batchnorm()
    functional = ADAPTER.functional_class
    if not isinstance(model, (keras.Sequential, functional)):
        raise ValueError(
            "`model` must be a functional or Sequential Keras model; a "
            "subclassed model should create `AccumBatchNormalization` layers "
            f"itself. Received: model of type {type(model).__name__}"
        )

    def clone(layer):
        config = layer.get_config()
        if _is_plain_batchnorm(layer):
            return AccumBatchNormalization.from_config(config)
        return layer.__class__.from_config(config)

    new_model = keras.models.clone_model(
        model, clone_function=clone, recursive=True
    )
    new_model.set_weights(model.get_weights())
    for attr in ("accum_steps", "epoch_end"):
        if hasattr(model, attr):
            setattr(new_model, attr, getattr(model, attr))
    return new_model


def _is_plain_batchnorm(layer):
    return isinstance(layer, keras.layers.BatchNormalization) and not callable(
        getattr(layer, "attach_to_accumulator", None)
    )
