"""Retrieval between each language and English, measured while training (eval.retrieval_*).

With the validation (every train.eval_interval steps), on the held-out parallel set of
eval.retrieval_path (data/parallel_text.py: the pairs `rembert-eval --parallel` reads, the
same subset when eval.retrieval_pairs equals its --max-pairs): each sentence is encoded as
pre-training builds a sequence, `[CLS] pieces [SEP]` cut to data.seq_length, with the run's
tokenizer (as rembert-eval at --max-length data.seq_length); the output
of Transformer layer eval.retrieval_layer is mean-pooled over the real tokens; accuracy@1 by
cosine in both directions (model/retrieval.py).

Layouts: pp = 1 only (the config checks refuse pp > 1: the pooled layer lives on one stage).
The sentences of all languages, both sides, are split in contiguous chunks over the DP ranks;
TP peers embed the same chunk (their layers all-reduce inside), and one SUM all-reduce over
the DP group gives every rank all the embeddings. The forward runs under no_grad in eval mode
(dropout off: nothing is drawn from either RNG stream), training mode restored after; every
batch has one shape, that of a validation micro-batch (train.micro_batch_size x
data.seq_length), so a compiled layer is not recompiled for each sentence length.
"""

from __future__ import annotations

import functools

import torch

from megatron_rembert.data.common import SpecialIds
from megatron_rembert.data.parallel_text import read_parallel_set
from megatron_rembert.model.retrieval import accuracy_at_1, chance, mean_pool, middle_layer
from megatron_rembert.parallel import comm, state
from megatron_rembert.prep.tokenizer import load_sentencepiece
from megatron_rembert.run_config.schema import Config


def pooled_layer(config: Config) -> int:
    """The Transformer layer (1..N) whose output is pooled: eval.retrieval_layer, 0 = the
    middle one (model.retrieval.middle_layer, rembert-eval's default too)."""
    return config.eval.retrieval_layer or middle_layer(config.model.num_hidden_layers)


def encode(sp, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[CLS] pieces [SEP]` per text, pieces cut to max_length - 2, padded with [PAD] to
    max_length. Returns input_ids and attention_mask, both len(texts) x max_length int64."""
    ids = SpecialIds()
    input_ids = torch.full((len(texts), max_length), ids.pad, dtype=torch.long)
    mask = torch.zeros((len(texts), max_length), dtype=torch.long)
    for row, pieces in enumerate(sp.encode(texts)):
        seq = ids.framed(pieces, max_length)
        input_ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return input_ids, mask


@functools.lru_cache(maxsize=2)
def encoded_set(path: str, pairs: int, tokenizer: str, max_length: int
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{lang: (text ids, text mask, en ids, en mask)}, each N x max_length, read and encoded
    once per run: the pairs `rembert-eval --max-pairs pairs` reads (data/parallel_text.py)."""
    sp = load_sentencepiece(tokenizer)
    return {pset.lang: (*encode(sp, pset.texts, max_length), *encode(sp, pset.english, max_length))
            for pset in read_parallel_set(path, pairs)}


@torch.no_grad()
def embed(encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer: int,
          batch_size: int, device: torch.device) -> torch.Tensor:
    """Mean-pooled output of Transformer layer `layer` (1-based) of `encoder` (a
    model.rembert.RemBertModel), computed `batch_size` rows at a time. Inputs: N x S; returns
    N x H fp32 on `device`. The last batch is filled up with `[CLS] [SEP]` rows, so every
    batch has one shape."""
    n, seq = input_ids.shape
    out = torch.empty((n, encoder.config.hidden_size), dtype=torch.float32, device=device)
    filler_ids = torch.zeros((batch_size, seq), dtype=torch.long)
    filler_ids[:, 0], filler_ids[:, 1] = SpecialIds().cls, SpecialIds().sep
    filler_mask = (filler_ids != SpecialIds().pad).long()
    for start in range(0, n, batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        rows = len(ids)
        if rows < batch_size:
            ids = torch.cat([ids, filler_ids[rows:]])
            mask = torch.cat([mask, filler_mask[rows:]])
        ids, mask = ids.to(device), mask.to(device)
        x = encoder.embeddings(ids)  # B x S x H
        key_mask = mask.bool()
        for block in encoder.layers[:layer]:
            x = block(x, key_mask)
        out[start:start + rows] = mean_pool(x, mask)[:rows]
    return out


def pooled_embeddings(trainer, config: Config) -> tuple[dict[str, int], torch.Tensor]:
    """({lang: pairs}, pooled): the embeddings of every sentence of the parallel set, on the
    CPU, fp32, the same on every rank: for each language in turn its `text` rows, then its
    `en` rows (see the module docstring for the layout)."""
    if trainer.pipeline:
        raise RuntimeError("retrieval during training needs parallel.pp=1 (the config checks "
                           "refuse it otherwise)")
    sets = encoded_set(config.eval.retrieval_path, config.eval.retrieval_pairs,
                       config.data.tokenizer, config.data.seq_length)
    ids = torch.cat([t for v in sets.values() for t in (v[0], v[2])])
    mask = torch.cat([t for v in sets.values() for t in (v[1], v[3])])
    s = state.get_state()
    chunk = -(-len(ids) // s.layout.dp)
    lo, hi = min(s.dp_rank * chunk, len(ids)), min((s.dp_rank + 1) * chunk, len(ids))
    module = trainer.engine.module  # the plain RemBertForPreTraining at pp = 1
    was_training = module.training
    module.eval()
    try:
        mine = embed(module.rembert, ids[lo:hi], mask[lo:hi], pooled_layer(config),
                     config.train.micro_batch_size, trainer.device)
    finally:
        module.train(was_training)
    pooled = torch.zeros((len(ids), mine.shape[1]), dtype=torch.float32, device=trainer.device)
    pooled[lo:hi] = mine
    comm.all_reduce(pooled, group=s.dp_group)  # each row comes from one DP rank: a copy
    return {lang: len(v[0]) for lang, v in sets.items()}, pooled.cpu()


def retrieval_accuracy(trainer, config: Config) -> dict[str, dict]:
    """{lang: {"retrieval_to_en", "retrieval_from_en", "retrieval_pairs"}} of the trainer's
    current weights, the same on every rank."""
    pairs, pooled = pooled_embeddings(trainer, config)
    out, start = {}, 0
    for lang, n in pairs.items():
        to_en, from_en = accuracy_at_1(pooled[start:start + n], pooled[start + n:start + 2 * n])
        out[lang] = {"retrieval_to_en": to_en, "retrieval_from_en": from_en,
                     "retrieval_pairs": n}
        start += 2 * n
    return out


def add_retrieval(row: dict, retrieval: dict[str, dict]) -> None:
    """Put each language's retrieval numbers beside its validation numbers in `row`
    (row["languages"][lang]), and at the top of `row` their means over the languages and
    the mean of the languages' chance levels (1 / pairs)."""
    languages = row.setdefault("languages", {})
    for lang, numbers in retrieval.items():
        languages.setdefault(lang, {}).update(numbers)
    n = len(retrieval)
    for key in ("retrieval_to_en", "retrieval_from_en"):
        row[key] = sum(v[key] for v in retrieval.values()) / n
    row["retrieval_chance"] = sum(chance(v["retrieval_pairs"]) for v in retrieval.values()) / n
