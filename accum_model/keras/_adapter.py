"""The adapter: everything that differs between Keras generations.

`tf.keras` is Keras 3 on TensorFlow >= 2.16, or Keras 2 (`tf_keras`) when
`TF_USE_LEGACY_KERAS=1` is set before TensorFlow is imported. The engine and
`AccumModel` call the one `ADAPTER` chosen here, never `if` on the version.

Most private Keras names the package uses are used here, each with its
reason where it is used; `_private_names` lists them all, module by module.
Loading this module first checks the versions (`_versions`).
"""

import os

import tensorflow as tf

from accum_model.core._control_flow import first_replica
from accum_model.keras import _versions

# Before `tf.keras` is read: on an older TensorFlow it is Keras 2 whatever
# is installed, and the rest of this module cannot load.
_versions.check_tensorflow(tf.__version__)

# `tf.keras` is the Keras that TensorFlow was told to use; its full package
# (`keras` or `tf_keras`) has the parts `tf.keras` leaves out (`saving`).
LEGACY = tf.keras.Model.__module__.startswith("tf_keras")
if LEGACY:
    import tf_keras as keras
else:
    import keras

_versions.check_versions(tf.__version__, keras.__version__, LEGACY)


if LEGACY:

    class _TfKerasSaveable(keras.losses.Loss):
        """A base that tf_keras' saving visits (see `_TfKerasAdapter`)."""

        def __init__(self):
            super().__init__(name="accumulation_state")

        def call(self, y_true, y_pred):
            raise NotImplementedError("Holds training state; not a loss.")


class _Keras3Adapter:
    """Keras 3 (the `keras` package) on the TensorFlow backend.

    Also the common interface: `_TfKerasAdapter` overrides what Keras 2
    does differently.
    """

    def __init__(self):
        from keras.src.models import functional
        from keras.src.models import model as model_lib
        from keras.src.saving import keras_saveable

        # `Model(inputs=..., outputs=...)` is resolved by Keras rewriting the
        # class hierarchy in place (`inject_functional_model_class`). We build
        # functional AccumModels from a `(cls, Functional)` subclass instead,
        # which needs Functional's own `__init__` and the check it uses.
        self.functional_class = functional.Functional
        self.functional_like = functional.functional_like_constructor
        self._functional_init_arguments = model_lib.functional_init_arguments
        # Keras' saving walks attributes that are `KerasSaveable` and stores
        # what their `save_own_variables` writes; that is how the window state
        # travels in `.keras` and `.weights.h5` files without being a weight.
        self.saveable_base = keras_saveable.KerasSaveable
        self.saveable_obj_type = "Operation"
        # Keras names a class in a saved config by this registry.
        from keras.src.saving import object_registration

        self._registered_names = object_registration.GLOBAL_CUSTOM_NAMES
        self._registered_objects = object_registration.GLOBAL_CUSTOM_OBJECTS
        self._inject_functional = model_lib.inject_functional_model_class
        # `clone_model`'s module, whose functions `_clone_hook` wraps.
        from keras.src.models import cloning

        self.cloning_module = cloning
        self._variants = {}
        from keras.src.backend.tensorflow import trainer

        self._reduce_per_replica = trainer.reduce_per_replica

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

    def layers(self, model, include_self=False):
        """Every layer of `model`, nested ones included, depth first."""
        # `_flatten_layers` (private, both generations) is how Keras itself
        # walks nested layers and models.
        return list(model._flatten_layers(include_self=include_self))

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
            self._registered_names[variant] = keras.saving.get_registered_name(
                cls
            )
            self._variants[cls] = variant
        return variant

    def inject_functional(self, cls):
        """Makes `cls` a Functional subclass as `keras.Model.__init__` does.

        Keras rewrites `__bases__` of every `keras.Model` subclass among the
        ancestors of `cls` (`inject_functional_model_class`, private) when a
        subclass is constructed with `inputs` and `outputs`; keras-hub's
        `PipelineModel` undoes and redoes it on every construction. The
        bases of `AccumModel` stay (see its metaclass).
        """
        self._inject_functional(cls)

    def registered_name(self, cls):
        return keras.saving.get_registered_name(cls)

    def register_name(self, cls, name):
        """Makes Keras write `name` as the registered name of `cls`."""
        self._registered_names[cls] = name

    def register_object(self, name, obj):
        """Makes Keras find `obj` when it loads the registered `name`."""
        self._registered_objects[name] = obj
        self._registered_names[obj] = name

    def accumulating_class_methods(self):
        """Methods the classes of `accumulate` need in this generation."""
        return {}

    def deserialize(self, config):
        """A Keras object from the dict `serialize_keras_object` writes."""
        return keras.saving.deserialize_keras_object(config)

    def non_functional_base(self, cls):
        """Undoes `functional_variant` for a subclass-style construction."""
        return cls.__dict__.get("_accum_non_functional_base", cls)

    def functional_config(self, model):
        return self.functional_class.get_config(model)

    def init_functional(self, model, args, kwargs):
        # What `keras.Model.__init__` does for functional arguments, minus the
        # class rewrite (the instance is already of a Functional subclass).
        keras.Model.__mro__[1].__init__(model)  # the backend Trainer
        self.functional_class.__init__(model, *args, **kwargs)

    # The training step

    def unpack(self, data):
        return keras.utils.unpack_x_y_sample_weight(data)

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
            loss * _num_replicas(), sample_weight=batch_size
        )

    # MultiWorkerMirroredStrategy: two narrow workarounds for Keras 3.15's
    # `fit`, which fails there on CPU for any model (also a plain
    # `keras.Model`). Both apply only when the strategy is a multi-worker
    # collective one, the case Keras itself singles out in
    # `reduce_per_replica` (`_collective_all_reduce_multi_worker`).

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
        if iterator is None or not _is_multi_worker_collective(strategy):
            return iterator, data_batch
        for _, _, it in iterator:
            batch = next(it)
            break
        else:
            return iterator, data_batch

        return None, tf.nest.map_structure(
            lambda value: first_replica(strategy, value), batch
        )

    def is_multi_worker(self, strategy):
        """Whether `strategy` is a collective one across several workers."""
        return _is_multi_worker_collective(strategy)

    def logs_for_replica_reduction(self, model, logs):
        """Makes a step's scalar logs reducible by Keras' multi-worker path.

        Keras' `reduce_per_replica` averages per-replica logs under
        MultiWorkerMirroredStrategy with `strategy.reduce("MEAN", v,
        axis=0)`, which needs a leading axis that scalar losses and metrics
        do not have ("axis 0 out of range"). With shape `[1]` that reduction
        is the mean over replicas, what Keras computes for one-worker
        strategies, and it returns a scalar again.
        """
        if not _is_multi_worker_collective(model.distribute_strategy):
            return logs

        def expand(value):
            if isinstance(value, (tf.Tensor, tf.Variable)) and (
                value.shape.rank == 0
            ):
                return tf.reshape(value, [1])
            return value

        return tf.nest.map_structure(expand, logs)

    def unscale_loss_for_distribution(self, loss):
        return loss * tf.cast(_num_replicas(), loss.dtype)

    def compute_metrics(self, model, x, y, y_pred, sample_weight):
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def update_metrics(self, model, x, y, y_pred, sample_weight):
        """Updates the compiled metrics with a slice, reading no result."""
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def metric_variables(self, model):
        return list(model.metrics_variables)

    def step_on_data(self, model, step, kind="train"):
        """A function of one batch given as data, as Keras' own would be.

        What Keras' own train, test or predict function runs per step
        (`strategy.run` of the step, the outputs reduced over replicas,
        compiled as Keras compiles it), except that the batch comes as an
        argument instead of from the iterator inside: so the same batch can
        run again.

        Args:
            model: The model.
            step: Its step, `step(data)`.
            kind: `"train"`, `"test"` or `"predict"`.
        """
        strategy = model.distribute_strategy
        reduction = (
            "concat" if kind == "predict" else self._log_reduction(model)
        )
        counted = self._counted_step(model, step, kind)

        # Not converted by AutoGraph, as Keras' own step is not.
        @tf.autograph.experimental.do_not_convert
        def one_step(data):
            outputs = strategy.run(counted, args=(data,))
            return self._reduce_per_replica(outputs, strategy, reduction)

        if model.run_eagerly:
            return one_step
        return tf.function(
            one_step, reduce_retracing=True, jit_compile=model.jit_compile
        )

    def _counted_step(self, model, step, kind):
        del model, kind  # Keras 3 counts its steps itself.
        return step

    def _log_reduction(self, model):
        del model  # Keras 3's `fit` reduces with "auto".
        return "auto"

    # Optimizers

    def is_loss_scale_optimizer(self, optimizer):
        return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def inner_optimizer(self, optimizer):
        if self.is_loss_scale_optimizer(optimizer):
            return optimizer.inner_optimizer
        return optimizer

    def optimizer_built(self, optimizer):
        return optimizer.built

    def is_sgd(self, optimizer):
        """Whether `optimizer` is exactly Keras' SGD (not a subclass).

        A subclass may change the update, which AdaScale's rule assumes.
        """
        return type(optimizer) is keras.optimizers.SGD

    def learning_rate_schedule(self, optimizer):
        """The optimizer's `LearningRateSchedule`, or None for a fixed rate.

        `_learning_rate` (private) is where Keras optimizers of both
        generations keep what `learning_rate=` received; the public
        `learning_rate` reads a schedule only at the optimizer's own step.
        """
        schedule = getattr(optimizer, "_learning_rate", None)
        schedules = keras.optimizers.schedules.LearningRateSchedule
        return schedule if isinstance(schedule, schedules) else None

    def learning_rate(self, optimizer):
        """Tensor: the fixed learning rate of an optimizer without schedule."""
        return tf.convert_to_tensor(optimizer.learning_rate)

    def build_optimizer(self, optimizer, variables):
        if not self.optimizer_built(optimizer):
            optimizer.build(variables)

    def apply_gradients(self, optimizer, grads, variables):
        # Gradients arrive unscaled and already checked for finiteness, so a
        # LossScaleOptimizer's inner optimizer applies them.
        self.inner_optimizer(optimizer).apply(grads, variables)

    # Loss scaling (mixed_float16); rules in `_mixed_precision`.

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

    # Loss normalizers; rules in `_normalizers`.

    def keras_mask(self, tensor):
        # Keras 3 keeps a layer's output mask on the tensor itself; its
        # losses read it from there (`backend.get_keras_mask`).
        return getattr(tensor, "_keras_mask", None)

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

    # Serialization and callbacks

    def track_state(self, model, accumulator):
        del model, accumulator  # Keras 3 saves it through `ModelEngine`.

    def register_serializable(self, cls):
        return keras.saving.register_keras_serializable(package="accum_model")(
            cls
        )

    callback_base = keras.callbacks.Callback

    # Resuming mid-epoch (`ResumableBackup`)

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


class _TfKerasAdapter(_Keras3Adapter):
    """Keras 2 (`tf_keras`), what `tf.keras` is under TF_USE_LEGACY_KERAS=1."""

    def __init__(self):
        from tf_keras.src.engine import functional
        from tf_keras.src.engine import training
        from tf_keras.src.saving import object_registration

        self.functional_class = functional.Functional
        self.functional_like = functional.has_functional_like_constructor
        self._functional_init_arguments = (
            training.is_functional_model_init_params
        )
        # tf_keras' saving visits only Layers, Optimizers, Metrics and Losses
        # among a model's attributes; a Loss is the one of those that Keras
        # neither counts as weights nor reports as a metric.
        self.saveable_base = _TfKerasSaveable
        self.saveable_obj_type = None
        self._registered_names = object_registration._GLOBAL_CUSTOM_NAMES
        self._registered_objects = object_registration._GLOBAL_CUSTOM_OBJECTS
        self._inject_functional = training.inject_functional_model_class
        from tf_keras.src.models import cloning

        self.cloning_module = cloning
        self._variants = {}
        self._reduce_per_replica = training.reduce_per_replica

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

    def track_state(self, model, accumulator):
        # tf_keras' BackupAndRestore and `save_weights` in TF format write
        # `tf.train.Checkpoint`s of the model. A checkpoint dependency added
        # this way is saved and restored (also when created after a restore
        # began) but, unlike an attribute, is not counted among the weights.
        model._track_trackable(accumulator, name="accumulation", overwrite=True)

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
        if reduction != "sum" or _num_replicas() == 1:
            return logs

        def share(value):
            if tf.is_tensor(value) and value.dtype.is_floating:
                return value / tf.cast(_num_replicas(), value.dtype)
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


def _resolve_path(path, structure):
    for key in path:
        structure = structure[key]
    return structure


def _is_multi_worker_collective(strategy):
    # Private: `_in_multi_worker_mode` is how Keras itself tells this case.
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def _num_replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync


def _select_adapter():
    return _TfKerasAdapter() if LEGACY else _Keras3Adapter()


ADAPTER = _select_adapter()
