"""Configuration: the env contract that places a rank, and the PERSEUS_* variables.

Everything a rank needs to start is read here, validated, and handed to the
native runtime as plain values, in four parts:

  settings.py    the PERSEUS_* settings: Config, VARIABLES, load_config,
                 auto_streams, and ConfigError (raised by every part)
  contracts.py   the six env contracts of launchers and schedulers
                 (perseusrun, mpirun, horovod, slurm, torchrun, TF_CONFIG):
                 find_contract, cluster_contract, cluster_from_resolver
  netaddr.py     this machine's network addresses: route_address,
                 interface_address, can_bind
  rendezvous.py  where the rendezvous store is, its secret, and this rank's
                 Topology: load_topology, store_bind_address

The names below are the package's public surface; import them from
perseus_tf.config.
"""

from perseus_tf.config.contracts import (
    LAUNCHERS, SCHEDULERS, Contract, cluster_contract, cluster_from_resolver, find_contract)
from perseus_tf.config.netaddr import can_bind, interface_address, route_address
from perseus_tf.config.rendezvous import Topology, load_topology, store_bind_address
from perseus_tf.config.settings import (
    VARIABLES, Config, ConfigError, auto_streams, load_config, unknown_variables,
    warn_unknown_variables)

__all__ = [
    "Config", "ConfigError", "VARIABLES", "load_config", "auto_streams",
    "unknown_variables", "warn_unknown_variables",
    "Contract", "LAUNCHERS", "SCHEDULERS", "find_contract", "cluster_contract",
    "cluster_from_resolver",
    "route_address", "interface_address", "can_bind",
    "Topology", "load_topology", "store_bind_address",
]
