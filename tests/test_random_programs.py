"""Seeded random programs over `AccumModel`, checked against a replay.

Each program is a short random sequence of operations on one tiny model:
`fit` (random numbers of micro-batches, a short last one, one or two epochs,
an `accum_steps` change from a callback mid-fit), `accum_steps` and
`epoch_end` changes, `apply_accumulated`, `gradient_accumulator.reset`,
`compile` again (same or new optimizer, another `steps_per_execution`),
save and load (`.keras` or `.weights.h5`, into a new model object) and
`evaluate`. The programs run one after another, so each starts from the
state the last one left.

An independent model of the window (a list of the open window's
micro-batches, its latched length and the next one) predicts which windows
close; a plain `keras.Model` replays each closed window as one batch. After
every operation: the weights are finite and equal the replay's, the
optimizer's `iterations` counts the windows applied since it was created,
and the engine's micro-step and weight sum are the open window's.
"""

import os

import numpy as np
import tensorflow as tf

from accum_model import AccumModel
from accum_model.keras._adapter import ADAPTER
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

_PROGRAMS = 100
_B = 2  # Micro-batch size; a fit's last micro-batch may be shorter.
_POOL = 64  # Samples to draw fit slices from.


def _optimizer(name):
    return tu.OPTIMIZERS[name]()


class _SetAccumStepsAt(keras.callbacks.Callback):
    """Sets `accum_steps` after the execution holding micro-batch `at`."""

    def __init__(self, at, value):
        super().__init__()
        self.at, self.value, self.done = at, value, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.done and batch >= self.at:
            self.model.accum_steps = self.value
            self.done = True


class _Simulation:
    """What the window should hold, and the plain replay of its updates."""

    def __init__(
        self, test, x, y, initial, accum_steps, epoch_end, optimizer, spe
    ):
        self.test, self.x, self.y = test, x, y
        self.accum_steps = accum_steps
        self.window_len = accum_steps
        self.epoch_end = epoch_end
        self.spe = spe
        self.pending = []  # Row arrays of the open window's micro-batches.
        self.applied = 0  # Windows applied by the current optimizer.
        self.replay = tu.mlp(keras.Model)
        self.replay.set_weights(initial)
        self.replay.compile(optimizer=_optimizer(optimizer), loss="mse")

    # The window's rules.

    def set_accum_steps(self, value):
        self.accum_steps = value
        if not self.pending:
            self.window_len = value

    def _close(self):
        if self.pending:
            rows = np.concatenate(self.pending)
            self.replay.train_on_batch(self.x[rows], self.y[rows])
            self.applied += 1
        self.pending = []
        self.window_len = self.accum_steps

    def reset(self):
        self.pending = []
        self.window_len = self.accum_steps

    def flush(self):
        if self.pending:
            self._close()

    def fit(self, rows, epochs, change):
        micro_batches = [rows[i : i + _B] for i in range(0, len(rows), _B)]
        last = len(micro_batches) - 1
        for epoch in range(epochs):
            for i, micro in enumerate(micro_batches):
                self.pending.append(micro)
                if len(self.pending) >= self.window_len:
                    self._close()
                end_of_execution = i % self.spe == self.spe - 1 or i == last
                if (
                    epoch == 0
                    and change is not None
                    and end_of_execution
                    and i >= change[0]
                    and not change[2]
                ):
                    self.set_accum_steps(change[1])
                    change[2] = True
            if self.epoch_end == "apply":
                self.flush()

    # The checks.

    def check(self, model, what):
        test = self.test
        weights = model.get_weights()
        for w in weights:
            test.assertTrue(np.all(np.isfinite(w)), what)
        diff = tu.max_abs_diff(self.replay.get_weights(), weights)
        test.assertLessEqual(diff, 1e-5, f"{what}: weights differ by {diff}")
        test.assertEqual(int(model.optimizer.iterations), self.applied, what)
        engine = model.gradient_accumulator
        if engine is not None:
            test.assertEqual(int(engine.micro_step), len(self.pending), what)
            test.assertAllClose(
                float(engine.weight_sum),
                float(sum(len(m) for m in self.pending)),
                msg=what,
            )


class RandomProgramTest(tf.test.TestCase):
    def test_random_programs_match_the_replay(self):
        rng = np.random.default_rng(1234)
        x, y = tu.regression_data(_POOL, seed=3)
        tmp = self.get_temp_dir()
        optimizer = "adam"
        accum_steps, epoch_end, spe = 3, "carry", 1
        model = tu.mlp(AccumModel, accum_steps=accum_steps, epoch_end=epoch_end)
        model.compile(optimizer=_optimizer(optimizer), loss="mse")
        sim = _Simulation(
            self,
            x,
            y,
            model.get_weights(),
            accum_steps,
            epoch_end,
            optimizer,
            spe,
        )
        operations = (
            ["fit"] * 10
            + ["accum_steps", "epoch_end", "apply", "reset", "evaluate"] * 2
            + ["compile", "save"]
        )
        counts = {}
        for program in range(_PROGRAMS):
            for _ in range(rng.integers(1, 4)):
                op = str(rng.choice(operations))
                counts[op] = counts.get(op, 0) + 1
                what = f"program {program}, {op}"
                if op == "fit":
                    start = int(rng.integers(0, _POOL - 2))
                    size = int(rng.integers(1, min(12 * _B, _POOL - start)))
                    rows = np.arange(start, start + size)
                    epochs = int(rng.integers(1, 3))
                    callbacks, change = [], None
                    if rng.random() < 0.4:
                        at = int(rng.integers(0, (size + _B - 1) // _B))
                        value = int(rng.integers(1, 5))
                        change = [at, value, False]
                        callbacks.append(_SetAccumStepsAt(at, value))
                    what += f" {size} samples x{epochs} change={change}"
                    model.fit(
                        x[rows],
                        y[rows],
                        batch_size=_B,
                        epochs=epochs,
                        shuffle=False,
                        verbose=0,
                        callbacks=callbacks,
                    )
                    sim.fit(rows, epochs, change)
                elif op == "accum_steps":
                    value = int(rng.integers(1, 5))
                    model.accum_steps = value
                    sim.set_accum_steps(value)
                elif op == "epoch_end":
                    value = str(rng.choice(["apply", "carry", "carry"]))
                    model.epoch_end = value
                    sim.epoch_end = value
                elif op == "apply":
                    self.assertEqual(
                        model.apply_accumulated(), bool(sim.pending), what
                    )
                    sim.flush()
                elif op == "reset":
                    if model.gradient_accumulator is not None:
                        model.gradient_accumulator.reset()
                    sim.reset()
                elif op == "evaluate":
                    rows = np.arange(0, 8)
                    self.assertAllClose(
                        model.evaluate(x[rows], y[rows], verbose=0),
                        sim.replay.evaluate(x[rows], y[rows], verbose=0),
                        atol=1e-5,
                        msg=what,
                    )
                elif op == "compile":
                    spe = int(rng.integers(1, 4))
                    if rng.random() < 0.5:
                        new = model.optimizer  # Keeps its state.
                    else:
                        optimizer = str(rng.choice(["adam", "sgd"]))
                        new = _optimizer(optimizer)
                        sim.replay.compile(
                            optimizer=_optimizer(optimizer), loss="mse"
                        )
                        sim.applied = 0
                    model.compile(
                        optimizer=new, loss="mse", steps_per_execution=spe
                    )
                    sim.spe = spe
                    what += f" spe={spe}"
                elif op == "save":
                    suffix = str(rng.choice([".keras", ".weights.h5"]))
                    path = os.path.join(tmp, f"p{program}{suffix}")

                    def fresh():
                        new = tu.mlp(
                            AccumModel,
                            seed=9,
                            accum_steps=sim.accum_steps,
                            epoch_end=sim.epoch_end,
                        )
                        new.compile(
                            optimizer=_optimizer(optimizer),
                            loss="mse",
                            steps_per_execution=sim.spe,
                        )
                        new.optimizer.build(new.trainable_variables)
                        return new

                    model = tu.save_and_load(model, path, fresh)
                    sim.spe = max(1, int(ADAPTER.steps_per_execution(model)))
                    what += f" {suffix}"
                sim.check(model, what)
        # Every operation ran, and windows were applied.
        self.assertEqual(set(counts), set(operations))
        self.assertGreater(int(model.optimizer.iterations) + sim.applied, 0)


if __name__ == "__main__":
    tf.test.main()
