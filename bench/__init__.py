"""Benchmarks of natgw-agent against the legacy script's way, kube-proxy's way and an
iptables linear chain. `python -m bench.run [--quick] [--out DIR]`; see bench/run.py.

Every case runs in network namespaces created for it and deleted after it (also on
failure or Ctrl-C); nothing here touches the root namespace's nftables or iptables."""
