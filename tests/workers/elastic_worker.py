"""A worker of an elastic job under perseusrun --min-np/--max-np.

Usage: elastic_worker.py OUT_DIR STEPS [KILL]. Trains a toy model with
hvd.elastic.run: each step adds 0.01 * allreduce-sum(step + 1) (so a step
counts for the size it ran at) to w, records (step, size) in the state, and
commits every second step. KILL is "WORKER@STEP[,...]": that worker
(PERSEUS_ELASTIC_WORKER) SIGKILLs itself before STEP, in its first life
only. SLOW=seconds sleeps after each step; UNTIL_SIZES=a,b,... trains on
past STEPS until the sizes the steps ran at have gone through a, b, ... in
that order and STEPS steps have run at the last (waiting for workers to
leave or join); TOUCH_DIR=dir gets a file size<N> once a commit is made at
size N. Every worker that finishes writes OUT_DIR/<worker>.json: its weights,
the committed history, its sizes after each reset and the step times.
"""

import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

import perseus_tf.horovod as hvd


def main():
    faulthandler.register(signal.SIGUSR1)  # a stuck worker's stacks, on request
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    me = os.environ["PERSEUS_ELASTIC_WORKER"]
    kills = {}
    for entry in (sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else []):
        worker, at = entry.rsplit("@", 1)
        kills[worker] = int(at)
    slow = float(os.environ.get("SLOW", "0"))
    until = [int(n) for n in os.environ.get("UNTIL_SIZES", "").split(",") if n]
    touch_dir = os.environ.get("TOUCH_DIR")
    hvd.init()
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, w=np.zeros(4), step=0,
                                    history=[])
    resets, starts = [], []
    state.register_reset_callbacks([lambda: resets.append((hvd.size(), time.time()))])

    @hvd.elastic.run
    def train(state):
        def more():
            if not until:
                return state.step < steps
            runs = []  # (size, steps) of the history's runs of one size
            for _, n in state.history:
                if runs and runs[-1][0] == n:
                    runs[-1][1] += 1
                else:
                    runs.append([n, 1])
            wanted = list(until)
            for n, _ in runs:
                if wanted and n == wanted[0]:
                    wanted.pop(0)
            return wanted or runs[-1][0] != until[-1] or runs[-1][1] < steps

        while more():
            starts.append((state.step, hvd.size(), time.time()))
            if kills.get(me) == state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            g = hvd.allreduce(np.full(4, state.step + 1.0), op=hvd.Sum,
                              name=f"grad{state.step}")
            state.w = state.w + 0.01 * np.asarray(g)
            state.history = state.history + [(state.step, hvd.size())]
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
                if touch_dir:
                    open(os.path.join(touch_dir, f"size{hvd.size()}"), "a").close()
            if slow:
                time.sleep(slow)

    train(state)
    with open(os.path.join(out_dir, me.replace(":", "_") + ".json"), "w") as f:
        json.dump({"w": state.w.tolist(), "history": state.history, "rank": hvd.rank(),
                   "size": hvd.size(), "resets": resets, "starts": starts}, f)


if __name__ == "__main__":
    main()
