"""The adapter of Keras 2 (`tf_keras`), `tf.keras` under TF_USE_LEGACY_KERAS=1.

Imported only then.
"""

import os

import tensorflow as tf

from accum_model.keras._adapter_base import AdapterBase
from accum_model.keras._adapter_base import num_replicas
from accum_model.keras._generation import keras


class _TfKerasSaveable(keras.losses.Loss):
    """A base that tf_keras' saving visits (see `TfKerasAdapter`)."""

    def __init__(self):
        super().__init__(name="accumulation_state")

    def call(self, y_true, y_pred):
        raise NotImplementedError("Holds training state; not a loss.")


class _ResumeCounters:
    """What tf_keras' `fit` asks `model._training_state` for (private)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def maybe_load_initial_counters_from_ckpt(
        self, steps_per_epoch, initial_epoch, mode=None
    ):
        del steps_per_epoch, initial_epoch, mode
        # Step 0: the callback skips the consumed batches itself (tf_keras'
        # own initial step shortens the epoch without skipping its data).
        return self.epoch, 0


class TfKerasAdapter(AdapterBase):
    """Keras 2 (`tf_keras`), what `tf.keras` is under TF_USE_LEGACY_KERAS=1."""

    def __init__(self):
        from tf_keras.src.engine import functional
        from tf_keras.src.engine import training
        from tf_keras.src.saving import object_registration

        self.functional_class = functional.Functional
        self.functional_like = functional.has_functional_like_constructor
        # tf_keras' saving visits only Layers, Optimizers, Metrics and Losses
        # among a model's attributes; a Loss is the one of those that Keras
        # neither counts as weights nor reports as a metric.
        self.saveable_base = _TfKerasSaveable
        self.saveable_obj_type = None
        from tf_keras.src.models import cloning

        self.cloning_module = cloning
        super().__init__(
            functional_init_arguments=training.is_functional_model_init_params,
            inject_functional=training.inject_functional_model_class,
            registered_names=object_registration._GLOBAL_CUSTOM_NAMES,
            registered_objects=object_registration._GLOBAL_CUSTOM_OBJECTS,
            reduce_per_replica=training.reduce_per_replica,
        )

    def check_backend(self):
        pass  # tf_keras runs on TensorFlow only.

    def accumulating_class_methods(self):
        registered_name = self.registered_name

        def _updated_config(model):
            # tf_keras' `to_json` writes `class_name` from `__name__`, which
            # the classes of `accumulate` share with their base; under that
            # name `model_from_json` would build the base from their config.
            # `_updated_config` (private) is where `to_json` takes it from.
            config = keras.Model._updated_config(model)
            config["class_name"] = registered_name(type(model))
            return config

        return {"_updated_config": _updated_config}

    def check_accum_batchnorm(self):
        raise ValueError(
            "`AccumBatchNormalization` needs Keras 3; tf_keras "
            "(TF_USE_LEGACY_KERAS=1) is not supported yet. Received: "
            "tf.keras from tf_keras. Keep `BatchNormalization` there "
            "(its moving statistics then update once per micro-batch)."
        )

    def functional_config(self, model):
        # tf_keras writes a graph config only for classes whose `__init__`
        # has Functional's exact signature; ours adds keyword arguments.
        from tf_keras.src.engine import functional

        config = {"name": model.name, "trainable": model.trainable}
        return functional.get_network_config(model, config=config)

    def init_functional(self, model, args, kwargs):
        # tf_keras' Functional.__init__ runs Model.__init__ itself.
        self.functional_class.__init__(model, *args, **kwargs)

    def compute_loss(self, model, x, y, y_pred, sample_weight, training=True):
        loss = model.compute_loss(x, y, y_pred, sample_weight)
        if training:
            # As tf_keras' `train_step` (its `test_step` does not check).
            model._validate_target_and_loss(y, loss)
        return loss

    def forward(self, model, x, training=True):
        return model(x, training=training)

    def track_loss(self, model, loss, batch_size):
        del model, loss, batch_size  # tf_keras' compiled loss tracks itself.

    def update_metrics(self, model, x, y, y_pred, sample_weight):
        # What tf_keras' own `compute_metrics` does before it reads the
        # results: a read is a cross-replica reduction under a strategy,
        # which a slice's loop may not hold.
        model.compiled_metrics.update_state(y, y_pred, sample_weight)

    def metric_variables(self, model):
        return [v for metric in model.metrics for v in metric.variables]

    def _counted_step(self, model, step, kind):
        # As tf_keras' own step functions: it counts steps here.
        counter = {
            "train": model._train_counter,
            "test": model._test_counter,
            "predict": model._predict_counter,
        }[kind]

        def run_step(data):
            outputs = step(data)
            with tf.control_dependencies(tf.nest.flatten(outputs)):
                counter.assign_add(1)
            return outputs

        return run_step

    def _log_reduction(self, model):
        return model.distribute_reduction_method

    def symbolic_build_arguments(self, model, iterator, data_batch):
        del model  # tf_keras builds in the traced step; nothing to change.
        return iterator, data_batch

    def logs_for_replica_reduction(self, model, logs):
        del model  # tf_keras' `reduce_per_replica` handles scalar logs.
        return logs

    def is_loss_scale_optimizer(self, optimizer):
        return isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)

    # tf_keras' `.h5` weights leave out the optimizer; its TensorFlow
    # checkpoint format keeps the optimizer and the accumulation window.
    backup_suffix = ""

    def backup_files(self, path):
        directory = os.path.dirname(path)
        prefix = os.path.basename(path)
        return [
            os.path.join(directory, name)
            for name in os.listdir(directory or ".")
            if name.startswith(prefix + ".")
        ]

    def start_at_epoch(self, model, epoch):
        # Read by tf_keras' `fit` right after `on_train_begin`, as its own
        # BackupAndRestore's worker training state is.
        model._training_state = _ResumeCounters(epoch)

    def clear_start_epoch(self, model):
        model._training_state = None

    def steps_per_execution(self, model):
        # Private: tf_keras keeps it in a variable.
        return int(model._steps_per_execution.numpy())

    def build_optimizer_for_restore(self, optimizer, variables):
        # `_built` (private) is set by `build`, absent before it.
        inner = self.inner_optimizer(optimizer)
        if hasattr(inner, "build") and not getattr(inner, "_built", False):
            inner.build(variables)

    def build_optimizer_in_trace(self, optimizer, variables):
        # tf_keras' optimizers create their slots at their first apply,
        # in the step being traced.
        self.build_optimizer_for_restore(optimizer, variables)

    def track_state(self, model, state):
        """Saves `state` (a trackable) in the model's TensorFlow checkpoints.

        tf_keras' BackupAndRestore and `save_weights` in TF format write
        `tf.train.Checkpoint`s of the model. A checkpoint dependency added
        this way is saved and restored (also when created after a restore
        began: TensorFlow restores it as it is added) but, unlike an
        attribute, is not counted among the weights. `state` is the
        window's state matched by name and structure
        (`_checkpoint.StateCheckpoint`), not the accumulator, whose
        variables a checkpoint would key by their attribute paths.
        """
        model._track_trackable(state, name="accumulation", overwrite=True)

    def optimizer_built(self, optimizer):
        return getattr(optimizer, "_built", True)

    def apply_gradients(self, optimizer, grads, variables):
        self.inner_optimizer(optimizer).apply_gradients(
            [(g, v) for g, v in zip(grads, variables) if g is not None]
        )

    def loss_scale(self, optimizer):
        return tf.cast(optimizer.loss_scale, tf.float32)

    def loss_scale_is_variable(self, optimizer):
        del optimizer  # tf_keras creates the scale variable with the optimizer.
        return True

    def applied_gradient_scale(self, optimizer):
        # tf_keras' `apply_gradients` takes gradients already unscaled with
        # `optimizer.get_unscaled_gradients` (only their finiteness is left
        # to check).
        del optimizer
        return tf.constant(1.0)

    def dynamic_loss_scale(self, optimizer):
        if not optimizer.dynamic:
            return None  # A fixed scale never moves.
        # `_loss_scale` (private) is the `_DynamicLossScaleState` holding the
        # scale variable; `dynamic_counter` is its public counter variable.
        # tf_keras never halves the scale below 1.
        return (
            optimizer._loss_scale.current_loss_scale,
            optimizer.dynamic_counter,
            optimizer.dynamic_growth_steps,
            1.0,
        )

    def train_logs(self, model, metrics, window_logs):
        # tf_keras *sums* per-replica logs across replicas (its "auto"
        # reduction outside TPUs); it shows the metrics' own results at an
        # epoch's end only when the step's logs have exactly their keys,
        # which the window's logs add to. So every float log, equal on every
        # replica, is handed out in equal shares whose sum is the value; a
        # share computed in each replica is a per-replica value, so the
        # single-worker sum counts each share once, as the multi-worker
        # all-reduce does.
        from tf_keras.src import backend as tf_keras_backend

        logs = {**metrics, **window_logs}
        reduction = model.distribute_reduction_method
        if reduction == "auto":
            strategy = tf.distribute.get_strategy()
            tpu = tf_keras_backend.is_tpu_strategy(strategy)
            reduction = "first" if tpu else "sum"
        if reduction != "sum" or num_replicas() == 1:
            return logs

        def share(value):
            if tf.is_tensor(value) and value.dtype.is_floating:
                return value / tf.cast(num_replicas(), value.dtype)
            return value

        return {key: share(value) for key, value in logs.items()}

    def compiled_loss_terms(self, model, y, y_pred, sample_weight):
        # `compiled_loss` is tf_keras' `LossesContainer`; `_losses` (private)
        # are its per-output `Loss` objects in `tf.nest.flatten(y_pred)`
        # order, and `_conform_to_outputs` (private) is how it pairs targets
        # and sample weights with outputs.
        container = getattr(model, "compiled_loss", None)
        if container is None or not getattr(container, "_built", False):
            return None
        y = tf.nest.flatten(container._conform_to_outputs(y_pred, y))
        sample_weight = tf.nest.flatten(
            container._conform_to_outputs(y_pred, sample_weight)
        )
        reductions = {
            "auto": "sum_over_batch_size",
            "sum_over_batch_size": "sum_over_batch_size",
            "sum": "sum",
            "none": "none",
        }
        terms = []
        for y_t, y_p, sw, loss_obj in zip(
            y, tf.nest.flatten(y_pred), sample_weight, container._losses
        ):
            if y_t is None or loss_obj is None:
                continue  # No loss for this output, as the container skips.
            reduction = reductions.get(
                getattr(loss_obj, "reduction", "auto"), "sum_over_batch_size"
            )
            terms.append(
                (reduction, y_t, y_p, sw, self.keras_mask(y_p), loss_obj)
            )
        return terms
