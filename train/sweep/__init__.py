"""`python -m train.sweep`: one recipe grid x seeds trained on one cache, with error bars.

Every run is the real `python -m train` command (`jobs`), the grid and its checks are `grid`,
the report over seeds is `report` (which reads runs with `train.proof.compare`). Nothing in the
training path imports this package.
"""
