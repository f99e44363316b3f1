"""The drafter families side by side over shared pieces.

Shared by every family: `config` (DrafterConfig, derived from the target's config), `mask` (the
attention masks), `anchors` (anchor sampling and per-block targets and weights) and `loss`
(chunked lm_head + cross-entropy and the acceptance metrics). One module per family: `dflash`
(the DFlash drafter), `dflash2` (DFlash2's convolutions and candidate selector, over DFlash's
layers) with its objective in `dflash2_loss` / `dflash2_fused` and `topk`, `dspark` (DSpark's
Markov and confidence heads over DFlash's layers, its anchor slot drafting too) with its
objective in `dspark_loss` and its per-slot metrics in `dspark_metrics`. `registry` builds the
family a DrafterConfig names: a new family is a module here plus its entry there.
"""
