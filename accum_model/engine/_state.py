"""The window's state, declared once and saved by name.

Every variable a `GradientAccumulator` keeps (its own, the noise scale's,
AdaScale's, the `AccumBatchNormalization` layers' window moments) is
declared in the tables below, with its name, dtype, aggregation and role,
and created by `WindowState.declare`. Saving, restoring, resetting and the
memory count all read the one `WindowState`:

- `window`: zero when no window is open; zeroed when a window ends.
- `lifetime`: kept across windows (counters, moving averages, the
  accumulators, which the next window's first micro-batch overwrites).
- `setting`: a setting held as a variable so that changing it does not
  retrace; a model restores it from its config, so it is not saved.
- `batch`: a batch on its way into the window (`_contribution`): zero
  between batches, so never saved.

A file holds each saved variable under its name and the format's version;
`load` matches by name and refuses a file that lacks an entry this state
needs or holds one it does not know, naming it. Variables of the model (an
accumulator, the flag of whether it received a gradient, a BatchNorm
layer's window moments) are keyed by their place in the model's
structure, as Keras keys a model's weights, never crosswise. `_formats`
writes and reads the files, every format since 0.1.0.

This module knows TensorFlow only.
"""

import collections

import numpy as np
import tensorflow as tf

from accum_model.engine import _formats

SUM = tf.VariableAggregation.SUM
FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA

WINDOW = "window"
LIFETIME = "lifetime"
SETTING = "setting"
BATCH = "batch"

Entry = collections.namedtuple(
    "Entry", ["name", "dtype", "aggregation", "role", "initial", "since"]
)
Entry.__new__.__defaults__ = (0, 1)
Entry.__doc__ = """One state variable, as the tables declare it.

`aggregation`: under a strategy the variables are per-replica, summed on
read (`SUM`, a replica's part of a global sum) or the first replica's
(`FIRST`, equal on every replica). `since`: the file format that first
saved it; an older file that lacks it loads it as `initial`.
"""

# The engine's own scalars.
ENGINE = (
    Entry("accum_steps", tf.int64, FIRST, SETTING),
    # The open window's length, latched when it opens, so that a new
    # `accum_steps` takes effect at the next window.
    Entry("micro_step", tf.int64, FIRST, WINDOW),
    Entry("contributed_steps", tf.int64, FIRST, WINDOW),
    Entry("weight_sum", tf.float32, SUM, WINDOW),
    Entry("window_steps", tf.int64, FIRST, LIFETIME),
    Entry("skipped_microbatches", tf.int64, FIRST, LIFETIME),
    Entry("discarded_windows", tf.int64, FIRST, LIFETIME),
)
# One of each per accumulated variable, of its shape (`received`: whether
# it ever received a gradient, one element of a vector over the variables).
ACCUMULATOR = Entry("accumulator", tf.float32, SUM, LIFETIME)
RECEIVED = Entry("received", tf.int64, FIRST, LIFETIME)
# A batch entering the window in slices (`_contribution`). `open`: 1 from
# the first addition of a batch to its end, so a batch cut short by an
# error is seen. `sums`: what its slices added so far (`BATCH_SUMS`), one
# vector written by one operation per slice, after the slice's additions.
# Per replica, like the accumulators.
BATCH_STATE = (
    Entry("open", tf.int64, FIRST, BATCH),
    Entry("sums", tf.float32, SUM, BATCH),
)
BATCH_SUMS = (
    # Rows whose slices are in: added, or left out as not finite.
    "rows",
    # The weight of the added slices, and of all (for the logged loss).
    "weight",
    "loss_weight",
    "weighted_loss",
    # The noise scale's sums of the added slices.
    "squared_norm_sum",
    "micro_batches",
    "added",
    "non_finite",
)
# Per accumulated variable: the row up to which it holds the open batch's
# gradient (a batch that may be run again after an out-of-memory error).
ROWS_ADDED = Entry("rows_added", tf.int64, FIRST, BATCH)
# `_noise_scale.NoiseScaleEstimator`.
NOISE_SCALE = (
    Entry("squared_norm_sum", tf.float32, SUM, WINDOW),
    Entry("micro_batches", tf.float32, SUM, WINDOW),
    Entry("windows", tf.int64, FIRST, LIFETIME),
    Entry("measurements", tf.float32, FIRST, LIFETIME),
    Entry("ema_trace_sigma", tf.float32, FIRST, LIFETIME),
    Entry("ema_grad_sq_norm", tf.float32, FIRST, LIFETIME),
    Entry("ema_window_weight", tf.float32, FIRST, LIFETIME),
    Entry("ema_micro_batch_weight", tf.float32, FIRST, LIFETIME),
    Entry("last_trace_sigma", tf.float32, FIRST, LIFETIME),
    Entry("last_grad_sq_norm", tf.float32, FIRST, LIFETIME),
)
# `_adascale.AdaScaleState`: equal on every replica.
ADASCALE = (
    Entry("tau", tf.float64, FIRST, LIFETIME),
    Entry("gain", tf.float32, FIRST, LIFETIME, 1.0),
    Entry("learning_rate", tf.float32, FIRST, LIFETIME),
)
# `AccumBatchNormalization`'s window moments, per channel, in the dtype
# the layer computes them in (None here).
BATCHNORM = (
    Entry("count", None, FIRST, WINDOW),
    Entry("mean", None, FIRST, WINDOW),
    Entry("variance", None, FIRST, WINDOW),
)


def variable_path(variable):
    """A variable's path in its model: Keras 3's `path`, else its name."""
    path = getattr(variable, "path", None)
    return path if isinstance(path, str) else variable.name.split(":")[0]


def item_name(group, index, path):
    """The name of a model item: `group/0003/path`."""
    return f"{group}/{index:04d}/{path}"


class WindowState(tf.Module):
    """Every variable of one engine's state, by name, in declaration order.

    Args:
        name: Name of the module.
    """

    def __init__(self, name="state"):
        super().__init__(name=name)
        self._variables = {}
        self._entries = {}
        # For the per-variable `received` vector: the names of its elements.
        self._vector_items = {}
        self._items = {}
        # Declared by layers (`declare_item`): written by their forward
        # pass.
        self._item_variables = []
        # The dotted paths of all of the model's weights, in its order
        # (`place_items_in`).
        self._structure = None

    def declare(self, name, entry, shape=(), dtype=None, initial=None):
        """Creates the variable `name` of `entry`, eagerly.

        Args:
            name: Str, unique in this state (`group/entry` by convention).
            entry: Its `Entry`.
            shape: Its shape.
            dtype: Its dtype, where `entry.dtype` is None.
            initial: Its initial value, where not `entry.initial`.

        Returns:
            The `tf.Variable`.

        Raises:
            ValueError: If `name` is declared already.
        """
        if name in self._variables:
            raise ValueError(f"State variable {name!r} is declared twice.")
        dtype = entry.dtype or dtype
        with tf.init_scope():
            variable = tf.Variable(
                tf.fill(
                    shape,
                    tf.constant(
                        entry.initial if initial is None else initial, dtype
                    ),
                ),
                trainable=False,
                name=name.replace("/", "_"),
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=entry.aggregation,
            )
        self._variables[name] = variable
        self._entries[name] = entry
        return variable

    def declare_group(self, group, entries, shape=(), dtype=None):
        """Declares `group/<entry name>` for each of `entries`.

        Returns:
            A dict from entry name to variable.
        """
        return {
            e.name: self.declare(f"{group}/{e.name}", e, shape, dtype)
            for e in entries
        }

    def declare_item(self, group, path, entries, shape, dtype):
        """Declares `entries` for the next item of `group` (a layer).

        Named `group/<index>/path/<entry>`, the index counting the items of
        `group` in the order they are declared.

        Returns:
            A dict from entry name to variable.
        """
        self._items[group] = index = self._items.get(group, -1) + 1
        declared = self.declare_group(
            item_name(group, index, path), entries, shape, dtype
        )
        self._item_variables.extend(declared.values())
        return declared

    def declare_vector(self, name, entry, item_names):
        """Declares a vector with one element per item, saved per item.

        Args:
            name: The vector's name.
            entry: Its `Entry`.
            item_names: One name per element (saved as `name` of each).

        Returns:
            The `tf.Variable`.
        """
        variable = self.declare(name, entry, shape=(len(item_names),))
        self._vector_items[name] = list(item_names)
        return variable

    @property
    def variables(self):
        """Every variable, in declaration order."""
        return list(self._variables.values())

    def names(self, role=None):
        """The names of the variables (of `role`), in declaration order."""
        return [
            n
            for n in self._variables
            if role is None or self._entries[n].role == role
        ]

    def get(self, name):
        """The variable `name`."""
        return self._variables[name]

    def item_variables(self):
        """The variables layers declared, which their forward pass writes."""
        return list(self._item_variables)

    def window_variables(self):
        """The variables zeroed when a window ends."""
        return [self._variables[n] for n in self.names(WINDOW)]

    def batch_variables(self):
        """The variables of a batch in progress, zero between batches."""
        return [self._variables[n] for n in self.names(BATCH)]

    def saved_variables(self):
        """The variables a checkpoint holds: neither settings nor batches."""
        return [v for _, v in self.saved()]

    # Files

    def place_items_in(self, paths):
        """Keys the model's items by their place among `paths`.

        Args:
            paths: The paths (`variable_path`) of all of the model's
                weights, trainable or not, in the model's order: the places
                a frozen layer keeps, so that the items of the layers after
                it keep their keys when it is frozen or thawed.
        """
        self._structure = [file_key(p) for p in paths]

    def save(self, store):
        """Writes every saved variable into the dict-like `store`.

        Keyed by name, the model's items by structure, with the format's
        version (`_formats.write`).
        """
        _formats.write(self, store)

    def load(self, store):
        """Assigns every saved variable from `store`, of any format.

        Nothing is assigned unless every entry matches (`_formats.read`).

        Raises:
            ValueError: If `store` lacks an entry this state saves (one its
                format already had), holds one it does not know, or holds
                one of another shape.
        """
        for variable, value in _formats.read(self, store):
            variable.assign(
                np.asarray(value, dtype=variable.dtype.as_numpy_dtype)
            )

    @property
    def structure(self):
        """The dotted paths of all of the model's weights, or None."""
        return self._structure

    def entry(self, name):
        """The `Entry` that declared `name`."""
        return self._entries[name]

    def is_vector(self, name):
        """Whether `name` is saved as one entry per element."""
        return name in self._vector_items

    def saved(self):
        """`[(name, variable)]` of the saved variables, in order."""
        return [
            (n, v)
            for n, v in self._variables.items()
            if self._entries[n].role not in (SETTING, BATCH)
        ]

    def dotted_keys(self):
        """The dotted keys of every saved variable, vector elements apart."""
        return [k for name, _ in self.saved() for k in self.keys(name)]

    def keys(self, name):
        """The dotted keys of `name`: its own, or one per vector element."""
        items = self._vector_items.get(name)
        return [file_key(n) for n in ([name] if items is None else items)]

    def split(self, name, value):
        """`{dotted key: array}` of variable `name` holding `value`."""
        if name in self._vector_items:
            return dict(zip(self.keys(name), value))
        return {file_key(name): value}


def file_key(name):
    """A name, dotted (Keras' stores take no `/` in a key): format 1's key."""
    return name.replace("/", ".")
