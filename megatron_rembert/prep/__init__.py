"""Data preparation, offline: corpus folder -> SentencePiece tokenizer -> dataset folder of
packed Arrow shards (the format `data/shards.py` defines and the training-time loader reads).

- `corpus`: reading `DIR/<lang>/*.{txt,jsonl}[.gz]`, what is skipped and what is an error;
- `tokenizer`: training and loading the SentencePiece unigram tokenizer;
- `packing`: documents -> fixed-length `[CLS] ... [SEP]` rows; `preprocess`: the whole,
  restartable run, tokenizer threads; `progress`: its console progress bar;
- `merge`: dataset folders of disjoint languages -> one; `inspection`: summary, verification,
  decoding, the sampling table of a training config; `demo_corpus`: the synthetic corpus.

Below `prep/` only the shard format (`data.shards`, `data.common`), the sampling law the
tokenizer and the inspection share with training (`data.sampler`, `data.schedule`,
`data.config`), `run_config` (to read a training config's schedule) and the ground floor;
`data/` never imports `prep/`. See docs/data.md.
"""
