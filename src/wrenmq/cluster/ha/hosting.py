"""The brokers a process runs for the partitions it leads.

Its own partition gets the node's broker as `wrenmq serve` assembles it (listeners,
hooks, admin listener, bridges), made anew each time the node takes its partition back.
A partition taken over from a lost node gets a broker *for that node* (a hosted broker),
on the replica's files: the same core Broker, with no listener (no client connects to
it: a client of the lost node reconnects to any node and claims its session from it
over the links), its own link port advertised on this host, the lost node's name as its
cluster node name and log partition, and nothing that speaks for the cluster as a whole
(bridges, hooks, webhooks, $SYS). It restores the lost node's sessions, wills, retained
messages and marks as a restart of that node would, and the cluster's own machinery
(replays, session moves, wills) does the rest.
"""

import copy
import os

from ...store.replica import replica_dir


def partition_dir(config, partition, node):
    """Where this process keeps `partition`: the data dir itself for its own, else
    `replicas/<partition>/` under it."""
    data_dir = os.path.abspath(config.storage.data_dir)
    return data_dir if partition == node else replica_dir(data_dir, partition)


def hosted_config(config, partition, directory):
    """The configuration of a broker for node `partition` hosted in this process, on the
    replica in `directory`."""
    c = copy.deepcopy(config)
    c.listener = []
    c.storage.data_dir = directory
    c.broker.node_id = partition
    c.broker.pid_file = ""
    c.cluster.node = partition
    c.cluster.port = 0
    c.cluster.advertise = ""
    c.bridge = []
    c.hook = []
    c.webhook = []
    c.sys.interval = 0
    return c


def hosted_broker(config, cluster):
    """A core Broker for a hosted partition, with `cluster` (its ClusterExtension) and the
    node's `[auth]` hook only (no listener, no configured hooks): what it delivers to the
    sessions it holds is authorized as on the node itself."""
    from ...auth.hook import build_auth_hook
    from ...broker.broker import Broker

    auth = build_auth_hook(config)
    broker = Broker(config, auth)
    auth.chain = broker.hooks
    auth.router = broker.router
    broker.add_extension(cluster)
    return broker
