"""Perseus-TF's benchmarks, all in this folder: collectives/ (`python -m
benchmarks.collectives`, the runtime's allreduce and a training step's
gradient set against raw Gloo) and the scripts beside it (Keras
throughput, step overlap, one host, Horovod, the TF adapter, a
bandwidth-shaped link between network-namespace hosts). Run them from the
checkout's root."""
