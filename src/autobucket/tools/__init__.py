"""Tools built on the library: the route sweep, the demo, the generate job, workloads and baselines."""

__all__: list[str] = []
