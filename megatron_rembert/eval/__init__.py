"""Evaluation of pre-trained encoders: cross-lingual retrieval and zero-shot classification,
always beside the same architecture at step 0, a bag-of-tokens baseline and chance."""
