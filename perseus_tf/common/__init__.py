"""What both the launcher (perseus_tf.runner) and the library need: the
rendezvous store (server, client and the protocol the C++ client speaks),
per-rank scratch folders, and Slurm's list syntax. Only the standard library:
this package imports nothing else of perseus_tf (tests/test_layout.py).

  store.py           the rendezvous store: StoreServer, StoreClient
  store_protocol.py  the store's wire protocol (cc/rendezvous/store_protocol.h is made from it)
  scratch.py         per-rank scratch folders of a job, and their removal
  slurm.py           Slurm's host lists and task counts
"""
