"""The adapter of Keras 3 (the `keras` package) on the TensorFlow backend."""

import tensorflow as tf

from accum_model.core._control_flow import first_replica
from accum_model.keras._adapter_base import AdapterBase
from accum_model.keras._adapter_base import is_multi_worker_collective
from accum_model.keras._adapter_base import num_replicas
from accum_model.keras._generation import keras


class Keras3Adapter(AdapterBase):
    """Keras 3 (the `keras` package) on the TensorFlow backend."""

    def __init__(self):
        from keras.src.backend.tensorflow import trainer
        from keras.src.models import cloning
        from keras.src.models import functional
        from keras.src.models import model as model_lib
        from keras.src.saving import keras_saveable
        from keras.src.saving import object_registration

        # `Model(inputs=..., outputs=...)` is resolved by Keras rewriting the
        # class hierarchy in place (`inject_functional_model_class`). We build
        # functional AccumModels from a `(cls, Functional)` subclass instead,
        # which needs Functional's own `__init__` and the check it uses.
        self.functional_class = functional.Functional
        self.functional_like = functional.functional_like_constructor
        # Keras' saving walks attributes that are `KerasSaveable` and stores
        # what their `save_own_variables` writes; that is how the window state
        # travels in `.keras` and `.weights.h5` files without being a weight.
        self.saveable_base = keras_saveable.KerasSaveable
        self.saveable_obj_type = "Operation"
        # `clone_model`'s module, whose functions `_clone_hook` wraps.
        self.cloning_module = cloning
        super().__init__(
            functional_init_arguments=model_lib.functional_init_arguments,
            inject_functional=model_lib.inject_functional_model_class,
            # Keras names a class in a saved config by this registry.
            registered_names=object_registration.GLOBAL_CUSTOM_NAMES,
            registered_objects=object_registration.GLOBAL_CUSTOM_OBJECTS,
            reduce_per_replica=trainer.reduce_per_replica,
        )

    def check_backend(self):
        backend = keras.backend.backend()
        if backend != "tensorflow":
            raise ValueError(
                "`AccumModel` runs on the TensorFlow backend of Keras only. "
                f"Received: keras.backend.backend()={backend!r}. Set "
                "KERAS_BACKEND=tensorflow before importing Keras."
            )

    def check_accum_batchnorm(self):
        """Raises unless `AccumBatchNormalization` works with this Keras."""

    def accumulating_class_methods(self):
        """Methods the classes of `accumulate` need in this generation."""
        return {}

    def functional_config(self, model):
        return self.functional_class.get_config(model)

    def init_functional(self, model, args, kwargs):
        # What `keras.Model.__init__` does for functional arguments, minus the
        # class rewrite (the instance is already of a Functional subclass).
        keras.Model.__mro__[1].__init__(model)  # the backend Trainer
        self.functional_class.__init__(model, *args, **kwargs)

    def forward(self, model, x, training=True):
        if model._call_has_training_arg:
            return model(x, training=training)
        return model(x)

    def compute_loss(self, model, x, y, y_pred, sample_weight, training=True):
        # `_compute_loss` is Keras' own wrapper that passes `training` only to
        # `compute_loss` overrides that accept it.
        return model._compute_loss(
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )

    def track_loss(self, model, loss, batch_size):
        # Exactly what Keras' `train_step` logs: the loss per micro-batch,
        # weighted by its batch size, so `logs["loss"]` is a per-sample mean.
        # A replica's empty shard of a short global batch has a NaN mean
        # loss; weighted 0 it would still turn the tracker's total into NaN.
        loss = tf.where(batch_size > 0, loss, tf.zeros_like(loss))
        model._loss_tracker.update_state(
            loss * num_replicas(), sample_weight=batch_size
        )

    def symbolic_build_arguments(self, model, iterator, data_batch):
        """What `_maybe_symbolic_build` should build the model from.

        Keras reduces the first distributed batch with
        `strategy.reduce("MEAN", batch, axis=None)` to get one batch to build
        on; under MultiWorkerMirroredStrategy that is a collective over the
        data (integer labels and all) and fails ("Attempt to convert a value
        (PerReplica...)"). Building needs only shapes and dtypes, so this
        worker's first replica's shard serves, with no communication.

        Returns:
            `(iterator, data_batch)` to pass on to Keras.
        """
        strategy = model.distribute_strategy
        if iterator is None or not is_multi_worker_collective(strategy):
            return iterator, data_batch
        for _, _, it in iterator:
            batch = next(it)
            break
        else:
            return iterator, data_batch

        return None, tf.nest.map_structure(
            lambda value: first_replica(strategy, value), batch
        )

    def logs_for_replica_reduction(self, model, logs):
        """Makes a step's scalar logs reducible by Keras' multi-worker path.

        Keras' `reduce_per_replica` averages per-replica logs under
        MultiWorkerMirroredStrategy with `strategy.reduce("MEAN", v,
        axis=0)`, which needs a leading axis that scalar losses and metrics
        do not have ("axis 0 out of range"). With shape `[1]` that reduction
        is the mean over replicas, what Keras computes for one-worker
        strategies, and it returns a scalar again.
        """
        if not is_multi_worker_collective(model.distribute_strategy):
            return logs

        def expand(value):
            if isinstance(value, (tf.Tensor, tf.Variable)) and (
                value.shape.rank == 0
            ):
                return tf.reshape(value, [1])
            return value

        return tf.nest.map_structure(expand, logs)

    def update_metrics(self, model, x, y, y_pred, sample_weight):
        """Updates the compiled metrics with a slice, reading no result."""
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def metric_variables(self, model):
        return list(model.metrics_variables)

    def _counted_step(self, model, step, kind):
        del model, kind  # Keras 3 counts its steps itself.
        return step

    def _log_reduction(self, model):
        del model  # Keras 3's `fit` reduces with "auto".
        return "auto"

    def is_loss_scale_optimizer(self, optimizer):
        return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def optimizer_built(self, optimizer):
        return optimizer.built

    def apply_gradients(self, optimizer, grads, variables):
        # Gradients arrive unscaled and already checked for finiteness, so a
        # LossScaleOptimizer's inner optimizer applies them.
        self.inner_optimizer(optimizer).apply(grads, variables)

    def loss_scale(self, optimizer):
        """Float32 scalar: the scale of the next micro-batch's loss."""
        if not optimizer.built:
            return tf.constant(float(optimizer.initial_scale), tf.float32)
        return tf.cast(
            tf.convert_to_tensor(optimizer.dynamic_scale), tf.float32
        )

    def loss_scale_is_variable(self, optimizer):
        """Whether the scale a loss is scaled by now is read from a variable.

        Keras 3's `scale_loss` multiplies by the initial scale, a Python
        float, until the optimizer is built: traced then, a step keeps that
        constant whatever the scale becomes.
        """
        return optimizer.built

    def applied_gradient_scale(self, optimizer):
        """Float32 scalar: the scale of gradients handed to `optimizer`.

        What a loss-scale optimizer's apply divides gradients by: Keras 3's
        `apply` takes gradients of `optimizer.scale_loss(loss)`, scaled by
        the current scale.
        """
        return self.loss_scale(optimizer)

    def dynamic_loss_scale(self, optimizer):
        """Where a loss-scale optimizer keeps its dynamic scale.

        Returns:
            `(scale_variable, counter_variable, growth_steps, min_scale)`,
            or None when the scale is fixed.
        """
        # Keras 3's scale is always dynamic, and has no floor.
        return (
            optimizer.dynamic_scale,
            optimizer.step_counter,
            optimizer.dynamic_growth_steps,
            None,
        )

    def train_logs(self, model, metrics, window_logs):
        """A training step's logs: the metrics', then the window's.

        Args:
            model: The model.
            metrics: Dict, the compiled metrics' results (loss included).
            window_logs: Dict of float32 scalars equal on every replica.

        Keras 3 averages per-replica logs, so they go as they are.
        """
        del model
        return {**metrics, **window_logs}

    def compiled_loss_terms(self, model, y, y_pred, sample_weight):
        """The compiled loss's terms for a micro-batch, as Keras computes them.

        Returns:
            A list of `(reduction, y_true, y_pred, sample_weight, mask,
            loss_fn)`, one per per-output loss, or None when there is no
            built compiled loss. `reduction` is one of
            "sum_over_batch_size", "mean_with_sample_weight", "sum",
            "none"; `y_true` is None when the targets cannot be paired
            with the output without Keras' own fallbacks.
        """
        # `_compile_loss` (private) is the `CompileLoss` that
        # `compute_loss` calls; its per-output `Loss` objects carry the
        # reductions, and `_flat_losses` their paths into `y_pred`.
        compile_loss = getattr(model, "_compile_loss", None)
        if compile_loss is None or not compile_loss.built:
            return None
        tree = keras.tree

        # As `CompileLoss.call` does: predictions in the structure the loss
        # was built with (the leaves, and their masks, stay the same).
        try:
            tree.assert_same_structure(
                compile_loss._y_pred_build_structure, y_pred
            )
        except (ValueError, TypeError):
            y_pred = tree.pack_sequence_as(
                compile_loss._y_pred_build_structure, tree.flatten(y_pred)
            )
        nested_weights = sample_weight is not None and tree.is_nested(
            sample_weight
        )
        # Targets by the same paths as predictions, as `CompileLoss.call`
        # pairs them in the common cases (one output, or the same
        # structure); its other fallbacks are not replayed here.
        nested_targets = tree.is_nested(y)
        terms = []
        for path, loss_fn, _, _ in compile_loss._flat_losses:
            y_p = _resolve_path(path, y_pred)
            if not nested_targets:
                y_t = y if not tree.is_nested(y_pred) else None
            else:
                try:
                    y_t = _resolve_path(path, y)
                except (KeyError, IndexError, TypeError):
                    y_t = None
            sw = (
                _resolve_path(path, sample_weight)
                if nested_weights
                else sample_weight
            )
            reduction = getattr(loss_fn, "reduction", "sum_over_batch_size")
            if reduction == "mean":
                reduction = "sum_over_batch_size"
            elif reduction is None:
                reduction = "none"
            terms.append(
                (reduction, y_t, y_p, sw, self.keras_mask(y_p), loss_fn)
            )
        return terms

    def track_state(self, model, state):
        del model, state  # Keras 3 saves it through `ModelEngine`.

    # Keras 3 saves weights, optimizer and the accumulation window only in
    # its `.weights.h5` format.
    backup_suffix = ".weights.h5"

    def backup_files(self, path):
        """The files `model.save_weights(path)` writes."""
        return [path]

    def start_at_epoch(self, model, epoch):
        """Makes the `fit` now starting (in `on_train_begin`) begin at `epoch`.

        `fit` reads `_initial_epoch` (private; what Keras'
        `BackupAndRestore` sets) right after `on_train_begin`.
        """
        model._initial_epoch = epoch

    def clear_start_epoch(self, model):
        # Keras never resets it: a later `fit` would start there too.
        model._initial_epoch = None

    def steps_per_execution(self, model):
        return model.steps_per_execution

    def build_optimizer_for_restore(self, optimizer, variables):
        """Creates the optimizer's slots before a checkpoint is loaded."""
        self.build_optimizer(optimizer, variables)

    def build_optimizer_in_trace(self, optimizer, variables):
        """Creates, in the function being traced, slots Keras creates there.

        Keras 3's optimizers are built before a step is traced: nothing.
        """
        del optimizer, variables


def _resolve_path(path, structure):
    for key in path:
        structure = structure[key]
    return structure
