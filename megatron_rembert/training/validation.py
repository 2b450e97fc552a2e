"""Validation during training: loss and accuracy on the fixed validation set per language,
their combination (token-weighted and language-averaged), and retrieval accuracy."""

from __future__ import annotations

from megatron_rembert.data.loader import build_validation_set
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.hang import POSITION
from megatron_rembert.training.metrics import MetricsLogger
from megatron_rembert.training.plan import RunPlan


def evaluate(trainer, config: Config, plan: RunPlan, sha: str | None, step: int,
             log: MetricsLogger) -> None:
    """Loss and accuracy on the fixed validation set, per language and overall: token-weighted
    (all masked tokens together) and language-averaged (the mean of the languages' numbers).
    Each language is evaluated in whole global batches (padding rows carry no weight). With
    eval.retrieval_path, each language's retrieval accuracy@1 to and from English joins its
    numbers in the same row (training/retrieval.py)."""
    from megatron_rembert.training.retrieval import add_retrieval, pooled_layer, retrieval_accuracy

    layout = plan.layout
    per_language = min(config.eval.sequences_per_language,
                       config.train.eval_batches * layout.global_batch_size)
    valid = build_validation_set(config.data, layout, plan.data, seed=config.train.seed,
                                 per_language=per_language, tokenizer_sha256=sha)
    languages = {}
    for index, lang in enumerate(valid.languages):
        batches = valid.batches(index)
        if not batches:
            continue
        loss, acc, tokens = trainer.eval_step(batches)
        languages[lang] = {"loss": loss, "mlm_acc": acc, "masked_tokens": tokens}
    retrieval = {}
    if config.eval.retrieval_path:
        POSITION.set(phase="retrieval")
        retrieval = retrieval_accuracy(trainer, config)
    if not languages and not retrieval:
        log.console("validation split is empty: nothing to evaluate")
        return
    overall = combine_languages(languages) if languages else {}
    if retrieval:
        add_retrieval(overall, retrieval)
    log.log(step, overall, prefix="valid")
    if languages:
        log.console(f"step {step:>7} | validation loss {overall['loss']:.4f} | acc "
                    f"{overall['mlm_acc']:.3f} | language average loss "
                    f"{overall['loss_lang_avg']:.4f} acc {overall['mlm_acc_lang_avg']:.3f}")
    if retrieval:
        log.console(f"step {step:>7} | retrieval acc@1 to en {overall['retrieval_to_en']:.3f}"
                    f" from en {overall['retrieval_from_en']:.3f} (chance "
                    f"{overall['retrieval_chance']:.3f}; {len(retrieval)} languages, layer "
                    f"{pooled_layer(config)})")


def combine_languages(languages: dict[str, dict]) -> dict:
    """Overall validation numbers from the per-language ones (kept under "languages")."""
    tokens = sum(v["masked_tokens"] for v in languages.values())
    n = len(languages)
    return {
        "loss": sum(v["loss"] * v["masked_tokens"] for v in languages.values()) / max(tokens, 1),
        "mlm_acc": sum(v["mlm_acc"] * v["masked_tokens"]
                       for v in languages.values()) / max(tokens, 1),
        "masked_tokens": tokens,
        "loss_lang_avg": sum(v["loss"] for v in languages.values()) / n,
        "mlm_acc_lang_avg": sum(v["mlm_acc"] for v in languages.values()) / n,
        "languages": languages,
    }
