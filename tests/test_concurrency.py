"""A loaded artifact called from many threads at once: every output as the single-threaded run's.

A Relax VM keeps per-call state, so one VM shared by threads segfaults or mixes up registers;
``CompiledModel`` hands each call in flight a VM of its own. The bundled BERT runs 22 kernels
(several parallel across cores) per call, so interleaved calls overlap in every kind of kernel.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tvm

import helpers
import tvm_fusion
from tvm_fusion import api

BERT = helpers.EXAMPLES / "bert_tiny.onnx"
THREADS = 8
SEQUENCE = 64
CALLS = 200

# The deployment recipe of docs (plain TVM, no tvm_fusion): one VM per thread over one module.
PLAIN_TVM_PER_THREAD = """
import json, sys, threading
import numpy as np
import tvm
from tvm import relax
folder = sys.argv[1]
meta = json.load(open(folder + "/metadata.json"))
module = tvm.runtime.load_module(folder + "/" + meta["library"])
inputs = np.load(sys.argv[2])
threads, calls = int(sys.argv[3]), int(sys.argv[4])
feeds = [[tvm.runtime.tensor(inputs[f"{spec['name']}_{k}"]) for spec in meta["inputs"]] for k in range(threads)]
results = [[] for _ in range(threads)]
def work(k):
    main = relax.VirtualMachine(module, tvm.cpu())["main"]
    for _ in range(calls):
        results[k].append(main(*feeds[k]).numpy())
workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
np.savez(sys.argv[5], **{f"out_{k}_{i}": r for k in range(threads) for i, r in enumerate(results[k])})
assert not any(name.startswith("tvm_fusion") for name in sys.modules), "tvm_fusion was imported"
"""


@pytest.fixture(scope="module")
def bert_artifact(tmp_path_factory, config_factory):
    out = tmp_path_factory.mktemp("concurrency")
    return api.compile_model(BERT, config_factory(schedule="default"), [f"input_ids:1x{SEQUENCE}"], out).artifact


def distinct_inputs(count: int) -> list[dict[str, np.ndarray]]:
    """Token ids differ per thread (so a mixed-up call shows); masks are 0/1 as a tokenizer gives."""
    rng = np.random.default_rng(5)
    return [{"input_ids": rng.integers(0, 512, (1, SEQUENCE)).astype(np.int64),
             "attention_mask": (rng.random((1, SEQUENCE)) < 0.9).astype(np.int64)} for _ in range(count)]


def run_threads(work, count: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(k):
        try:
            work(k)
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    workers = [threading.Thread(target=guarded, args=(k,)) for k in range(count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return errors


def test_eight_threads_on_one_loaded_model_match_single_threaded_runs(bert_artifact):
    model = tvm_fusion.load(bert_artifact)
    feeds = distinct_inputs(THREADS)
    expected = [model.run(feed)["last_hidden_state"] for feed in feeds]
    assert not any(np.array_equal(expected[0], other) for other in expected[1:]), "inputs too alike"
    mismatches = [0] * THREADS

    def work(k):
        for _ in range(CALLS):
            got = model.run(feeds[k])["last_hidden_state"]
            mismatches[k] += not np.array_equal(got, expected[k])

    assert run_threads(work, THREADS) == []
    assert mismatches == [0] * THREADS


def test_a_failing_call_leaves_the_model_usable_from_other_threads(bert_artifact):
    """A call that raises inside the VM (here: tensors of the wrong shape, past ``prepare``)
    does not hand its half-run VM to the next caller."""
    model = tvm_fusion.load(bert_artifact)
    feed = distinct_inputs(1)[0]
    expected = model.run(feed)["last_hidden_state"]
    wrong = [tvm.runtime.tensor(np.zeros((1, SEQUENCE // 2), np.int64)), tvm.runtime.tensor(np.zeros((1, SEQUENCE // 2), np.int64))]
    failures = []

    def work(k):
        for _ in range(20):
            if k % 2:
                with pytest.raises(Exception):
                    model.run_prepared(wrong)
                failures.append(k)
            else:
                assert np.array_equal(model.run(feed)["last_hidden_state"], expected)

    assert run_threads(work, 4) == []
    assert len(failures) == 40
    assert np.array_equal(model.run(feed)["last_hidden_state"], expected)


def test_plain_tvm_recipe_with_a_vm_per_thread_matches(tmp_path, bert_artifact):
    feeds = distinct_inputs(4)
    model = tvm_fusion.load(bert_artifact)
    expected = [model.run(feed)["last_hidden_state"] for feed in feeds]
    np.savez(tmp_path / "in.npz", **{f"{name}_{k}": value for k, feed in enumerate(feeds)
                                      for name, value in feed.items()})
    proc = helpers.run_python(PLAIN_TVM_PER_THREAD, str(bert_artifact), str(tmp_path / "in.npz"), "4", "50",
                              str(tmp_path / "out.npz"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out.npz")
    assert len(got.files) == 200
    for k in range(4):
        for i in range(50):
            assert np.array_equal(got[f"out_{k}_{i}"], expected[k]), (k, i)
