"""Training-like steps from an offline plan, each sum checked against its
exact value, with PERSEUS_OFFLINE_NEG_CHECK_N_STEPS and the test fault
PERSEUS_TEST_PLAN_SWAP set by the caller.

Prints one line per step: `STEP <k> OK|WRONG <offline steps so far> <control
bytes sent so far>`, and
`FAILED <k> <message>` when a step's collectives fail (then exits 1), or
`DONE <plan checks>` after the last step.
"""

import sys

import numpy as np

from perseus_tf._native import DTYPE_CODES, OP_ALLREDUCE, _core

from rank_checks import start_native

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
# argv[2]: offline_neg_check_n_steps as an init() argument (the environment's otherwise).
OPTIONS = {"offline_neg_check_n_steps": int(sys.argv[2])} if len(sys.argv) > 2 else {}
R, N = start_native(**OPTIONS)
NAMES = [f"check.g{i}" for i in range(24)]  # all the same shape: a swap still fits

for k in range(STEPS):
    # Tensor i holds (rank + 1) * (i + 1) + k: the sum tells tensors apart.
    arrays = [np.full(5, (R + 1) * (i + 1) + k, np.float32) for i in range(len(NAMES))]
    handles = [_core.submit(OP_ALLREDUCE, a, n, DTYPE_CODES["float32"], output=a, plannable=True)
               for n, a in zip(NAMES, arrays)][::-1]
    try:
        for h in handles:
            h.wait()
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        print(f"FAILED {k} {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    right = all(np.array_equal(a, np.full(5, (i + 1) * N * (N + 1) // 2 + N * k, np.float32))
                for i, a in enumerate(arrays))
    st = _core.stats()
    print(f"STEP {k} {'OK' if right else 'WRONG'} {st['offline_steps']} {st['control_bytes_sent']}",
          flush=True)
print(f"DONE {_core.stats()['plan_checks']}", flush=True)
