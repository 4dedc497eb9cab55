"""Elastic jobs: perseusrun --min-np/--max-np/--host-discovery-script with
Horovod's elastic API (tests/workers/elastic_worker.py). Workers die and
the job goes on smaller (rank 0 included: the store is perseusrun's), a
discovered slot makes it grow, too few workers fail it on time. The weights
are checked against the schedule of sizes each worker recorded: a step
counts for the size it ran at, and no committed step is lost or repeated.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from harness import ROOT, WORKERS, rank_env

PERSEUSRUN = [sys.executable, "-m", "perseus_tf.runner"]
WORKER = [sys.executable, os.path.join(WORKERS, "elastic_worker.py")]
ENV = {"GLOO_TIMEOUT_SECONDS": "30", "PERSEUS_STALL_TIMEOUT_SECONDS": "60"}


def _run(args, out, steps, kills="", env=None, timeout=300):
    cmd = PERSEUSRUN + args + ["--"] + WORKER + [str(out), str(steps), kills]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=rank_env(dict(ENV, **(env or {}))), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    return proc, time.monotonic() - start


def _results(out):
    found = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                found[name[:-5].replace("_", ":")] = json.load(f)
    return found


def _reference(history):
    """The weights of the recorded schedule: step s at size n adds 0.01 * n * (s + 1)."""
    return np.full(4, sum(0.01 * n * (s + 1) for s, n in history))


def _check_training(results, steps, commit_every=2):
    """Every finishing worker has the same weights, which are those of its
    recorded schedule; the schedule has each step once; each reset replayed
    fewer steps than a commit interval. Returns (history, reset times)."""
    first = next(iter(results.values()))
    history = first["history"]
    for worker, r in results.items():
        assert r["history"] == history, (worker, r["history"], history)
        np.testing.assert_allclose(r["w"], _reference(history), rtol=0, atol=1e-6,
                                   err_msg=worker)
    assert [s for s, _ in history] == list(range(len(history))), history
    assert len(history) >= steps, history
    ranks = sorted(r["rank"] for r in results.values())
    assert ranks == list(range(first["size"])), ranks
    # Steps started beyond the schedule: at each reset the step that failed,
    # and those done since the last commit (fewer than a commit interval).
    extra = len(first["starts"]) - len(history)
    assert extra <= commit_every * len(first["resets"]), (first["starts"], history)
    # Reset time: from the start of the step that failed to the next start.
    times, starts = [], first["starts"]
    for (_, n0, t0), (_, n1, t1) in zip(starts, starts[1:]):
        if n1 != n0:
            times.append(round(t1 - t0, 2))
    return history, times


def test_lost_workers_rank_0_among_them_leave_the_job_going_on_smaller(tmp_path):
    proc, took = _run(["-np", "4", "--min-np", "2", "-H", "localhost:4",
                       "--blacklist-cooldown", "600"], tmp_path, 12,
                      kills="localhost:0@3,localhost:3@7")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    results = _results(tmp_path)
    assert sorted(results) == ["localhost:1", "localhost:2"], (sorted(results), text[-3000:])
    history, times = _check_training(results, 12)
    sizes = [n for _, n in history]
    assert sizes[0] == 4 and sizes[-1] == 2 and sizes == sorted(sizes, reverse=True), history
    assert [n for n, _ in results["localhost:1"]["resets"]] == [3, 2]
    assert "reset 1: 3 ranks; left: localhost:0" in text, text[-3000:]
    assert "reset 2: 2 ranks; left: localhost:3" in text, text[-3000:]
    # Rank 0 of each new round says where its state resumed: the step of
    # the first start at the new size.
    for reset, size in ((1, 3), (2, 2)):
        step = next(s for s, n, _ in results["localhost:1"]["starts"] if n == size)
        assert f"reset {reset}: resumed at step {step}" in text, text[-3000:]
    print(f"4 -> 3 -> 2 ranks in {took:.1f} s; reset (failed step to resumed step) s: {times}")


def test_a_discovered_slot_joins_at_the_next_commit(tmp_path):
    script = tmp_path / "discover.sh"
    # Two slots until a worker has trained, then three.
    script.write_text("#!/bin/sh\n"
                      f"if [ -e {tmp_path}/size2 ]; then echo localhost:3; "
                      "else echo localhost:2; fi\n")
    script.chmod(0o755)
    proc, took = _run(["-np", "2", "--min-np", "2", "--max-np", "3",
                       "--host-discovery-script", str(script), "--discovery-interval", "0.2"],
                      tmp_path, 4, env={"UNTIL_SIZES": "2,3", "SLOW": "0.05",
                                        "TOUCH_DIR": str(tmp_path)})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    results = _results(tmp_path)
    assert sorted(results) == ["localhost:0", "localhost:1", "localhost:2"], text[-3000:]
    history, times = _check_training(results, 4)
    sizes = [n for _, n in history]
    assert sizes[0] == 2 and sizes[-1] == 3 and sizes == sorted(sizes), history
    assert "joined: localhost:2" in text, text[-3000:]
    # The workers that were there went on from their last commit (skip_sync
    # is False for an addition: the newcomer got rank 0's state).
    assert results["localhost:2"]["resets"] == [], results["localhost:2"]
    print(f"2 -> 3 ranks in {took:.1f} s; reset s: {times}")


KERAS_WORKER = [sys.executable, os.path.join(WORKERS, "keras_elastic_worker.py")]
KERAS_ENV = dict(ENV, PERSEUS_ALLREDUCE_DTYPE="1")  # float32 gradients: one process's


def _keras_run(args, out, epochs, steps, kills="", env=None):
    cmd = PERSEUSRUN + args + ["--"] + KERAS_WORKER + [str(out), str(epochs), str(steps), kills]
    proc = subprocess.run(cmd, env=rank_env(dict(KERAS_ENV, **(env or {}))),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc, _results(out)


def _same_as_one_process(results):
    for worker, r in results.items():
        assert len(r["weights"]) == len(r["reference"]), worker
        for got, want in zip(r["weights"], r["reference"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=worker)
        # The optimizer's state (sharded: gathered whole) is one process's too.
        assert len(r["whole_state"]) == len(r["reference_state"]), worker
        for got, want in zip(r["whole_state"], r["reference_state"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=worker)


def test_keras_fit_resumes_an_interrupted_epoch_at_its_next_batch(tmp_path):
    # Horovod's Keras elastic example: a worker dies as epoch 1's batch 5
    # begins; the last commit was after batch 3 (every 2 batches). The
    # survivor's next fit trains batches 4 to 7 of epoch 1 and goes on: each
    # batch once, the weights of one process training uninterrupted. Once
    # the resumed epoch ran all 8 batches again.
    proc, results = _keras_run(["-np", "2", "--min-np", "1", "--max-np", "2"], tmp_path,
                               epochs=3, steps=8, kills="localhost:1@1.5")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert sorted(results) == ["localhost:0"], text[-3000:]
    r = results["localhost:0"]
    assert r["resets"] == [1] and r["state"] == [3, 0], r
    epoch1 = [b for e, b in r["trained"] if e == 1]
    assert epoch1 == [0, 1, 2, 3, 4, 4, 5, 6, 7], r["trained"]  # batch 4: rolled back, again
    assert [b for e, b in r["trained"] if e != 1] == list(range(8)) * 2, r["trained"]
    _same_as_one_process(results)
    assert "resumed at epoch 1, batch 4" in text, text[-3000:]


@pytest.mark.parametrize("np_,kill", [(3, "localhost:0@1.5"), (2, "localhost:1@1.5")],
                         ids=["3to2_rank0_dies", "2to1"])
def test_keras_sharded_state_is_shared_out_again_when_a_worker_dies(tmp_path, np_, kill):
    # shard_optimizer_state=True under hvd.elastic: every commit keeps the
    # whole state on every rank, so the survivors of rank 0's death hold
    # its share; the reset shares the state out for the new world (other
    # owners, at 1 rank none) and fit traces its step again. Adam's moments
    # and weights end as one process's.
    proc, results = _keras_run(["-np", str(np_), "--min-np", "1", "--max-np", str(np_)],
                               tmp_path, epochs=3, steps=8, kills=kill,
                               env={"SHARD": "1", "OPTIMIZER": "adam"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert len(results) == np_ - 1, text[-3000:]
    for r in results.values():
        assert r["resets"] == [np_ - 1] and r["state"] == [3, 0], r
        # Sharded at 2 (the first kernel's slots split into pieces), not at 1.
        assert bool(_pieces(r)) == (np_ - 1 > 1), r["state_shapes"]
    _same_as_one_process(results)


def _pieces(r):
    """The shapes of a worker's optimizer variables that hold a piece of a
    split variable's slot: neither the whole shape nor a placeholder's."""
    whole = [list(np.shape(v)) for v in r["reference_state"]]
    return [s for s, w in zip(r["state_shapes"], whole) if s not in (w, [0])]


@pytest.mark.parametrize("shard,start", [(False, 2), (True, 2), (True, 1)],
                         ids=["unsharded", "sharded", "sharded_from_1"])
def test_a_keras_worker_joining_before_its_first_step_syncs_at_once(tmp_path, shard, start):
    # The joining worker has compiled its model but not trained, so its
    # optimizer has no momentum slots nor step counter yet, while the
    # others have them. Once the state sync broadcast different lists and
    # the job stalled (the stall inspector after 60 s); now the newcomer
    # builds them first and the job goes on with one more. From 1 rank,
    # sharded: the first rank's whole slots (one rank applies unsharded)
    # become its share at 2, and its step is traced again.
    script = tmp_path / "discover.sh"
    touch = tmp_path / "commits"
    touch.mkdir()
    script.write_text("#!/bin/sh\n"
                      f"if [ -e {touch}/epoch1 ]; then echo localhost:{start + 1}; "
                      f"else echo localhost:{start}; fi\n")
    script.chmod(0o755)
    proc, results = _keras_run(["-np", str(start), "--min-np", str(start),
                                "--max-np", str(start + 1),
                                "--host-discovery-script", str(script),
                                "--discovery-interval", "0.2"],
                               tmp_path, epochs=400, steps=8,
                               env={"UNTIL_SIZE": str(start + 1), "TOUCH_DIR": str(touch),
                                    **({"SHARD": "1", "OPTIMIZER": "adam"} if shard else {})})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    workers = [f"localhost:{i}" for i in range(start + 1)]
    assert sorted(results) == workers, text[-3000:]
    assert f"joined: localhost:{start}" in text, text[-3000:]
    sizes = results["localhost:0"]["sizes"]
    assert sizes[-1] == start + 1 and sizes[0] == start, sizes
    for r in results.values():
        assert r["sizes"] == sizes and r["state"] == [len(sizes), 0], r
        if shard:   # each rank keeps its pieces of the first kernel's slots
            assert _pieces(r), r["state_shapes"]
    newcomer = results[f"localhost:{start}"]
    assert newcomer["resets"] == [] and newcomer["trained"], newcomer
    assert newcomer["seconds"] < 30, newcomer["seconds"]  # its sync and its epochs
    assert "stall" not in text.lower(), text[-3000:]
    _same_as_one_process(results)


def test_fewer_than_min_np_fails_within_the_elastic_timeout(tmp_path):
    # The timeout also bounds how far apart the first round's workers may ask
    # (their TensorFlow imports): 3 s was too little on a loaded machine,
    # where the first round itself timed out.
    proc, took = _run(["-np", "2", "--min-np", "2", "-H", "localhost:2", "--elastic-timeout", "10",
                       "--blacklist-cooldown", "600"], tmp_path, 8, kills="localhost:1@2")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "only 1 workers are alive, fewer than --min-np 2" in text, text[-3000:]
    # The survivor's reset got the same error as its answer.
    assert "[localhost:0]" in text and "elastic worker localhost:0" in text, text[-3000:]
    assert took < 120, took
    assert _results(tmp_path) == {}


@pytest.mark.parametrize("args,message", [
    (["-np", "2", "--min-np", "3"], "1 <= --min-np (3) <= -np (2) <= --max-np (2)"),
    (["-np", "4", "--max-np", "3"], "--max-np (3)"),
    (["-np", "2", "--max-np", "3", "--mpi"], "--mpi starts a fixed set of ranks"),
    (["-np", "2", "--host-discovery-script", "/nonexistent"], "not an executable file"),
    (["-np", "2", "--max-np", "3", "--elastic-timeout", "0"], "--elastic-timeout 0.0: must be"),
])
def test_elastic_usage_mistakes_are_named(args, message):
    proc = subprocess.run(PERSEUSRUN + args + ["--", "true"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=rank_env())
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ---- across hosts: network namespaces with their own sshd -------------------

@pytest.fixture(scope="module")
def hosts():
    from netns_hosts import NetnsHosts, missing_requirements
    why_not = missing_requirements()
    if why_not is not None:
        pytest.skip(f"cross-host tests: {why_not}")
    with NetnsHosts(2) as h:
        yield h


def _start_on(hosts, args, out, steps, kills="", env=None):
    exports = [a for name in (env or {}) for a in ("-x", name)]  # to the other host too
    cmd = (PERSEUSRUN + args + exports + ["-i", hosts.key, "--"] + WORKER
           + [str(out), str(steps), kills])
    return hosts.popen(0, cmd, env=rank_env(dict(ENV, **(env or {}))), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path, proc, within_s):
    deadline = time.monotonic() + within_s
    while not os.path.exists(path):
        assert proc.poll() is None, f"the job ended before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {within_s} s"
        time.sleep(0.1)


def test_two_hosts_a_killed_rank_leaves_three_that_finish(hosts, tmp_path):
    a, b = hosts.addrs
    proc = _start_on(hosts, ["-np", "4", "--min-np", "3", "-H", f"{a}:2,{b}:2",
                             "--blacklist-cooldown", "600"], tmp_path, 12, kills=f"{b}:1@5")
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, text[-4000:]
    results = _results(tmp_path)
    assert sorted(results) == sorted([f"{a}:0", f"{a}:1", f"{b}:0"]), text[-3000:]
    history, times = _check_training(results, 12)
    assert [n for _, n in history][:4] == [4] * 4 and history[-1][1] == 3, history
    assert f"reset 1: 3 ranks; left: {b}:1" in text, text[-3000:]
    print(f"2 hosts, 4 -> 3 ranks; reset (failed step to resumed step) s: {times}")


def test_a_lost_host_comes_back_and_the_job_grows_to_four(hosts, tmp_path):
    a, b = hosts.addrs
    down = tmp_path / "b_down"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho {a}:2\n[ -e {down} ] || echo {b}:2\n")
    script.chmod(0o755)
    proc = _start_on(hosts, ["-np", "4", "--min-np", "2", "--max-np", "4",
                             "--host-discovery-script", str(script), "--discovery-interval", "0.3",
                             "--blacklist-cooldown", "1"], tmp_path, 4,
                     env={"UNTIL_SIZES": "4,2,4", "SLOW": "0.05", "TOUCH_DIR": str(tmp_path)})
    try:
        _wait_for(tmp_path / "size4", proc, 120)
        down.touch()
        hosts.kill_host(1)  # its ranks, its remote.py and its sshd
        _wait_for(tmp_path / "size2", proc, 120)
        hosts.restart_sshd(1)
        down.unlink()
        text = proc.communicate(timeout=300)[0]
    except (AssertionError, subprocess.TimeoutExpired) as err:
        proc.kill()
        raise AssertionError(f"{err}\n--- output ---\n{proc.communicate()[0][-5000:]}") from None
    assert proc.returncode == 0, text[-4000:]
    results = _results(tmp_path)
    assert sorted(results) == sorted([f"{a}:0", f"{a}:1", f"{b}:0", f"{b}:1"]), text[-3000:]
    # The newcomers on b joined at a commit; their history is rank 0's.
    history, times = _check_training(results, 4)
    runs = [n for i, (_, n) in enumerate(history) if i == 0 or history[i - 1][1] != n]
    assert runs == [4, 2, 4], (runs, history)
    assert f"left: {b}:0, {b}:1" in text and f"joined: {b}:0, {b}:1" in text, text[-3000:]
    print(f"2 hosts: 4 -> 2 -> 4 ranks; reset s: {times}")
