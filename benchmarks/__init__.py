"""The benchmarks and studies, run from the repository root as ``python -m benchmarks.<name>`` (see the Makefile).

The network benchmark is ``bench_network`` (its command line) over ``configs`` (the configurations and their
ds_config), ``netlink`` (the rate-limited namespace), ``launcher`` (one training launch in it), ``two_nodes`` (two
nodes in one namespace), ``stats`` (the launches reduced to results) and ``report`` (tables, plot, machine).
"""
