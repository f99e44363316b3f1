"""`python -m train.sweep`: one recipe grid x seeds trained on one cache, with error bars.

`run` takes a sweep from its options to its report. Every run is the real `python -m train`
command (`jobs`), the grid and its checks are `grid`, the sweep folder's checks are `folder`,
the report over seeds is `report` (which reads runs with `train.proof.compare`). Nothing in the
training path imports this package.
"""
