"""`EngineState`: everything one `GradientAccumulator` keeps, in one place.

The engine's variables (declared by name in a `_state.WindowState`), the
trace-time knowledge of which variables receive gradients, the noise
scale's and AdaScale's state, the apply hooks and the compiled updates:
one value that the accumulator owns and hands, explicitly, to the
functions a micro-batch goes in through (`_contribution`) and a window out
through (`_close`). Its transitions that are more than one assignment
(ending a window, resetting, ending a batch) are its methods.
"""

import weakref

import tensorflow as tf

from accum_model.engine import _adascale
from accum_model.engine import _noise_scale
from accum_model.engine import _state

# The two lengths start at the constructor's `accum_steps`.
_LENGTHS = ("accum_steps", "window_steps")


class Received:
    """Which variables ever received a gradient.

    Known when a step is traced (shared by the replicas' traces: only ever
    grows) and saved (the `received` vector, written at each window's
    first addition), so that a restored window can be applied before any
    step is traced. The others get `None` at apply, as plain training gives
    them (the optimizer neither decays nor counts them).

    Args:
        count: The number of variables.
        flags: The saved int64 vector, one element per variable.
    """

    def __init__(self, count, flags):
        self._seen = [False] * count
        self.flags = flags

    def note(self, grads):
        """Notes which of `grads` (one per variable) is not None."""
        self._seen = [s or g is not None for s, g in zip(self._seen, grads)]

    def seen_constant(self):
        """Int64 vector tensor of what traces have seen, to save."""
        return tf.constant([int(s) for s in self._seen], tf.int64)

    def at_apply(self):
        """Per variable: whether it gets a gradient at apply (trace time).

        What traced steps have seen, joined with what was saved.
        """
        if not all(self._seen):
            # Read eagerly, without `merge_call`: under a strategy every
            # replica reads its own copy (all equal), so the replicas'
            # traces stay alike whichever of them notes first.
            with tf.init_scope():
                saved = self.flags.numpy()
            self._seen = [s or bool(f) for s, f in zip(self._seen, saved)]
        return list(self._seen)


class CompiledUpdates:
    """The compiled updates of one engine, by (optimizer, receiving).

    A plain object: `tf.Module` tracks the dicts set as its attributes,
    and a checkpoint (tf_keras' `BackupAndRestore`, `save_weights` in
    TensorFlow's format) refuses one with tuple keys.
    """

    def __init__(self):
        self._entries = {}

    def get(self, optimizer, receiving):
        """The update compiled for `optimizer`, or None."""
        entry = self._entries.get((id(optimizer), tuple(receiving)))
        if entry is not None and entry[0]() is optimizer:
            return entry[1]
        return None

    def put(self, optimizer, receiving, function):
        """Keeps `function`, the update compiled for `optimizer`."""
        self._entries[id(optimizer), tuple(receiving)] = (
            weakref.ref(optimizer),
            function,
        )


class EngineState:
    """The state of one engine: its variables, by role (see the module).

    Args:
        store: The `_state.WindowState` to declare the variables in (the
            accumulator's, which checkpoints track).
        variables: The variables whose gradients are accumulated.
        accum_steps: Int, the initial window length.
        noise_scale: A `NoiseScale` config, or None.
        adascale: An `AdaScale` config, or None.
    """

    def __init__(self, store, variables, accum_steps, noise_scale, adascale):
        self.store = store
        self.variables = list(variables)
        engine = {
            e.name: store.declare(
                f"engine/{e.name}",
                e,
                initial=accum_steps if e.name in _LENGTHS else None,
            )
            for e in _state.ENGINE
        }
        self.accum_steps = engine["accum_steps"]
        # The open window's length, latched when it opens.
        self.window_steps = engine["window_steps"]
        self.micro_step = engine["micro_step"]
        self.contributed = engine["contributed_steps"]
        self.weight_sum = engine["weight_sum"]
        self.skipped = engine["skipped_microbatches"]
        self.discarded = engine["discarded_windows"]
        paths = [_state.variable_path(v) for v in self.variables]
        self.accumulators = [
            store.declare(
                _state.item_name("accumulator", i, p),
                _state.ACCUMULATOR,
                v.shape,
            )
            for i, (v, p) in enumerate(zip(self.variables, paths))
        ]
        self.received = Received(
            len(paths),
            store.declare_vector(
                "received",
                _state.RECEIVED,
                [
                    _state.item_name("received", i, p)
                    for i, p in enumerate(paths)
                ],
            ),
        )
        batch = {
            e.name: store.declare(
                f"batch/{e.name}",
                e,
                shape=(len(_state.BATCH_SUMS),) if e.name == "sums" else (),
            )
            for e in _state.BATCH_STATE
        }
        self.batch_open = batch["open"]
        self.batch_sums = batch["sums"]
        self.rows_added = [
            store.declare(
                _state.item_name("rows_added", i, p), _state.ROWS_ADDED
            )
            for i, p in enumerate(paths)
        ]
        self.noise_scale = None
        if noise_scale is not None:
            self.noise_scale = _noise_scale.NoiseScaleEstimator(
                noise_scale, store
            )
        self.adascale = None
        if adascale is not None:
            self.adascale = _adascale.AdaScaleState(adascale, store)
        self.apply_hooks = []
        self.compiled_updates = CompiledUpdates()

    def end_window(self, closed):
        """Ends the open window: its counters zeroed, its length latched.

        The next window's length is latched here, when the last one ends,
        rather than tested on every micro-batch. No pass over the
        accumulators: the next window's first addition overwrites them.

        Args:
            closed: Bool, whether the window closed (rather than being
                discarded by `reset`): the noise scale counts it.
        """
        self.window_steps.assign(self.accum_steps.read_value())
        for v in self.store.window_variables():
            v.assign(tf.zeros_like(v))
        if closed and self.noise_scale is not None:
            self.noise_scale.count_closed_window()

    def end_batch(self):
        """Zeroes the state of a batch that entered in slices."""
        for v in self.store.batch_variables():
            v.assign(tf.zeros_like(v))

    def reset(self):
        """Discards the open window and any batch on its way in."""
        self.end_window(closed=False)
        self.end_batch()

    def set_accum_steps(self, value):
        """Sets the window length; between windows the next one takes it."""
        self.accum_steps.assign(value)
        if int(self.micro_step.read_value()) == 0:
            self.window_steps.assign(value)

    def full(self):
        """Bool scalar tensor: whether the open window holds all its steps."""
        return self.micro_step >= self.window_steps

    def batch_interrupted(self):
        """Bool: whether a step stopped part-way into its batch (eagerly),
        on any replica."""
        parts = getattr(self.batch_open, "values", (self.batch_open,))
        return any(int(p.numpy()) for p in parts)

    def progress_variables(self):
        """`[micro_step, contributed_steps, batch sums]`: how far a step
        got."""
        return [self.micro_step, self.contributed, self.batch_sums]

    def checkpoint_children(self):
        """`{attribute name: state}`: what a `GradientAccumulator` has
        tracked as checkpoint dependencies since 0.1.0, by those names."""
        return {
            "_variables": self.variables,
            "_accumulators": self.accumulators,
            "_received_flags": self.received.flags,
            "_batch_open": self.batch_open,
            "_batch_sums": self.batch_sums,
            "_rows_added": self.rows_added,
            "_accum_steps": self.accum_steps,
            "_window_steps": self.window_steps,
            "_micro_step": self.micro_step,
            "_contributed": self.contributed,
            "_weight_sum": self.weight_sum,
            "_skipped": self.skipped,
            "_discarded": self.discarded,
            "_noise_scale": self.noise_scale,
            "_adascale": self.adascale,
        }

    def batch_rows(self):
        """Float32 tensor: the rows of the open batch whose slices are in."""
        return self.batch_sums[_state.BATCH_SUMS.index("rows")]
