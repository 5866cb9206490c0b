"""Everything that differs between Keras generations, in one place.

`tf.keras` is Keras 3 on TensorFlow >= 2.16, or Keras 2 (`tf_keras`) when
`TF_USE_LEGACY_KERAS=1` is set before TensorFlow is imported. The engine and
`AccumModel` call the one `ADAPTER` chosen here, never `if` on the version.

Private Keras names used here, each for a reason given where it is used, are
the only ones in the package.
"""

import tensorflow as tf

# `tf.keras` is the Keras that TensorFlow was told to use; its full package
# (`keras` or `tf_keras`) has the parts `tf.keras` leaves out (`saving`).
keras = tf.keras
if keras.__version__.startswith("2."):
    import tf_keras as keras  # noqa: F811
else:
    import keras  # noqa: F811


class _Keras3Adapter:
    """Keras 3 (the `keras` package) on the TensorFlow backend."""

    generation = 3

    def __init__(self):
        from keras.src.models import functional
        from keras.src.models import model as model_lib
        from keras.src.saving import keras_saveable

        # `Model(inputs=..., outputs=...)` is resolved by Keras rewriting the
        # class hierarchy in place (`inject_functional_model_class`). We build
        # functional AccumModels from a `(cls, Functional)` subclass instead,
        # which needs Functional's own `__init__` and the check it uses.
        self.functional_class = functional.Functional
        self._functional_init_arguments = model_lib.functional_init_arguments
        # Keras' saving walks attributes that are `KerasSaveable` and stores
        # what their `save_own_variables` writes; that is how the window state
        # travels in `.keras` and `.weights.h5` files without being a weight.
        self.saveable_base = keras_saveable.KerasSaveable
        self.saveable_obj_type = "Operation"
        # Keras names a class in a saved config by this registry.
        from keras.src.saving import object_registration

        self._registered_names = object_registration.GLOBAL_CUSTOM_NAMES
        self._variants = {}

    def check_backend(self):
        backend = keras.backend.backend()
        if backend != "tensorflow":
            raise ValueError(
                "`AccumModel` runs on the TensorFlow backend of Keras only. "
                f"Received: keras.backend.backend()={backend!r}. Set "
                "KERAS_BACKEND=tensorflow before importing Keras."
            )

    # Construction

    def is_functional_call(self, args, kwargs):
        return self._functional_init_arguments(args, kwargs)

    def functional_variant(self, cls):
        """The `(cls, Functional)` class a functional `cls(...)` becomes."""
        if issubclass(cls, self.functional_class):
            return cls
        variant = self._variants.get(cls)
        if variant is None:
            variant = type(
                cls.__name__,
                (cls, self.functional_class),
                {
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "_accum_non_functional_base": cls,
                },
            )
            # Saved under the name of `cls`; `cls.from_config` comes back here.
            self._registered_names[variant] = (
                keras.saving.get_registered_name(cls)
            )
            self._variants[cls] = variant
        return variant

    def non_functional_base(self, cls):
        """Undoes `functional_variant` for a subclass-style construction."""
        return cls.__dict__.get("_accum_non_functional_base", cls)

    def init_functional(self, model, args, kwargs):
        # What `keras.Model.__init__` does for functional arguments, minus the
        # class rewrite (the instance is already of a Functional subclass).
        keras.Model.__mro__[1].__init__(model)  # the backend Trainer
        self.functional_class.__init__(model, *args, **kwargs)

    # The training step

    def unpack(self, data):
        return keras.utils.unpack_x_y_sample_weight(data)

    def forward(self, model, x):
        if model._call_has_training_arg:
            return model(x, training=True)
        return model(x)

    def compute_loss(self, model, x, y, y_pred, sample_weight):
        # `_compute_loss` is Keras' own wrapper that passes `training` only to
        # `compute_loss` overrides that accept it.
        return model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )

    def track_loss(self, model, loss, batch_size):
        # Exactly what Keras' `train_step` logs: the loss per micro-batch,
        # weighted by its batch size, so `logs["loss"]` is a per-sample mean.
        model._loss_tracker.update_state(
            loss * _num_replicas(), sample_weight=batch_size
        )

    def unscale_loss_for_distribution(self, loss):
        return loss * tf.cast(_num_replicas(), loss.dtype)

    def compute_metrics(self, model, x, y, y_pred, sample_weight):
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # Optimizers

    def is_loss_scale_optimizer(self, optimizer):
        return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def inner_optimizer(self, optimizer):
        if self.is_loss_scale_optimizer(optimizer):
            return optimizer.inner_optimizer
        return optimizer

    def build_optimizer(self, optimizer, variables):
        if not optimizer.built:
            optimizer.build(variables)

    def apply_gradients(self, optimizer, grads, variables):
        # Gradients arrive unscaled and already checked for finiteness, so a
        # LossScaleOptimizer's inner optimizer applies them.
        self.inner_optimizer(optimizer).apply(grads, variables)

    def iterations(self, optimizer):
        return optimizer.iterations

    # Serialization and callbacks

    def register_serializable(self, cls):
        return keras.saving.register_keras_serializable(
            package="accum_model"
        )(cls)

    callback_base = keras.callbacks.Callback


def _num_replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync


def _select_adapter():
    version = getattr(keras, "__version__", "3")
    if version.startswith("2."):
        raise ImportError(
            "accum_model supports Keras 3 (`tf.keras` on TensorFlow >= 2.16). "
            f"Received: tf.keras version {version}."
        )
    return _Keras3Adapter()


ADAPTER = _select_adapter()
