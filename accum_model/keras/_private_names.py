"""Every private TensorFlow and Keras name the package uses, with its reason.

`PRIVATE_NAMES` is `{module: {name: why}}`. A name is listed for each module
that imports it (a private module path: a `src` or `python` package), reads
or calls it, overrides it, or writes it as an attribute; also listed are
the package's own private attributes that one module writes on an object of
another (`model._x = ...` outside the class that owns `_x`).
`tests/test_keras.py` greps the package and fails on one that is missing
here, and on an entry no longer used.

What happens on a release that renames or drops one depends on the use:

- an import, or a read or call of an attribute, fails loudly: an
  `ImportError` when `accum_model` is imported (the adapter imports its
  private modules then), an `AttributeError` at the first use;
- a read with a default (`getattr(x, "_name", default)`) gets the default,
  an override of a method Keras no longer calls is never called, and a
  written attribute Keras no longer reads is ignored: all silently.

So each use is exercised by the tests, which CI runs on the newest releases
and on the oldest supported ones (`_versions`, the floor below which
`import accum_model` refuses).
"""

_KERAS_3_LOSS = (
    "Keras 3's `CompileLoss`, what `compute_loss` calls: its per-output "
    "`Loss` objects carry the reductions the normalizer replays "
    "(`compiled_loss_terms`)"
)
_TF_KERAS_LOSS = (
    "tf_keras' `LossesContainer` (`compiled_loss`): its per-output losses "
    "and how it pairs targets with outputs, which the normalizer replays "
    "(`compiled_loss_terms`)"
)

PRIVATE_NAMES = {
    "_adapter_base.py": {
        # The training step.
        "_flatten_layers": "how Keras itself walks nested layers and models "
        "(both generations)",
        "_keras_mask": "where Keras 3 keeps a layer's output mask on the "
        "tensor; read with a default, as its losses read it",
        # Optimizers.
        "_learning_rate": "where optimizers of both generations keep what "
        "`learning_rate=` received (a schedule), read with a default",
        # Distribution.
        "_in_multi_worker_mode": "how Keras itself tells a multi-worker "
        "collective strategy, where its 3.15 `fit` needs two workarounds",
    },
    "_keras3.py": {
        # Imports (the private modules' functions and classes).
        "keras.src.models": "Keras 3's `Functional` and its constructor "
        "checks, `inject_functional_model_class`, and `clone_model`'s module: "
        "building functional `AccumModel`s without Keras' class rewrite",
        "keras.src.saving": "Keras 3's `KerasSaveable` (how the window state "
        "travels in saved files) and the registry of serializable names",
        "_call_has_training_arg": "Keras 3's own test of whether `call` "
        "takes `training`, as its `train_step` asks",
        "_compute_loss": "Keras 3's wrapper of `compute_loss` that passes "
        "`training` only to overrides that accept it, as its `train_step` "
        "calls it",
        "_loss_tracker": "Keras 3's `loss` metric, updated per micro-batch as "
        "its `train_step` updates it",
        "_compile_loss": _KERAS_3_LOSS,
        "_flat_losses": _KERAS_3_LOSS,
        "_y_pred_build_structure": _KERAS_3_LOSS,
        "keras.src.backend.tensorflow": "Keras 3's `reduce_per_replica`, "
        "how its `fit` reduces a step's per-replica logs, for "
        "`step_on_data`",
        "_initial_epoch": "read by Keras 3's `fit` right after "
        "`on_train_begin` (what its `BackupAndRestore` sets): "
        "`ResumableBackup` writes it",
    },
    "_tf_keras.py": {
        # Imports (the private modules' functions and classes).
        "tf_keras.src.engine": "tf_keras' `Functional`, its constructor "
        "checks and config, and `inject_functional_model_class`",
        "tf_keras.src.saving": "tf_keras' registry of serializable names",
        "tf_keras.src.models": "tf_keras' `clone_model` module, whose "
        "functions `_clone_hook` wraps",
        "tf_keras.src": "tf_keras' `backend.is_tpu_strategy`, how its own "
        "`fit` chooses how to reduce per-replica logs",
        "_GLOBAL_CUSTOM_NAMES": "tf_keras' registry of class names (Keras 3's "
        "is public-named): classes made at run time are saved under a name",
        "_GLOBAL_CUSTOM_OBJECTS": "tf_keras' registry of names to classes: "
        "loading finds the classes `accumulate` makes",
        "_validate_target_and_loss": "tf_keras' `train_step` check of the "
        "targets and loss, kept in the accumulating step",
        "_losses": _TF_KERAS_LOSS,
        "_conform_to_outputs": _TF_KERAS_LOSS,
        "_built": "whether a tf_keras optimizer or loss container is built "
        "(set by `build`, absent before); read with a default",
        "_loss_scale": "tf_keras' `_DynamicLossScaleState` holding a "
        "`LossScaleOptimizer`'s scale variable",
        "_train_counter": "tf_keras' count of training steps, which its "
        "own step function increments: so does `step_on_data`",
        "_test_counter": "tf_keras' count of evaluation steps, likewise",
        "_predict_counter": "tf_keras' count of prediction steps, likewise",
        "_steps_per_execution": "tf_keras keeps `steps_per_execution` in "
        "this variable; `ResumableBackup` counts batches with it",
        # Saving, loading and resuming.
        "_updated_config": "tf_keras' `to_json` takes `class_name` from it; "
        "overridden on `accumulate`'s classes, which share their base's name",
        "_track_trackable": "tf_keras' way to add a checkpoint dependency "
        "that is not counted among the weights: the window state",
        "_training_state": "read by tf_keras' `fit` right after "
        "`on_train_begin` (what its `BackupAndRestore` sets): "
        "`ResumableBackup` writes it",
    },
    "_clone_hook.py": {
        "_accum_model_hook": "a mark on the wrappers this module puts on "
        "Keras' clone functions, so that they are wrapped once",
    },
    "_model_classes.py": {
        "_accum_sees_arguments": "a mark on the `__init__` wrappers this "
        "module puts on subclasses, so that an inherited one is not wrapped "
        "again",
    },
    "_model.py": {
        "_init_settings": "`AccumSettings`' initializer of the settings it "
        "holds, called by `AccumModel._init_accumulation`",
        "_micro_batch": "the model's own `micro_batch_size` setting and "
        'what `"auto"` chose (`_settings.MicroBatch`), an attribute of its '
        "base class `AccumSettings`",
        "_compilation": "`jit_compile` and `compile_update` for the "
        "engine's steps, from the model's `jit_compile` and what `compile` "
        "was given (`AccumSettings`)",
    },
    "_attempts.py": {
        "_omit_frequent_tracing_warning": "an attribute of TensorFlow's "
        "`tf.function`, set on the read of what an attempt may write, made "
        "again for each slice size by design",
    },
    "_multi_worker.py": {
        "_maybe_symbolic_build": "Keras 3's `fit` builds the model through "
        "it; overridden to build without a collective under "
        "MultiWorkerMirroredStrategy",
    },
    "_batchnorm.py": {
        name: "BatchNormalization's internals (Keras 3), used by "
        "`AccumBatchNormalization`, which replaces only the moving-"
        "statistics update of `BatchNormalization.call`"
        for name in (
            "_moments",
            "_reduction_axes",
            "_renorm_correction_and_moments",
            "_compose_transforms",
            "_update_renorm_statistics",
        )
    },
    "_inference.py": {
        "_omit_frequent_tracing_warning": "an attribute of TensorFlow's "
        "`tf.function`, set on the trace that gives a predict step's output "
        "spec, made again by design for each trace of the step",
    },
    "_epoch_end.py": {
        "_omit_frequent_tracing_warning": "an attribute of TensorFlow's "
        "`tf.function`, set on the epoch-end apply, which each model traces "
        "once (the warning would count the models of one process)",
    },
    "_model_engine.py": {
        "_obj_type": "what Keras 3's saving records for a `KerasSaveable`; "
        "the state says what kind of object it is",
    },
    "_checkpoint.py": {
        "_serialize_to_tensors": "TensorFlow's `Trackable` method that gives "
        "a checkpoint the tensors of an object (overridden): the window "
        "state's entries, keyed as `_formats` keys them",
        "_restore_from_tensors": "TensorFlow's `Trackable` method that "
        "restores an object from what a checkpoint holds (overridden): "
        "through `_formats.read`, all or nothing",
        "_lookup_dependency": "TensorFlow's `Trackable` method that a "
        "restore asks for each child the checkpoint holds (overridden): "
        "children mean the layout before issue 39, which is warned about",
    },
    "_control_flow.py": {
        "tensorflow.python.ops": "`control_flow_util`, the one way to ask "
        "whether a graph being traced is compiled by XLA, for custom loops "
        "that do not say (`jit_compile=None`)",
    },
}
