"""What the two Keras adapters share: the calls that read the same in both.

`_keras3.Keras3Adapter` and `_tf_keras.TfKerasAdapter` are siblings built
on `AdapterBase`; each sets, in its constructor, the private parts of its
Keras that these methods use (`functional_class`, the registries, ...).
"""

import tensorflow as tf

from accum_model.keras._generation import keras


class AdapterBase:
    """The methods both generations run the same way.

    Args:
        functional_init_arguments: Keras' check of whether a construction
            is functional (`inputs` and `outputs`).
        inject_functional: Keras' `inject_functional_model_class`.
        registered_names: Keras' registry of the names classes are saved
            under, by class.
        registered_objects: Keras' registry of objects, by name.
        reduce_per_replica: Keras' reduction of a step's outputs over
            replicas.
    """

    def __init__(
        self,
        *,
        functional_init_arguments,
        inject_functional,
        registered_names,
        registered_objects,
        reduce_per_replica,
    ):
        self._functional_init_arguments = functional_init_arguments
        self._inject_functional = inject_functional
        self._registered_names = registered_names
        self._registered_objects = registered_objects
        self._reduce_per_replica = reduce_per_replica
        # The `(cls, Functional)` class of each class (`functional_variant`).
        self._variants = {}

    def _counted_step(self, model, step, kind):
        """`step` counted as Keras' own step function counts (per kind)."""
        raise NotImplementedError

    def _log_reduction(self, model):
        """How Keras reduces a training step's logs over replicas."""
        raise NotImplementedError

    def layers(self, model, include_self=False):
        """Every layer of `model`, nested ones included, depth first."""
        # `_flatten_layers` (private, both generations) is how Keras itself
        # walks nested layers and models.
        return list(model._flatten_layers(include_self=include_self))

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

    def deserialize(self, config):
        """A Keras object from the dict `serialize_keras_object` writes."""
        return keras.saving.deserialize_keras_object(config)

    def non_functional_base(self, cls):
        """Undoes `functional_variant` for a subclass-style construction."""
        return cls.__dict__.get("_accum_non_functional_base", cls)

    def unpack(self, data):
        return keras.utils.unpack_x_y_sample_weight(data)

    def is_multi_worker(self, strategy):
        """Whether `strategy` is a collective one across several workers."""
        return is_multi_worker_collective(strategy)

    def unscale_loss_for_distribution(self, loss):
        return loss * tf.cast(num_replicas(), loss.dtype)

    def compute_metrics(self, model, x, y, y_pred, sample_weight):
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

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

    def inner_optimizer(self, optimizer):
        if self.is_loss_scale_optimizer(optimizer):
            return optimizer.inner_optimizer
        return optimizer

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

    def keras_mask(self, tensor):
        # Keras 3 keeps a layer's output mask on the tensor itself; its
        # losses read it from there (`backend.get_keras_mask`).
        return getattr(tensor, "_keras_mask", None)

    def register_serializable(self, cls):
        return keras.saving.register_keras_serializable(package="accum_model")(
            cls
        )

    callback_base = keras.callbacks.Callback


def is_multi_worker_collective(strategy):
    # Private: `_in_multi_worker_mode` is how Keras itself tells this case.
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def num_replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync
