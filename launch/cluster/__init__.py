"""Local cluster tooling: worker processes, shaped networks, resource caps, TF servers.

- :mod:`launch.cluster.local`: N copies of a command as a local multi-worker cluster
  (``TF_CONFIG`` per worker, streamed output, tear-down on failure: the package's
  :mod:`tf_blocksparse.launcher`, ``tfbs-run``), optionally on a shaped network;
- :mod:`launch.cluster.netem`, :mod:`launch.cluster.namespaces`, :mod:`launch.cluster.probe`:
  every worker in its own network namespace with ``tc``-shaped links (root only), and
  link measurements;
- :mod:`launch.cluster.cgroups`: memory / CPU caps per process (cgroup v1, root only);
- :mod:`launch.cluster.tf_cluster`: worker ``tf.distribute.Server``-s plus one client
  driving them, on shaped links and capped resources.

The command lines are ``python -m launch.local_cluster`` and ``python -m launch.netem``.
"""
