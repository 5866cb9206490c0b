"""benchmarks/bench_fit.py runs end to end and reports what it promises.

No timing is asserted (the machine is shared); the checks are on what the
run must report whatever the speed: every contender and workload, positive
rates, the accumulator's memory and the train step's trace counts.
"""

import functools
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import unittest

import tensorflow as tf

from tests import testing_utils as tu

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_benchmark(script, *flags):
    """Runs `benchmarks/<script>` with `flags` in a subprocess."""
    env = dict(os.environ, PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, os.path.join(_ROOT, "benchmarks", script), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def _run_bench_fit(*flags):
    """Runs `bench_fit.py --quick` with `flags`; (its result, its JSON path)."""
    path = os.path.join(tempfile.mkdtemp(), "bench.json")
    result = _run_benchmark("bench_fit.py", "--quick", *flags, f"--json={path}")
    return result, path


@functools.lru_cache(maxsize=None)
def _load_bench_fit():
    # Once per process: loading it again would define its flags twice.
    spec = importlib.util.spec_from_file_location(
        "bench_fit", os.path.join(_ROOT, "benchmarks", "bench_fit.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BenchFitTest(tf.test.TestCase):
    def test_every_contender_runs_once_in_every_position(self):
        rotated = _load_bench_fit().rotated
        names = ["a", "b", "c", "d", "e"]
        orders = [rotated(names, r) for r in range(len(names))]
        for order in orders:
            self.assertCountEqual(order, names)
        for position in range(len(names)):
            self.assertCountEqual([o[position] for o in orders], names)
        self.assertEqual(rotated(names, len(names)), names)

    def test_median_interval_is_the_order_statistics_by_hand(self):
        median_interval = _load_bench_fit().median_interval
        # 12 samples: P(Binomial(12, 1/2) <= 2) = (1 + 12 + 66) / 4096, so
        # the 3rd smallest and 3rd largest cover the median with
        # 1 - 2 * 79/4096 = 96.1%; the 4th would give 85.4%.
        values = [
            0.97,
            1.04,
            0.99,
            1.10,
            0.93,
            1.01,
            1.00,
            0.96,
            1.02,
            1.05,
            0.98,
            1.03,
        ]
        low, high, coverage = median_interval(values)
        self.assertEqual((low, high), (0.97, 1.04))
        self.assertAlmostEqual(coverage, 1 - 2 * 79 / 4096)
        # Too few samples for 95%: min and max, with their coverage.
        self.assertEqual(median_interval([3, 1, 2, 5, 4]), (1, 5, 1 - 2 / 32))

    def test_split_is_run_only_when_named(self):
        names = _load_bench_fit()._contender_names
        self.assertNotIn("split", names())
        self.assertEqual(names(["split"]), ["accum", "split"])

    def test_quick_run_reports_every_contender_and_workload(self):
        # Every contender: the default ones and the opt-in `split`.
        named = ["plain_B", "builtin", "plain_NB", "floor", "accum_again"]
        result, path = _run_bench_fit(
            "--optimizers=adamw", f"--contenders={','.join(named)},split"
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(path) as f:
            report = json.load(f)

        contenders = ["plain_B", "accum", "plain_NB", "floor", "accum_again"]
        if tu.HAS_BUILTIN_ACCUMULATION:
            contenders.append("builtin")
        workloads = [r["workload"] for r in report["results"]]
        self.assertCountEqual(workloads, ["mlp", "cnn", "transformer"])
        median_interval = _load_bench_fit().median_interval

        def check_ratio(ratio, numerator, denominator):
            # Recomputed here from the raw rates it reports.
            per_repeat = [
                a / b for a, b in zip(rates[numerator], rates[denominator])
            ]
            self.assertAllClose(ratio["per_repeat"], per_repeat)
            self.assertAllClose(ratio["median"], statistics.median(per_repeat))
            self.assertAllClose(
                ratio["interval"], median_interval(per_repeat)[:2]
            )

        for r in report["results"]:
            self.assertCountEqual(
                r["samples_per_second"], contenders + ["split"]
            )
            for rates in r["samples_per_second"].values():
                self.assertNotEmpty(rates)
                self.assertTrue(all(rate > 0 for rate in rates))
            rates = r["samples_per_second"]
            for reference in contenders[:1] + contenders[2:]:
                check_ratio(
                    r["ratios"][f"accum/{reference}"], "accum", reference
                )
            # micro_batch_size=B at N*B: against accum and plain fit at N*B,
            # with as many updates as plain fit at N*B, traced once.
            for reference in ("accum", "plain_NB"):
                check_ratio(
                    r["ratios"][f"split/{reference}"], "split", reference
                )
            split = r["split"]
            self.assertEqual(split["micro_batch_size"], r["micro_batch"])
            self.assertEqual(
                split["batch_size"], r["micro_batch"] * r["accum_steps"]
            )
            # The quick run's fits: 2N, N and N micro-batches' worth (two
            # warm-ups, one repeat), one update per N of them, as accum.
            self.assertEqual(split["updates"], 4)
            self.assertBetween(split["traces"], 1, 2)
            self.assertIn(
                f"| {r['workload']} | adamw | "
                f"{r['median_samples_per_second']['split']:.0f} | "
                f"{r['ratios']['split/accum']['median']:.3f} [",
                result.stdout,
            )
            # One float32 copy of the weights, plus a few scalar counters.
            memory = r["memory"]
            self.assertBetween(memory["accumulator_over_parameters"], 1.0, 1.05)
            # Traced no more than plain fit, and not per fit call (Keras 3
            # traces once; tf_keras twice, plain fit as well).
            traces = r["traces"]
            self.assertBetween(traces["accum"], 1, 2)
            self.assertLessEqual(traces["accum"], traces["plain_B"])
            self.assertGreater(traces["fit_calls"]["accum"], 2)
            # The table row of this workload is printed.
            self.assertIn(f"| {r['workload']} | adamw |", result.stdout)


class BenchFitNoiseScaleTest(tf.test.TestCase):
    # One quick run for both tests (a process and its imports fewer): the
    # union of their flags, every contender each test checks, under both
    # optimizers.
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.result, path = _run_bench_fit(
            "--workloads=mlp",
            "--optimizers=sgd,adamw",
            "--contenders=accum_again",
            "--noise_scale_every=1,3",
            "--adascale",
        )
        cls.report = None
        if cls.result.returncode == 0:
            with open(path) as f:
                cls.report = json.load(f)

    def setUp(self):
        super().setUp()
        self.assertEqual(self.result.returncode, 0, self.result.stderr[-3000:])

    def test_noise_scale_contenders_are_timed_against_accum(self):
        sgd, adamw = self.report["results"]
        self.assertEqual(
            [sgd["optimizer"], adamw["optimizer"]], ["sgd", "adamw"]
        )
        for r, extra in ((sgd, ["accum_adascale"]), (adamw, [])):
            optimizer = r["optimizer"]
            self.assertCountEqual(
                r["samples_per_second"],
                ["accum", "accum_again", "accum_gns_k1", "accum_gns_k3"]
                + extra,
            )
            for name in ("accum_gns_k1", "accum_gns_k3"):
                entry = r["noise_scale"][name]
                self.assertGreater(entry["ratio_to_accum"]["median"], 0)
                self.assertIn(
                    f"| mlp | {optimizer} | {name} |", self.result.stdout
                )
            # Every window of the quick run is measured at k=1.
            self.assertGreater(
                r["noise_scale"]["accum_gns_k1"]["measurements"],
                r["noise_scale"]["accum_gns_k3"]["measurements"],
            )

    def test_adascale_contender_only_with_sgd(self):
        sgd, adamw = self.report["results"]
        self.assertIn("accum_adascale", sgd["samples_per_second"])
        self.assertNotIn("accum_adascale", adamw["samples_per_second"])
        self.assertNotIn("adascale", adamw)
        entry = sgd["adascale"]
        self.assertGreater(entry["ratio_to_gns_k1"]["median"], 0)
        # The quick run's windows are 2 micro-batches of B = base batch.
        self.assertBetween(entry["gain"], 1.0, 2.0)
        # tau, the gain and the learning rate: three scalars.
        self.assertEqual(entry["state_bytes"], 8 + 4 + 4)
        self.assertIn("| mlp | sgd |", self.result.stdout)


class BenchFitBaselineTest(tf.test.TestCase):
    def test_an_old_copy_of_the_package_is_timed_against_this_one(self):
        # The copy is this package's own files: what is checked is that it
        # loads under another module name beside this one and runs its own
        # engine, in graph mode and under XLA.
        old = tempfile.mkdtemp()
        shutil.copytree(
            os.path.join(_ROOT, "accum_model"),
            os.path.join(old, "accum_model"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        for jit_compile in ("false", "true"):
            result, path = _run_bench_fit(
                "--workloads=mlp",
                "--optimizers=sgd",
                "--contenders=accum_again,split",
                f"--baseline={old}",
                f"--jit_compile={jit_compile}",
            )
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            with open(path) as f:
                report = json.load(f)
            self.assertEqual(
                report["baselines"], {"accum_baseline": os.path.abspath(old)}
            )
            (r,) = report["results"]
            self.assertEqual(r["xla"], jit_compile == "true")
            self.assertCountEqual(
                r["samples_per_second"],
                [
                    "accum",
                    "accum_again",
                    "accum_baseline",
                    "split",
                    "split_baseline",
                ],
            )
            # Each on as many samples, in updates of N*B.
            self.assertLen(set(r["updates"].values()), 1, r["updates"])
            entry = r["baseline"]["accum_baseline"]
            self.assertTrue(
                entry["engine_module"].startswith("accum_model_accum_baseline.")
            )
            rates = r["samples_per_second"]
            self.assertAllClose(
                entry["ratio_of_accum"]["per_repeat"],
                [
                    a / b
                    for a, b in zip(rates["accum"], rates["accum_baseline"])
                ],
            )
            self.assertGreaterEqual(entry["traces"], 1)
            self.assertIn("| mlp | sgd | accum_baseline |", result.stdout)


class BenchMemoryTest(tf.test.TestCase):
    @unittest.skipIf(tu.TF_KERAS, "keras-hub needs Keras 3")
    def _quick_rows(self, *flags):
        """A quick bench_memory.py run: its output and its rows by run."""
        path = os.path.join(tempfile.mkdtemp(), "memory.json")
        result = _run_benchmark(
            "bench_memory.py", "--quick", "--jobs=2", f"--json={path}", *flags
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(path) as f:
            return result, {r["run"]: r for r in json.load(f)["rows"]}

    def test_quick_run_measures_each_configuration_in_its_process(self):
        result, rows = self._quick_rows(
            "--models=gpt2", "--runs=plain_E,accum,split"
        )
        self.assertCountEqual(rows, ["plain_E", "accum", "split"])
        for r in rows.values():
            self.assertGreater(r["peak_bytes"], r["weight_bytes"])
            self.assertGreater(r["samples_per_second"], 0)
        self.assertEqual(rows["plain_E"]["micro_batch"], 4)
        self.assertEqual(rows["accum"]["micro_batch"], 2)
        # micro_batch_size=2 at the whole batch: slices of 2, batches of 4.
        self.assertEqual(rows["split"]["micro_batch"], 2)
        self.assertEqual(rows["split"]["fit_batch"], 4)
        # One update per window (per batch for split): the warm-up one and
        # three measured ones, whose largest peak is the row's.
        self.assertEqual(rows["accum"]["updates"], 4)
        self.assertEqual(rows["split"]["updates"], 4)
        for r in rows.values():
            self.assertLen(r["window_peak_bytes"], 3)
            self.assertEqual(r["peak_bytes"], max(r["window_peak_bytes"]))
            # Token ids, padding mask and labels: 3 int32 per token.
            self.assertEqual(r["input_bytes_per_sample"], 3 * 4 * 8)
        # The window: one float32 copy of the trainable weights, and a few
        # counters (also at accum_steps=1, for split).
        for run in ("accum", "split"):
            extra = (
                rows[run]["accumulator_bytes"] - rows[run]["trainable_bytes"]
            )
            self.assertBetween(extra, 0, 1024)
        self.assertIn("| gpt2 | adamw | accum_2 | 2 |", result.stdout)
        self.assertIn("| gpt2 | adamw | split_2 | 2 |", result.stdout)
        # Side by side; without plain_B the model is not fitted: n/a.
        self.assertRegex(
            result.stdout,
            r"\| gpt2 \| adamw \| 4 = 2 x 2 \| \d+ / n/a \| \d+ / n/a \| "
            r"\d+ / n/a \| -?\d+ / n/a \|",
        )

    def test_repeats_give_each_row_its_median_and_range(self):
        result, rows = self._quick_rows(
            "--models=mlp", "--runs=accum,auto", "--repeats=2"
        )
        self.assertCountEqual(rows, ["accum", "auto"])
        for r in rows.values():
            peaks = r["peak_bytes_repeats"]
            self.assertLen(peaks, 2)
            self.assertEqual(r["peak_bytes"], statistics.median(peaks))
        # "auto" without a limit: whole batches, one update each.
        self.assertEqual(rows["auto"]["fit_batch"], 4)
        self.assertEqual(rows["auto"]["updates"], 4)
        self.assertRegex(result.stdout, r"\| mlp \| adamw \| auto \| 4 \|")

    def test_memory_model_by_hand(self):
        # Plain at 8 and 2 samples: 600 and 300 bytes over the static ones,
        # so 50 bytes per sample and a constant of 200. Static: weights 1000,
        # slots 2000, accumulators 100 (AccumModel, built-in), gradients 100
        # (plain), 200 (built-in: also every `g + acc`), none (AccumModel:
        # never all alive at once): AccumModel is predicted at
        # 1000 + 2000 + 100 + 2 * 50 + 200, the built-in option 200 above.
        def row(run, micro, n, peak, accumulators=0, **kwargs):
            return dict(
                dict(
                    model="m",
                    optimizer="adamw",
                    run=run,
                    micro_batch=micro,
                    accum_steps=n,
                    peak_bytes=peak,
                    weight_bytes=1000,
                    optimizer_slot_bytes=2000,
                    trainable_bytes=100,
                    sparse_gradient_bytes=0,
                    trainable_parameters=25,
                    accumulator_bytes=accumulators,
                    samples_per_second=1.0,
                    device_name="CPU:0",
                ),
                **kwargs,
            )

        # SGD frees each gradient in its update: plain fit holds none at its
        # peak, so its static bytes are the weights alone (1000), the same a
        # and c follow from 1600 and 1300, and AccumModel adds its
        # accumulators: 1000 + 100 + 2 * 50 + 200 = 1400.
        sgd = dict(optimizer="sgd", optimizer_slot_bytes=0)
        # Model "s": 40 of its 100 trainable bytes get a sparse gradient, so
        # plain fit holds 60 dense ones: static 3060, the same a and c as
        # "m", and AccumModel 40 above plain at its micro-batch.
        sparse = dict(model="s", sparse_gradient_bytes=40)
        xla = dict(model="x", jit_compile="true")
        rows = [
            row("plain_E", 8, 1, 3700, input_bytes_per_sample=5),
            row("plain_B", 2, 1, 3400),
            row("accum", 2, 4, 3410, 100),
            row("builtin", 2, 4, 3600, 100),
            row("plain_E", 8, 1, 1600, **sgd),
            row("plain_B", 2, 1, 1300, **sgd),
            row("accum", 2, 4, 1414, 100, **sgd),
            row("plain_E", 8, 1, 3660, **sparse),
            row("plain_B", 2, 1, 3360, **sparse),
            # 1000 + 2000 + 100 + 2 * 50 + 200 = 3400.
            row("accum", 2, 4, 3440, 100, **sparse),
            # Under XLA AccumModel holds plain fit's gradient copy besides
            # its accumulators: a = 40, c = 200 from 3620 and 3380, so
            # 1000 + 2000 + 100 + 100 + 2 * 40 + 200 = 3480.
            row("plain_E", 8, 1, 3620, **xla),
            row("plain_B", 2, 1, 3380, **xla),
            row("accum", 2, 4, 3550, 100, **xla),
            # micro_batch_size=2 at 8: AccumModel's bytes (each slice's
            # gradients go into its accumulators) and the batch's inputs,
            # 8 * 5 bytes: 3400 + 40 = 3440; under XLA, 3480. Unknown
            # inputs: no prediction.
            row("split", 2, 4, 3600, 100, input_bytes_per_sample=5),
            row("split", 2, 4, 1500, 100, **sgd),
            row("split", 2, 4, 3600, 100, input_bytes_per_sample=0, **xla),
        ]
        path = os.path.join(tempfile.mkdtemp(), "rows.json")
        with open(path, "w") as f:
            json.dump({"rows": rows[:7]}, f)
        other = os.path.join(tempfile.mkdtemp(), "rows.json")
        with open(other, "w") as f:
            json.dump({"rows": rows[7:]}, f)
        result = _run_benchmark("bench_memory.py", f"--report={path},{other}")
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        # Bytes print as MiB; the error column is exact.
        self.assertIn("| m | adamw | accum_4 | 2 |", result.stdout)
        self.assertIn("| -0.3% |", result.stdout)  # 3400 against 3410
        self.assertIn("| +0.0% |", result.stdout)  # builtin: 3600
        self.assertIn("| -1.0% |", result.stdout)  # SGD: 1400 against 1414
        self.assertIn("| -1.2% |", result.stdout)  # sparse: 3400 against 3440
        self.assertIn("| -2.0% |", result.stdout)  # XLA: 3480 against 3550
        # The built-in option saves from E = 200 / (50 * 3/4) = 5.3;
        # AccumModel holds nothing more than plain fit with AdamW, 40 more
        # where 40 bytes of gradients are sparse (40 / (50 * 3/4) = 1.1),
        # and its accumulators more with SGD (100 / (50 * 3/4) = 2.7).
        self.assertIn("| 0.0 (N=4) | 5.3 (N=4) |", result.stdout)
        self.assertIn("| 1.1 (N=4) | 5.3 (N=4) |", result.stdout)
        self.assertIn("| 2.7 (N=4) | 5.3 (N=4) |", result.stdout)
        # Under XLA it holds its accumulators more: 100 / (40 * 3/4) = 3.3;
        # the built-in option 200 / 30 = 6.7.
        self.assertIn("| 3.3 (N=4) | 6.7 (N=4) |", result.stdout)
        # micro_batch_size holds what AccumModel holds, and inputs that grow
        # with E: nothing more than plain fit here; not known without the
        # inputs' size.
        self.assertIn("| 0.0 (N=4) | 5.3 (N=4) | 0.0 (N=4) |", result.stdout)
        self.assertIn("| 2.7 (N=4) | 5.3 (N=4) | - |", result.stdout)
        self.assertIn("| m | adamw | split_4 | 2 |", result.stdout)
        self.assertIn("| -4.4% |", result.stdout)  # 3440 against 3600
        self.assertIn("| -3.3% |", result.stdout)  # XLA: 3480 against 3600
        # Side by side, in MiB (0 here), with the errors.
        for line in (
            "| m | adamw | 8 = 4 x 2 | 0 / fitted | 0 / 0 (-0.3%) | "
            "0 / 0 (-4.4%) | 0 / 0 |",
            "| m | sgd | 8 = 4 x 2 | 0 / fitted | 0 / 0 (-1.0%) | 0 / n/a | "
            "0 / n/a |",
            "| x | adamw | 8 = 4 x 2 | 0 / fitted | 0 / 0 (-2.0%) | "
            "0 / 0 (-3.3%) | 0 / 0 |",
        ):
            self.assertIn(line, result.stdout)


class BenchFirstFitTest(tf.test.TestCase):
    def test_quick_run_times_every_configuration(self):
        path = os.path.join(tempfile.mkdtemp(), "first.json")
        result = _run_benchmark(
            "bench_first_fit.py",
            "--quick",
            "--models=mlp",
            "--windows=2",
            "--repeats=1",
            f"--json={path}",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(path) as f:
            report = json.load(f)
        self.assertCountEqual(
            [r["config"] for r in report["rows"]],
            ["plain", "accum", "accum_nojit"],
        )
        for r in report["rows"]:
            self.assertGreater(r["first_window_seconds"], 0)
            self.assertGreater(r["steady_window_seconds"], 0)
        # Plain fit updates at every batch; the others once per window.
        updates = {r["config"]: r["updates"] for r in report["rows"]}
        self.assertEqual(updates, {"plain": 6, "accum": 3, "accum_nojit": 3})
        summary = report["summary"]["mlp"]
        self.assertIn("break_even_updates", summary)
        self.assertIn("updates to pay for it", result.stdout)


if __name__ == "__main__":
    tf.test.main()
