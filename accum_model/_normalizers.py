"""What each micro-batch's mean loss was divided by: its weight in a window.

The large batch's loss is `sum_k w_k * L_k / sum_k w_k`, where `L_k` is
micro-batch k's loss and `w_k` the normalizer that loss divided by. With
Keras' default reduction (`"sum_over_batch_size"`) every loss, per-output
losses and `loss_weights` included, divides by the batch size, so `w_k` is the
number of samples in micro-batch k.
"""

import tensorflow as tf


def batch_size(x, y=None):
    """Float32 scalar: the number of samples in a micro-batch.

    Args:
        x: The micro-batch's inputs (any nest of tensors).
        y: Its targets, used when `x` holds no tensor.

    Returns:
        The leading dimension of the first tensor found, as float32.
    """
    for structure in (x, y):
        for leaf in tf.nest.flatten(structure):
            if leaf is not None:
                return tf.cast(tf.shape(leaf)[0], tf.float32)
    raise ValueError(
        "Cannot tell the batch size of a micro-batch with neither inputs nor "
        f"targets. Received: x={x!r}, y={y!r}"
    )
