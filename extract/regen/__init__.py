"""Regeneration: the target's own answers as training data, before extraction.

`python -m extract.regen` regenerates the assistant turns of a chat set with the target
(`regenerate`: the plan; `local`: one process per device, and resume; `generation`: batched
greedy decoding; `config`, `state`, `report`: its options, its output files, what it prints),
and `python -m extract.regen.prompts` writes a prompt set with the target itself. Nothing in the
extraction path imports this package.
"""
