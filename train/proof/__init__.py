"""Tools that prove a trained drafter; nothing in the training path imports them.

`python -m train.proof.speculate`: speculative decoding with the target (`decode`), lossless
against the target's greedy decoding, and its acceptance length; `python -m
train.proof.serve_check`: the export served by a real engine (vLLM) and checked against our
decoding; `python -m train.proof.compare`: runs trained on one cache side by side; `python -m
train.proof.tau`: speculate's taus with standard errors, paired against the first drafter.
"""
