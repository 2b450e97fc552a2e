"""The training-time data path: shards -> sampled, masked micro-batches.

- `shards`: the shard format (Arrow IPC files and `manifest.json`) and its zero-copy reader;
  the one thing `prep/` writes and this package reads;
- `config`: the `data:` section of the run's config; `schedule`: mask rate and language mix by
  phase; `sampler`: the language-weighted sample stream, a pure function of (seed, index);
- `masking`: MLM masking, a pure function of (seed, sample index); `batch`: the micro-batch's
  keys, dtypes and shapes, defined once; `loader`: worker processes, in-order delivery;
- `common`: the error type, the special ids, an ordered map over a pool.

Numpy only (torch tensors only at the loader's edge); no torch.distributed: ranks and sizes
are passed in (a `parallel.layout.Layout`). Corpus reading, the tokenizer and preprocessing
live in `prep/`. See docs/data.md.
"""
