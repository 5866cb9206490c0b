"""Which Keras generation `tf.keras` is, checked against the supported range.

`tf.keras` is Keras 3 on TensorFlow >= 2.16, or Keras 2 (`tf_keras`) when
`TF_USE_LEGACY_KERAS=1` is set before TensorFlow is imported. Loading this
module checks the versions (`_versions`).
"""

import tensorflow as tf

from accum_model.keras import _versions

# Before `tf.keras` is read: on an older TensorFlow it is Keras 2 whatever
# is installed, and the rest of the package cannot load.
_versions.check_tensorflow(tf.__version__)

# `tf.keras` is the Keras that TensorFlow was told to use; its full package
# (`keras` or `tf_keras`) has the parts `tf.keras` leaves out (`saving`).
LEGACY = tf.keras.Model.__module__.startswith("tf_keras")
if LEGACY:
    import tf_keras as keras
else:
    import keras

_versions.check_versions(tf.__version__, keras.__version__, LEGACY)
