"""TensorFlow-only helpers below every other layer: conditionals that stay
correct under `tf.distribute` and XLA, and the argument checks.

Imports nothing of the package.
"""
