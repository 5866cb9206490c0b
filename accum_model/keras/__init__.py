"""The adapter: everything that differs between Keras 3 and tf_keras, the
version gate, the private Keras names used (with why) and the clone hook.

Imports from `core` only.
"""
